#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.sh needs on a lent GPU machine that has no package registry (its image holds
# torch, triton, transformers, safetensors, tokenizers, aiohttp, pyyaml, tensorboard, psutil, pyarrow, uvloop, ...:
# /work/.library/device/KINDS.md) but not megatron-core nor the embedded server's web stack. Downloads them for
# CPython 3.12 / manylinux x86-64 into .whl/ (git-ignored), the versions this repository's venv tests with.
#
#   bash benchmarks/gpu_wheels.sh        # here, once (needs pip and the registry)
#   # on the machine, the command starts with (carry .whl):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#       && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64)
# megatron-core: the Megatron trainer (steps 2, 3, 5); the rest: the embedded server (fastapi over uvicorn) and
# what fastapi imports that the image lacks (opentelemetry-api), google-re2 (the server's stop_regex).
WHEELS=(
    megatron-core==0.16.1
    fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
    typing-inspection==0.4.5 annotated-doc==0.0.7 opentelemetry-api==1.45.2
    uvicorn==0.55.0 httptools==0.9.0 google-re2==1.1.20251105 typing-extensions==4.16.0
)
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    -d .whl "${WHEELS[@]}"
du -sh .whl
ls .whl
