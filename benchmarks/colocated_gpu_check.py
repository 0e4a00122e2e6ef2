"""One-GPU colocated loop (benchmarks/gpu_check.sh step 5): a megatron-core trainer (TP=1, local spec) and the
embedded server it launches on the same GPU (trainer.placement=colocated under torchrun, one rank), a random
Qwen3 of ~0.5B parameters, 3 colocated steps with the IPC weight transport (rollout.sync.transport=ipc).

Asserts and prints:
- offload frees >= 90 % of the trainer's allocated GPU memory during rollout: rank 0's
  torch.cuda.memory_allocated() just before the cycle offloads gradients and optimizer state (the trainer's
  whole state: parameters, gradients, Adam) against the same during the next step's rollout (after the
  parameters are offloaded too). On CPU (--device cpu, the dry run) there is no allocator to ask: every
  storage of the engine (params, grads, optimizer) must hold 0 bytes during rollout instead;
- the IPC update's logprob check passes: every step's sync/verify_max_abs_diff <= --verify-tolerance (the
  server released its weights, i.e. dropped them, before each update: only what the transport wrote is there);
- per-phase times: the step's colocate/* and time/* metrics (metrics.jsonl).

    python benchmarks/colocated_gpu_check.py                           # on a CUDA machine, ~0.5B shape
    python benchmarks/colocated_gpu_check.py --device cpu --shape tiny # the dry run on CPU

Run from the repository root (or anywhere: it puts the repository on PYTHONPATH). The model, tokenizer (the
tests' character tokenizer, its vocabulary widened to the model's: `widen_tokenizer`), data and config go to a
temporary directory (--workdir keeps them). Exit status 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE_CONFIG = ROOT / "configs" / "qwen3" / "tiny_qwen3_cpu.yaml"

# Qwen3-0.6B's layer shape (hidden 1024, 16 query / 8 KV heads of 128, MLP 3072, vocab 151936) with 14 layers
# and an untied LM head: 0.53 B parameters (15.7 M a layer, 2 x 155.6 M embedding and head). "tiny": the tests'
# tiny Qwen3 with the real vocabulary (the LM head and the transport's buckets at their real width), for the CPU
# dry run.
SHAPES = {
    "0.5b": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=14,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        initializer_range=0.02,
    ),
    "tiny": dict(vocab_size=151936),
}
MIN_FREED = 0.90


def length_parity_reward(response: str, ground_truth: str, **_) -> float:
    """A reward that splits a random model's groups (the arithmetic answer is never right): by the parity of
    the response's length in characters, so the advantages are not all zero and every step moves the weights."""
    return 1.0 if len(response) % 2 else -1.0


# ---- the driver ------------------------------------------------------------------------------------------
def prepare(workdir: Path, shape: str, dtype: str) -> tuple[Path, Path]:
    """Write the random model + tokenizer and the arithmetic data; return (model dir, train file)."""
    import torch
    from transformers import AutoTokenizer

    from megatron_dapo.data.arithmetic import ArithmeticTask, write_task
    from megatron_dapo.data.char_tokenizer import build_char_tokenizer
    from megatron_dapo.models.tiny import save_tiny_hf_model

    model = workdir / "model"
    if not (model / "config.json").exists():
        build_char_tokenizer(model)
        widen_tokenizer(model, SHAPES[shape].get("vocab_size", 256))
        tok = AutoTokenizer.from_pretrained(model)
        save_tiny_hf_model(
            "qwen3",
            model,
            dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            bos_token_id=None,
            **SHAPES[shape],
        )
    train, _ = write_task(workdir / "data", ArithmeticTask(max_operand=9, ops="+"), num_test=5)
    return model, train


def widen_tokenizer(model: Path, vocab_size: int) -> None:
    """Give every row of the model's vocabulary a word in the character tokenizer: ids past its 256 decode to
    `<id>` (plain words of its WordLevel vocabulary, never produced by encoding, which splits text into
    characters). Else a random model's responses, made of ids the tokenizer does not know, decode to nothing,
    every reward is equal and no step moves the weights."""
    path = model / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    vocab.update({f"<{i}>": i for i in range(len(vocab), vocab_size)})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(tok))
    tmp.replace(path)


def overrides(workdir: Path, model: Path, train: Path, args) -> list[str]:
    server_dtype = {"fp32": "float32", "bf16": "bfloat16"}[args.dtype]
    return [
        f"model.hf_path={model}",
        "model.hf_config=null",  # the base config mirrors the tiny vocabulary; the written model is the truth
        f"model.dtype={args.dtype}",
        f"data.train_files=[{train}]",
        "data.val_files=[]",
        f"data.max_response_length={args.response_length}",
        "algo.overlong_buffer.enable=false",
        "algo.filter_groups.enable=false",
        "algo.staleness=0",
        "algo.train_batch_size=4",
        "algo.ppo_mini_batch_size=2",
        "rollout.n_resp_per_prompt=4",
        "reward.name=benchmarks.colocated_gpu_check:length_parity_reward",
        "optimizer.lr=1e-4",
        "optimizer.lr_warmup_steps=0",
        "parallel.tp=1",
        "trainer.gpus_per_node=1",
        f"trainer.total_steps={args.steps}",
        "trainer.val_every=0",
        "trainer.placement=colocated",
        "rollout.servers=[]",
        "rollout.num_servers=1",
        "rollout.sync.transport=ipc",
        "rollout.sync.pause_mode=abort",
        "rollout.sync.bucket_mb=64",
        "rollout.sync.verify=true",
        f"rollout.sync.verify_tolerance={args.verify_tolerance}",
        f"rollout.extra_args=[--dtype,{server_dtype}]",
        "checkpoint.save_every=0",
        "checkpoint.keep_last=0",
        "logging.progress_bar=false",
        f"logging.run_dir={workdir / 'run'}",
    ]


def run_trainer(workdir: Path, over: list[str], device: str, timeout_s: float) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run on a GPU machine too
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        str(Path(__file__).resolve()),
        "--worker",
        str(BASE_CONFIG),
        str(workdir / "memory.jsonl"),
        *over,
    ]
    log_path = workdir / "torchrun.log"
    with open(log_path, "w") as log:
        # its own process group: past the timeout torchrun, the rank and the server it launched all go
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise SystemExit(f"the colocated run took over {timeout_s} s; see {log_path}") from None
    if proc.returncode != 0:
        tail = log_path.read_text()[-6000:]
        raise SystemExit(f"the colocated run failed (rc {proc.returncode}); the end of {log_path}:\n{tail}")


def check(workdir: Path, device: str, steps: int, tolerance: float) -> tuple[list[str], dict]:
    """The checks over the run's metrics and memory records; returns (failures, summary)."""
    rows = [json.loads(x) for x in (workdir / "run" / "metrics.jsonl").read_text().splitlines()]
    mem = [json.loads(x) for x in (workdir / "memory.jsonl").read_text().splitlines()]
    failures = []
    if [r["step"] for r in rows] != list(range(steps)):
        failures.append(f"steps logged {[r['step'] for r in rows]}, expected 0..{steps - 1}")
    verify = [r.get("sync/verify_max_abs_diff") for r in rows]
    if any(v is None or not v <= tolerance for v in verify):
        failures.append(f"IPC update's logprob check: sync/verify_max_abs_diff {verify} not all <= {tolerance}")
    if not any(r.get("actor/grad_norm", 0) > 0 for r in rows):
        failures.append("no step moved the weights (every gradient 0): the logprob check saw only the initial ones")
    rollout = {m["step"]: m for m in mem if m["phase"] == "rollout"}
    trained = {m["step"]: m for m in mem if m["phase"] == "trained"}
    freed = {}
    for step, m in sorted(trained.items()):  # else "0 bytes during rollout" would prove nothing
        if not all(m[p] > 0 for p in ("params", "grads", "optimizer")):
            failures.append(f"step {step} after training: a part of the engine holds no bytes {m}")
    for step, m in sorted(rollout.items()):
        if any(m[p] for p in ("params", "grads", "optimizer")):
            failures.append(f"step {step} rollout: the engine's storages hold bytes {m}")
        before = trained.get(step - 1)
        if before is not None and device == "cuda":
            freed[step] = 1 - m["allocated"] / before["allocated"]
            if freed[step] < MIN_FREED:
                failures.append(
                    f"step {step} rollout: offload freed {freed[step]:.1%} of the trainer's allocated GPU memory"
                    f" ({before['allocated']} -> {m['allocated']} bytes), want >= {MIN_FREED:.0%}"
                )
    if len(rollout) != steps or len(trained) != steps:
        failures.append(f"memory records: {len(rollout)} rollout / {len(trained)} trained phases, want {steps}")
    return failures, {"rows": rows, "memory": mem, "freed": freed, "verify": verify}


def report(summary: dict, device: str, params: int) -> None:
    gib = 2**30
    print(f"\nmodel: {params / 1e9:.3f} B parameters; device {device}")
    print("\n| step | phase | allocated GiB | params MiB | grads MiB | optimizer MiB | device used GiB |")
    print("|---|---|---|---|---|---|---|")
    for m in summary["memory"]:
        used = f"{m['device_used'] / gib:.2f}" if m.get("device_used") is not None else "-"
        print(
            f"| {m['step']} | {m['phase']} | {m['allocated'] / gib:.3f} | {m['params'] / 2**20:.1f} |"
            f" {m['grads'] / 2**20:.1f} | {m['optimizer'] / 2**20:.1f} | {used} |"
        )
    if summary["freed"]:
        print("\noffload freed during rollout (of the allocated memory after training):")
        for step, f in summary["freed"].items():
            print(f"  step {step}: {f:.2%} (want >= {MIN_FREED:.0%})")
    keys = ["actor/pg_loss", "actor/grad_norm", "actor/train_rollout_logprob_abs_diff", "response/length_mean"]
    keys += sorted(k for r in summary["rows"] for k in r if k.startswith(("time/", "colocate/", "sync/")))
    keys = list(dict.fromkeys(keys))
    print("\n| metric | " + " | ".join(f"step {r['step']}" for r in summary["rows"]) + " |")
    print("|---|" + "---|" * len(summary["rows"]))
    for k in keys:
        vals = [r.get(k) for r in summary["rows"]]
        cells = ["-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v)) for v in vals]
        print(f"| {k} | " + " | ".join(cells) + " |")


def count_params(model: Path) -> int:
    from safetensors import safe_open

    n = 0
    for f in model.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for k in st.keys():  # noqa: SIM118  (safe_open has no __iter__)
                n += _numel(st.get_slice(k).get_shape())
    return n


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--shape", choices=tuple(SHAPES), default="0.5b")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="trainer and server (fp32: a tight check)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--response-length", type=int, default=32)
    p.add_argument("--verify-tolerance", type=float, default=1e-3, help="max abs logprob difference accepted")
    p.add_argument("--workdir", type=Path, help="keep the model, data and run here (default: a temporary dir)")
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--json", type=Path, help="write the metrics and memory records here")
    args = p.parse_args()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("--device cuda: no CUDA device (use --device cpu for the dry run)")
            return 2
    with tempfile.TemporaryDirectory(prefix="colocated_gpu_check_") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        model, train = prepare(workdir, args.shape, args.dtype)
        t_prep = time.perf_counter() - t0
        (workdir / "memory.jsonl").unlink(missing_ok=True)
        run_dir = workdir / "run"
        if (run_dir / "metrics.jsonl").exists():
            (run_dir / "metrics.jsonl").unlink()
        t0 = time.perf_counter()
        run_trainer(workdir, overrides(workdir, model, train, args), args.device, args.timeout_s)
        t_run = time.perf_counter() - t0
        failures, summary = check(workdir, args.device, args.steps, args.verify_tolerance)
        report(summary, args.device, count_params(model))
        print(f"\nmodel and data written in {t_prep:.1f} s; the colocated run (torchrun, servers) {t_run:.1f} s")
        if args.json:
            args.json.write_text(json.dumps({k: summary[k] for k in ("rows", "memory", "freed", "verify")}, indent=1))
    for f in failures:
        print("FAILED:", f)
    print("colocated_gpu_check:", "FAILED" if failures else "passed")
    return 1 if failures else 0


# ---- the torchrun worker ---------------------------------------------------------------------------------
def _resident(actor) -> dict[str, int]:
    """The device bytes each part of the engine holds now (0: offloaded; trainer/offload.py's storages)."""
    return {part: sum(s.nbytes() for s in ss) for part, ss in actor.engine._offload.storages().items()}


def worker(config: str, memory_path: str, over: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from megatron_dapo.apps.launch import torchrun_colocated_servers
    from megatron_dapo.config import load_config
    from megatron_dapo.trainer.colocation import ColocationCycle
    from megatron_dapo.trainer.loop import Trainer, train_rank

    cfg = load_config(config, over)
    state = {}

    def record(step: int, phase: str, actor) -> None:
        if dist.get_rank() != 0:
            return
        line = {"step": step, "phase": phase, **_resident(actor), "allocated": 0, "device_used": None}
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            line.update(allocated=torch.cuda.memory_allocated(), device_used=total - free)
        else:
            line["allocated"] = sum(_resident(actor).values())  # CPU: the engine's own bytes
        with open(memory_path, "a") as f:
            f.write(json.dumps(line) + "\n")

    take_batch = Trainer.take_batch

    def take_recording(self, step):  # the servers generate step's batch; the trainer is offloaded
        state.update(trainer=self, step=step)
        record(step, "rollout", self.actor)
        return take_batch(self, step)

    offload_train_state = ColocationCycle.offload_train_state

    def offload_recording(self):  # after training: parameters, gradients and Adam's state all on the device
        if "trainer" in state:  # (the start's first push offloads too, before any step)
            record(state["step"], "trained", state["trainer"].actor)
        return offload_train_state(self)

    Trainer.take_batch = take_recording
    ColocationCycle.offload_train_state = offload_recording
    with torchrun_colocated_servers(cfg) as urls:
        train_rank(cfg, urls, resume=False)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.path.insert(0, str(ROOT))
        worker(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        sys.path.insert(0, str(ROOT))
        sys.exit(main())
