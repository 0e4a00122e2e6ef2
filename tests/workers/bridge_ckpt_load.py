"""Load a converted dist_checkpointing checkpoint at other layouts; compare logits with the HF model.

usage: bridge_ckpt_load.py HF_DIR CKPT_DIR LAYOUT [LAYOUT ...]   (LAYOUT: tp1 tp2 pp2 ep2 ...)
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from bridge_common import hf_logits, megatron_logits, rel_err  # noqa: E402
from bridge_layouts import LAYOUTS, TOL  # noqa: E402


def main() -> int:
    from megatron_dapo.bridge.checkpoint import load_megatron_checkpoint
    from megatron_dapo.models import ModelParallel, QwenArch, build_gpt_model
    from megatron_dapo.runtime.distributed import destroy_distributed, init_distributed, init_model_parallel

    hf_dir, ckpt, layouts = sys.argv[1], sys.argv[2], sys.argv[3:]
    info = init_distributed()
    arch = QwenArch.from_hf(hf_dir)
    torch.manual_seed(0)
    ids = torch.randint(0, arch.vocab_size, (2, 8))
    ref = hf_logits(hf_dir, ids)
    failures = []
    for layout in layouts:
        sizes = LAYOUTS[layout]
        init_model_parallel(**sizes)
        par = ModelParallel(**sizes, sequence_parallel=arch.is_moe and sizes.get("tp", 1) > 1)
        chunks = build_gpt_model(hf_dir, par)
        load_megatron_checkpoint(chunks, ckpt)
        got = megatron_logits(chunks, ids, arch.vocab_size)
        if got is not None:
            err = rel_err(got, ref)
            if info.rank == dist.get_world_size() - 1:
                print(f"RESULT ckpt {layout} rel={err:.3e}", flush=True)
            if not err < TOL:
                failures.append(f"{layout}: logits rel err {err:.3e}")
    for f in failures:
        print(f"FAIL rank {info.rank}: {f}", flush=True)
    destroy_distributed()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
