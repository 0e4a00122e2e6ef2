"""The simulated cluster's numbers derived from a config: engine KV pool and trainer step time.

KV pool: `plan`'s rollout memory estimate (megatron_dapo.config.memory.rollout_memory) for the
engines' GPUs. Trainer step time, when not given: FLOPs over the trainer GPUs at a model FLOPs
utilisation; per trained token, an old-logprob forward, a forward + backward, and one more forward
with full recompute, each 2 * active params plus causal attention over the mean sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dapo.config import derived
from megatron_dapo.config.memory import GiB, active_params, rollout_memory
from megatron_dapo.config.shapes import ModelShape, resolve_model_shape


@dataclass(frozen=True)
class TrainerSpeed:
    gpus: int
    flops_per_token: float
    peak_tflops: float
    mfu: float

    def step_s(self, tokens: int) -> float:
        return tokens * self.flops_per_token / (self.gpus * self.peak_tflops * 1e12 * self.mfu)


def model_shape(cfg) -> ModelShape:
    resolved = resolve_model_shape(cfg.model)
    if resolved.shape is None:
        raise ValueError(f"model.hf_path={cfg.model.hf_path!r}: no config.json, no model.hf_config and no "
                         f"built-in shape; the simulator needs the model's shape")
    return resolved.shape


def kv_tokens_per_engine(cfg, gpu_mem_gib: float) -> int:
    mem = rollout_memory(cfg, model_shape(cfg), int(gpu_mem_gib * GiB))
    if mem.kv_tokens <= 0:
        raise ValueError(f"rollout: the weights of one engine (tp {mem.server_tp}) leave no KV pool in "
                         f"{gpu_mem_gib} GiB at mem_fraction_static {cfg.rollout.mem_fraction_static}")
    return mem.kv_tokens


def trainer_speed(cfg, mean_seq_tokens: float, peak_tflops: float, mfu: float) -> TrainerSpeed:
    shape = model_shape(cfg)
    gpus = derived.trainer_world_size(cfg)
    if gpus < 1:
        raise ValueError(f"trainer: no GPUs left for training ({cfg.trainer.nnodes} x {cfg.trainer.gpus_per_node} "
                         f"minus {derived.launched_rollout_gpus(cfg)} for the engines)")
    attn = 2 * 2 * shape.num_layers * shape.num_attention_heads * shape.head_dim * mean_seq_tokens / 2
    forward = 2 * active_params(shape) + attn
    passes = 1 + 3 + (1 if cfg.model.recompute_granularity == "full" else 0)
    return TrainerSpeed(gpus, passes * forward, peak_tflops, mfu)
