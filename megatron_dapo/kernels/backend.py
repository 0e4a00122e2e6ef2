"""Backend choice for the DAPO hot paths: Triton kernels on CUDA, the torch reference elsewhere.

Every function here has the signature of its torch reference in megatron_dapo.algo plus a
keyword `backend`: "auto" (default), "torch" or "triton". The environment variable
MEGATRON_DAPO_KERNELS overrides "auto" for the whole process (e.g. =torch to rule the kernels
out while debugging). "auto" picks Triton for CUDA tensors; CPU tensors take the torch path,
except under TRITON_INTERPRET=1 with an explicit "triton" (how the kernels are tested on CPU).
"""

from __future__ import annotations

import importlib
import logging
import os

import torch

from megatron_dapo.algo import advantages as _adv
from megatron_dapo.algo import filter as _filter
from megatron_dapo.algo import logprobs as _logprobs
from megatron_dapo.algo import loss as _loss

log = logging.getLogger(__name__)

ENV_VAR = "MEGATRON_DAPO_KERNELS"
BACKENDS = ("auto", "torch", "triton")


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def resolve_backend(device: torch.device, backend: str | None = None) -> str:
    """'torch' or 'triton' for tensors on `device` (see the module doc for the rules)."""
    choice = backend or "auto"
    if choice == "auto":
        choice = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
        if choice not in BACKENDS:
            raise ValueError(f"{ENV_VAR}={choice!r}: expected one of {BACKENDS}")
    if choice not in BACKENDS:
        raise ValueError(f"backend={choice!r}: expected one of {BACKENDS}")
    if choice == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "torch"
    if choice == "triton" and device.type != "cuda" and not triton_interpreting():
        raise RuntimeError(
            f"backend='triton' needs CUDA tensors (got {device}); on CPU set TRITON_INTERPRET=1 before "
            "importing triton (slow, for tests) or use backend='torch'"
        )
    if choice == "triton" and not _triton_available():
        raise RuntimeError("backend='triton' needs the `triton` package (pip install triton)")
    return choice


def _triton_available() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def resolve_fp32_backend(tensor: torch.Tensor, backend: str | None = None) -> str:
    """resolve_backend for a kernel that computes in fp32: "auto" keeps float64 tensors (gradchecks,
    references) on the torch path."""
    if tensor.dtype == torch.float64 and (backend or os.environ.get(ENV_VAR, "auto")) == "auto":
        backend = "torch"
    return resolve_backend(tensor.device, backend)


def triton_module(module: str):
    """A Triton module of this package, imported on first use (it imports triton)."""
    return importlib.import_module(f"megatron_dapo.kernels.{module}")


def vocab_parallel_logprobs(
    logits_shard, target_ids, tp_group=None, temperature=1.0, with_entropy=False, *, backend: str | None = None
):
    if resolve_fp32_backend(logits_shard, backend) == "triton":
        return triton_module("logprobs_triton").vocab_parallel_logprobs(
            logits_shard, target_ids, tp_group, temperature, with_entropy
        )
    return _logprobs.vocab_parallel_logprobs(logits_shard, target_ids, tp_group, temperature, with_entropy)


POLICY_LOSS_NAMES = tuple(_loss.POLICY_LOSSES)
# Policy losses the Triton loss kernel does not cover, and why: they run the torch path on every device.
TORCH_ONLY_LOSSES = {
    "gspo": "GSPO's sequence ratio needs each row's mean log-ratio before any token's clip (two passes); "
    "the fused kernel streams a row once",
    "cispo": "CISPO's loss is a REINFORCE term on the logprobs, not the clipped-ratio term the fused kernel computes",
}
_told: set[str] = set()


def policy_loss_backend(name: str, device: torch.device, backend: str | None = None) -> tuple[str, str | None]:
    """(backend, why) for the policy loss `name` on `device`: a loss in TORCH_ONLY_LOSSES that would have
    taken the Triton path runs the torch path, and `why` says so by name (else None)."""
    if name not in _loss.POLICY_LOSSES:
        raise ValueError(f"policy loss {name!r}: expected one of {POLICY_LOSS_NAMES}")
    chosen = resolve_backend(device, backend)
    if chosen == "triton" and name in TORCH_ONLY_LOSSES:
        return (
            "torch",
            f"policy loss {name!r} runs the torch path: the Triton loss kernel covers dapo only "
            f"({TORCH_ONLY_LOSSES[name]})",
        )
    return chosen, None


def kernel_policy_loss(
    name, logprobs, old_logprobs, advantages, loss_mask, *args, backend: str | None = None, **kwargs
):
    """The policy loss `name` (dapo, gspo, cispo) on the backend `policy_loss_backend` picks; a variant the
    kernel does not cover is logged once (by name) where it falls back to torch."""
    chosen, why = policy_loss_backend(name, logprobs.device, backend)
    if why is not None and name not in _told:
        _told.add(name)
        log.warning(why)
    if chosen == "triton":
        loss_triton = triton_module("loss_triton")
        return loss_triton.dapo_policy_loss(logprobs, old_logprobs, advantages, loss_mask, *args, **kwargs)
    return _loss.POLICY_LOSSES[name](logprobs, old_logprobs, advantages, loss_mask, *args, **kwargs)


def dapo_policy_loss(logprobs, old_logprobs, advantages, loss_mask, *args, backend: str | None = None, **kwargs):
    return kernel_policy_loss("dapo", logprobs, old_logprobs, advantages, loss_mask, *args, backend=backend, **kwargs)


def gspo_policy_loss(logprobs, old_logprobs, advantages, loss_mask, *args, backend: str | None = None, **kwargs):
    return kernel_policy_loss("gspo", logprobs, old_logprobs, advantages, loss_mask, *args, backend=backend, **kwargs)


def cispo_policy_loss(logprobs, old_logprobs, advantages, loss_mask, *args, backend: str | None = None, **kwargs):
    return kernel_policy_loss("cispo", logprobs, old_logprobs, advantages, loss_mask, *args, backend=backend, **kwargs)


def group_advantages(rewards, group_ids, norm_by_std=True, eps=1e-6, *, backend: str | None = None):
    if resolve_backend(rewards.device, backend) == "triton":
        return triton_module("group_triton").group_advantages(rewards, group_ids, norm_by_std, eps)
    return _adv.group_advantages(rewards, group_ids, norm_by_std, eps)


def dynamic_sampling_filter(metric, group_ids, correct_threshold=0.5, *, backend: str | None = None):
    if resolve_backend(metric.device, backend) == "triton":
        return triton_module("group_triton").dynamic_sampling_filter(metric, group_ids, correct_threshold)
    return _filter.dynamic_sampling_filter(metric, group_ids, correct_threshold)


def token_advantages(advantages, loss_mask, *, backend: str | None = None):
    if resolve_backend(advantages.device, backend) == "triton":
        return triton_module("group_triton").token_advantages(advantages, loss_mask)
    return _adv.token_advantages(advantages, loss_mask)
