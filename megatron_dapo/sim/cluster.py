"""The simulated cluster's numbers derived from a config, as `plan` estimates them: the engines' KV
pool (megatron_dapo.planner.memory.rollout_memory) and, when not given, the trainer's step time
(megatron_dapo.planner.speed)."""

from __future__ import annotations

from megatron_dapo.config.shapes import ModelShape, resolve_model_shape
from megatron_dapo.planner.memory import GiB, rollout_memory


def model_shape(cfg) -> ModelShape:
    resolved = resolve_model_shape(cfg.model)
    if resolved.shape is None:
        raise ValueError(
            f"model.hf_path={cfg.model.hf_path!r}: no config.json, no model.hf_config and no "
            f"built-in shape; the simulator needs the model's shape"
        )
    return resolved.shape


def kv_tokens_per_engine(cfg, gpu_mem_gib: float) -> int:
    mem = rollout_memory(cfg, model_shape(cfg), int(gpu_mem_gib * GiB))
    if mem.kv_tokens <= 0:
        raise ValueError(
            f"rollout: the weights of one engine (tp {mem.server_tp}) leave no KV pool in "
            f"{gpu_mem_gib} GiB at mem_fraction_static {cfg.rollout.mem_fraction_static}"
        )
    return mem.kv_tokens
