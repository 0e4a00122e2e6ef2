"""This rank's actor: the DAPO step (trainer/dapo_step.py) over the training engine `trainer.backend` names,
Megatron (trainer/megatron_engine.py) or FSDP2 (trainer/fsdp_engine.py), HF weights loaded."""

from __future__ import annotations

from megatron_dapo.trainer.dapo_step import DapoStep
from megatron_dapo.trainer.engine import TrainEngine


def build_engine(cfg, hf_dir: str | None = None) -> TrainEngine:
    """Imported here: each engine pulls in its framework (megatron-core, or FSDP2 and transformers)."""
    if cfg.trainer.backend == "fsdp2":
        from megatron_dapo.trainer.fsdp_engine import FSDPEngine

        return FSDPEngine(cfg, hf_dir)
    from megatron_dapo.trainer.megatron_engine import MegatronEngine

    return MegatronEngine(cfg, hf_dir)


def build_actor(cfg, hf_dir: str | None = None) -> DapoStep:
    return DapoStep(build_engine(cfg, hf_dir), cfg)
