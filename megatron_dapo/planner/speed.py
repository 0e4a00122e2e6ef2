"""The trainer's step time from FLOPs: `megatron-dapo plan` prints it, `megatron-dapo simulate` trains
at it (unless given `--step-time`); and a weight sync's time from the model's bytes and the link.

Per trained token, an old-logprob forward, a forward + backward (3 forwards' worth), and one more
forward with full recompute; each forward 2 * active params (top-k experts only) plus causal attention
over the mean sequence. Over the trainer GPUs at a model FLOPs utilisation (MFU) of their peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dapo.config import derived
from megatron_dapo.config.shapes import ModelShape
from megatron_dapo.planner.memory import active_params, weight_bytes

H100_BF16_TFLOPS = 989.0  # dense bf16 peak of an H100 / H200 SXM
DEFAULT_MFU = 0.35
# dense bf16 peak TFLOP/s of the trainer GPUs one may name (`simulate --trainer-gpu`): NVIDIA's data
# sheets; the H200 has the H100's compute (more and faster memory), the H20 is the export part
GPU_BF16_TFLOPS = {"h100": H100_BF16_TFLOPS, "h200": H100_BF16_TFLOPS, "h20": 148.0}


def peak_tflops(trainer_gpu: str | None, gpu_tflops: float | None) -> float:
    """The trainer GPU's peak from `--trainer-gpu` or `--gpu-tflops` (default: an H100's)."""
    if gpu_tflops is not None and trainer_gpu is not None:
        raise ValueError("--gpu-tflops and --trainer-gpu: give one of them")
    if trainer_gpu is not None and trainer_gpu not in GPU_BF16_TFLOPS:
        raise ValueError(f"--trainer-gpu={trainer_gpu!r}: one of {', '.join(sorted(GPU_BF16_TFLOPS))}")
    return gpu_tflops if gpu_tflops is not None else GPU_BF16_TFLOPS[trainer_gpu or "h100"]


DEFAULT_LINK_GB_S = 25.0  # GB/s a weight sync moves the weights at (trainer to engines)


def weight_sync_s(cfg, shape: ModelShape, link_gb_s: float = DEFAULT_LINK_GB_S) -> float:
    """Seconds of one weight sync: the model's bytes over the link (every engine receives them at once,
    as a broadcast does)."""
    if not link_gb_s > 0:
        raise ValueError(f"--link-gb-s={link_gb_s} must be > 0")
    return weight_bytes(cfg, shape) / (link_gb_s * 1e9)


@dataclass(frozen=True)
class TrainerSpeed:
    gpus: int
    flops_per_token: float
    peak_tflops: float
    mfu: float

    def step_s(self, tokens: int) -> float:
        """Seconds to train on `tokens` (prompt + response) tokens."""
        return tokens * self.flops_per_token / (self.gpus * self.peak_tflops * 1e12 * self.mfu)


def trainer_speed(
    cfg, shape: ModelShape, mean_seq_tokens: float, peak_tflops: float = H100_BF16_TFLOPS, mfu: float = DEFAULT_MFU
) -> TrainerSpeed:
    """`cfg`'s trainer on sequences of `mean_seq_tokens`; ValueError naming the option that makes no
    sense (`--mfu`, `--gpu-tflops`, the mean lengths) or when the trainer has no GPU left."""
    if not 0 < mfu <= 1:  # also refuses NaN
        raise ValueError(f"--mfu={mfu} must be in (0, 1] (a share of the peak)")
    if not peak_tflops > 0:
        raise ValueError(f"--gpu-tflops={peak_tflops} must be > 0")
    if not mean_seq_tokens > 0:
        raise ValueError(f"mean sequence of {mean_seq_tokens} tokens (--prompt-len + response length) must be > 0")
    gpus = derived.trainer_world_size(cfg)
    if gpus < 1:
        raise ValueError(
            f"trainer: no GPUs left for training ({cfg.trainer.nnodes} x {cfg.trainer.gpus_per_node} "
            f"minus {derived.launched_rollout_gpus(cfg)} for the engines)"
        )
    attn = 2 * 2 * shape.num_layers * shape.num_attention_heads * shape.head_dim * mean_seq_tokens / 2
    forward = 2 * active_params(shape) + attn
    passes = 1 + 3 + (1 if cfg.model.recompute_granularity == "full" else 0)
    return TrainerSpeed(gpus, passes * forward, peak_tflops, mfu)
