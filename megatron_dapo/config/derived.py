"""Values derived from a config, defined once so every component agrees on them.

Trainer world size: `trainer.world_size` when set; otherwise all GPUs of the job
(`trainer.nnodes * trainer.gpus_per_node`) minus the GPUs of the SGLang servers the driver launches
(`rollout.num_servers * rollout.server_tp`, only when `rollout.engine` is sglang and no external
`rollout.servers` are listed). External servers and embedded (CPU / small-model) servers take no
trainer GPUs. On CPU, `trainer.gpus_per_node` counts trainer processes. With `trainer.placement:
colocated` the launched servers share the trainer's GPUs (one per `rollout.server_tp` of them), so
they take none of their own either.
"""

from __future__ import annotations

import math
import os

from megatron_dapo.config.errors import ConfigError
from megatron_dapo.config.schema import DapoConfig
from megatron_dapo.types import RoutingShape


def colocated(cfg: DapoConfig) -> bool:
    """Trainer and rollout servers on the same GPUs, taking turns (docs/placement.md)."""
    return cfg.trainer.placement == "colocated"


def colocated_servers(cfg: DapoConfig) -> int:
    """The rollout servers of a colocated run: one per rollout.server_tp trainer GPUs."""
    return trainer_world_size(cfg) // max(1, cfg.rollout.server_tp)


def launched_rollout_gpus(cfg: DapoConfig) -> int:
    """GPUs taken (for themselves alone) by SGLang servers that the driver starts itself."""
    rollout = cfg.rollout
    if rollout.engine == "sglang" and not rollout.servers and not colocated(cfg):
        return rollout.num_servers * rollout.server_tp
    return 0


def trainer_world_size(cfg: DapoConfig) -> int:
    if cfg.trainer.world_size is not None:
        return cfg.trainer.world_size
    return cfg.trainer.nnodes * cfg.trainer.gpus_per_node - launched_rollout_gpus(cfg)


def model_parallel_size(cfg: DapoConfig) -> int:
    """Ranks holding one replica of the model: tp * pp * cp."""
    parallel = cfg.parallel
    return parallel.tp * parallel.pp * parallel.cp


def data_parallel_size(cfg: DapoConfig) -> int:
    """parallel.dp if set, else trainer world size / (tp * pp * cp) (validation ensures it divides)."""
    if cfg.parallel.dp is not None:
        return cfg.parallel.dp
    return trainer_world_size(cfg) // model_parallel_size(cfg)


def expert_tp_size(cfg: DapoConfig) -> int:
    return cfg.parallel.etp if cfg.parallel.etp is not None else cfg.parallel.tp


def expert_data_parallel_size(cfg: DapoConfig) -> int:
    """Replicas of each expert: the (tp * cp * dp) ranks of a pipeline stage divided by ep * etp."""
    parallel = cfg.parallel
    return parallel.tp * parallel.cp * data_parallel_size(cfg) // (parallel.ep * expert_tp_size(cfg))


def max_new_tokens(cfg: DapoConfig) -> int:
    new_tokens = cfg.rollout.sampling.max_new_tokens
    return new_tokens if new_tokens is not None else cfg.data.max_response_length


def val_max_new_tokens(cfg: DapoConfig) -> int:
    val_tokens = cfg.trainer.val.max_new_tokens
    return val_tokens if val_tokens is not None else cfg.data.max_response_length


def gen_batch_size(cfg: DapoConfig) -> int:
    """Prompts submitted per generation batch of dynamic sampling."""
    gen_batch = cfg.algo.gen_batch_size
    return gen_batch if gen_batch is not None else cfg.algo.train_batch_size


def max_tokens_per_micro_batch(cfg: DapoConfig) -> int:
    tokens = cfg.algo.max_tokens_per_micro_batch
    return tokens if tokens is not None else cfg.data.max_prompt_length + cfg.data.max_response_length


def token_sum_norm(cfg: DapoConfig) -> float:
    """The constant divisor of a sequence's token sum in seq-mean-token-sum-norm (never the padded width)."""
    factor = cfg.algo.loss_scale_factor
    return float(factor if factor is not None else cfg.data.max_response_length)


def optimizer_steps_per_train_step(cfg: DapoConfig) -> int:
    """Optimizer steps per training step: one per mini-batch, per PPO epoch."""
    algo = cfg.algo
    return max(1, math.ceil(algo.train_batch_size / algo.ppo_mini_batch_size)) * algo.ppo_epochs


def lr_decay_steps(cfg: DapoConfig) -> int:
    """Optimizer steps of the lr decay: optimizer.lr_decay_steps, unset (or 0) = the whole run."""
    return cfg.optimizer.lr_decay_steps or cfg.trainer.total_steps * optimizer_steps_per_train_step(cfg)


def checkpoint_dir(cfg: DapoConfig) -> str:
    save_dir = cfg.checkpoint.save_dir
    return save_dir if save_dir is not None else os.path.join(cfg.logging.run_dir, "checkpoints")


def sync_sources(cfg: DapoConfig) -> str:
    """rollout.sync.sources resolved: "rank0" or "per_stage" (auto: per_stage where it applies and helps)."""
    sync = cfg.rollout.sync
    if sync.sources != "auto":
        return sync.sources
    applies = sync.policy == "all_at_once" and cfg.trainer.backend == "megatron" and sync.transport != "ipc"
    return "per_stage" if applies and (cfg.parallel.pp > 1 or cfg.parallel.ep > 1) else "rank0"


def fused_lm_head(cfg: DapoConfig) -> bool:
    """algo.fused_lm_head resolved: null means on for the Megatron actor, off for FSDP2 (unsupported there)."""
    if cfg.algo.fused_lm_head is not None:
        return cfg.algo.fused_lm_head
    return cfg.trainer.backend == "megatron"


def routing_shape(cfg: DapoConfig) -> RoutingShape | None:
    """What the samples carry for rollout routing replay (algo.routing_replay): None when it is off,
    explicitly or by default (a dense model, or a model whose shape is not known yet)."""
    from megatron_dapo.config.shapes import resolve_model_shape

    if cfg.algo.routing_replay == "none":
        return None
    shape = resolve_model_shape(cfg.model).shape
    if shape is None and cfg.algo.routing_replay == "rollout":
        raise ConfigError(
            f"algo.routing_replay=rollout: the model's shape is unknown (model.hf_path={cfg.model.hf_path!r} "
            "has no config.json and no model.hf_config is given)"
        )
    if shape is None or not shape.is_moe:
        return None
    return RoutingShape(shape.num_layers, shape.moe_layers, shape.moe_topk, shape.num_experts)


# rollout.sync.timeout_s unset: a quarter of rollout.request_timeout_s, at most SYNC_TIMEOUT_CAP_S. Under
# all_at_once every healthy server stays paused while a stalled one is awaited (up to one sync timeout for
# its pause, another if it stalls mid-update), and a paused request's time counts against its own request
# timeout: a quarter leaves it three quarters of it to generate in. The cap bounds what one stalled server
# costs the whole run (all servers paused) when the request timeout is long; a healthy server's slowest
# sync call (a new update group, one bucket of rollout.sync.bucket_mb) takes seconds, not minutes.
SYNC_TIMEOUT_SHARE = 0.25
SYNC_TIMEOUT_CAP_S = 300.0


def sync_timeout_s(cfg: DapoConfig) -> float:
    """Bound on each call of a weight sync: rollout.sync.timeout_s, else a quarter of
    rollout.request_timeout_s, at most SYNC_TIMEOUT_CAP_S (see above)."""
    if cfg.rollout.sync.timeout_s is not None:
        return cfg.rollout.sync.timeout_s
    return min(SYNC_TIMEOUT_SHARE * cfg.rollout.request_timeout_s, SYNC_TIMEOUT_CAP_S)


RAY_MAX_RESTARTS = 2


def ray_max_restarts(cfg: DapoConfig) -> int:
    """Times a Ray run's driver starts the trainer ranks again (trainer.max_restarts, None = 2)."""
    return RAY_MAX_RESTARTS if cfg.trainer.max_restarts is None else cfg.trainer.max_restarts
