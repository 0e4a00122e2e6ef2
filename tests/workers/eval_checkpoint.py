"""Write a training checkpoint as a TP=2 run does (the Megatron engine: model + optimizer + scheduler in torch_dist,
RNG states, trainer.json, the `latest` pointer), from an HF model's weights.

Usage (torchrun, 2 ranks): eval_checkpoint.py HF_DIR SAVE_DIR STEP
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from megatron_dapo.config.schema import DapoConfig
from megatron_dapo.runtime.distributed import destroy_distributed, init_distributed, init_model_parallel
from megatron_dapo.trainer import checkpoint as ckpt
from megatron_dapo.trainer.actor import build_actor
from megatron_dapo.trainer.megatron_engine import materialize_optimizer_state


def main(hf_dir: str, save_dir: str, step: int) -> None:
    init_distributed()
    init_model_parallel(tp=2)
    cfg = DapoConfig()
    cfg.model.hf_path, cfg.model.dtype, cfg.model.transformer_impl = hf_dir, "fp32", "local"
    cfg.parallel.tp = 2
    actor = build_actor(cfg)
    materialize_optimizer_state(actor.engine.optimizer)  # a fresh optimizer has no state to save before its first step
    final = ckpt.save_collective(
        save_dir,
        step,
        lambda tmp: actor.save_checkpoint(str(tmp / "model")),
        lambda tmp: ckpt.write_trainer_state(
            tmp, {"step": step, "version": step + 1, "world_size": dist.get_world_size()}
        ),
    )
    if final is not None:
        print("saved", final, flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
