#!/usr/bin/env bash
# GPU check in one call: kernel correctness on CUDA, the loss-kernel benchmark, (if present) the
# Megatron train-step benchmark, the FP8 block quantization's time per GB, and a one-GPU colocated loop. Everything lands in $OUT (default benchmarks/gpu_out/).
#
#   OUT=/tmp/out bash benchmarks/gpu_check.sh          # from the repository root, on a CUDA machine
#
# Needs torch with CUDA and triton; pytest for step 1; megatron-core for the megatron variant of
# step 2 and for steps 3 and 5 (without it those parts are skipped and say so; benchmarks/gpu_wheels.sh
# fetches the wheels a machine without a package registry needs). Copy the tables into
# benchmarks/RESULTS.md. Exit status: non-zero if any step that ran failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

python - <<'PY' 2>&1 | tee "$OUT/env.txt" || { echo "no usable CUDA device"; exit 2; }
import torch, triton
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print("torch", torch.__version__, "triton", triton.__version__, "device", torch.cuda.get_device_name())
PY
nvidia-smi >> "$OUT/env.txt" 2>&1 || true

echo "== 1. kernel correctness on CUDA (pytest -m gpu: triton-cuda cases of the shared suite + Qwen3-size checks)"
if python -m pytest --version >/dev/null 2>&1; then
    python -m pytest -q -m gpu -p no:cacheprovider -k "not fused_lm_head" tests/algo/test_backends.py tests/kernels/test_kernels_gpu.py 2>&1 \
        | tee "$OUT/kernel_tests.txt" || status=1
else
    echo "pytest is not installed: kernel correctness tests NOT run" | tee "$OUT/kernel_tests.txt"; status=1
fi

echo "== 2. loss-kernel benchmark (T in {2048, 8192}, V = 151936, bf16, fwd+bwd)"
variants="naive project megatron"
python -c "import megatron.core" 2>/dev/null || { variants="naive project"; echo "megatron-core missing: megatron variant skipped"; }
python benchmarks/loss_kernels.py --variants $variants --json "$OUT/loss_kernels.json" 2>&1 \
    | tee "$OUT/loss_kernels.md" || status=1

echo "== 2b. fused LM head + logprob + entropy (loss_kernels --mode lm-head: H=4096, V=151936, bf16, fwd+bwd)"
# correctness on CUDA: tests/kernels/test_fused_linear.py's torch-cuda and triton-cuda cases (against float64), and
# test_kernels_gpu.py's fused_lm_head cases (step 1 leaves them out): triton vs torch backend at Qwen3 size
# (T=1024, 4096, H=4096, bf16) and each backend's peak extra memory against its workspace bound
python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fused_linear.py \
    tests/kernels/test_kernels_gpu.py::test_fused_lm_head_triton_matches_torch_qwen3_size_on_cuda \
    tests/kernels/test_kernels_gpu.py::test_fused_lm_head_memory_stays_in_its_workspace 2>&1 \
    | tee "$OUT/fused_linear_tests.txt" \
    || status=1
# speed: "x today" of the fused rows (fused = torch row ops, fused-triton = Triton row kernels) is their
# fwd+bwd time over the unfused path's (goal <= 1.35)
python benchmarks/loss_kernels.py --mode lm-head --hidden 4096 --tokens 8192 32768 \
    --json "$OUT/lm_head.json" 2>&1 | tee "$OUT/lm_head.md" || status=1

echo "== 3. Megatron train-step benchmark"
if [ -f benchmarks/train_step.py ]; then
    if python -c "import megatron.core" 2>/dev/null; then
        python benchmarks/train_step.py 2>&1 | tee "$OUT/train_step.md" || status=1
    else
        echo "megatron-core missing: train-step benchmark skipped" | tee "$OUT/train_step.md"
    fi
else
    echo "benchmarks/train_step.py not present: skipped" | tee "$OUT/train_step.md"
fi
echo "== 4. FP8 block quantization on the GPU (rollout.weight_format=fp8_block: its cost per GB per sync)"
python benchmarks/fp8_sync.py --parts quantize --device cuda --repeats 10 \
    --json "$OUT/fp8_quantize.json" 2>&1 | tee "$OUT/fp8_quantize.md" || status=1
echo "== 5. one-GPU colocated loop (trainer.placement=colocated, ~0.5B random Qwen3, 3 steps, rollout.sync.transport=ipc)"
# a megatron-core trainer (TP=1, local spec) and the embedded server it launches on the same GPU: offload frees
# >= 90 % of the trainer's allocated GPU memory during rollout, the IPC update's logprob check passes, the
# colocate/* and time/* metrics per step (docs/placement.md). Needs megatron-core and the server's web stack
# (fastapi, uvicorn, ...): benchmarks/gpu_wheels.sh downloads them as wheels for a machine without a registry.
missing=$(python - <<'PY'
import importlib.util
print(" ".join(m for m in ("megatron.core", "fastapi", "uvicorn", "re2") if importlib.util.find_spec(m.split(".")[0]) is None
               or importlib.util.find_spec(m) is None))
PY
)
if [ -z "$missing" ]; then
    python benchmarks/colocated_gpu_check.py --device cuda --timeout-s 300 --json "$OUT/colocated.json" 2>&1 \
        | tee "$OUT/colocated.md" || status=1
else
    echo "missing $missing (benchmarks/gpu_wheels.sh): colocated loop skipped" | tee "$OUT/colocated.md"
fi
echo "gpu_check: status $status, results in $OUT"
exit $status
