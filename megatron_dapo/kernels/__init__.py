"""Fused Triton kernels for the DAPO hot paths and the choice of backend.

Call the functions of `megatron_dapo.kernels.backend` (re-exported here): they run the Triton
kernels on CUDA and the torch reference (megatron_dapo.algo) elsewhere. Triton itself is only
imported when a Triton backend is used.
"""

from .backend import (
    cispo_policy_loss,
    dapo_policy_loss,
    dynamic_sampling_filter,
    group_advantages,
    gspo_policy_loss,
    policy_loss_backend,
    resolve_backend,
    token_advantages,
    vocab_parallel_logprobs,
)
from .fused_linear import fused_linear_logprobs

__all__ = [
    "cispo_policy_loss",
    "dapo_policy_loss",
    "gspo_policy_loss",
    "policy_loss_backend",
    "dynamic_sampling_filter",
    "fused_linear_logprobs",
    "group_advantages",
    "resolve_backend",
    "token_advantages",
    "vocab_parallel_logprobs",
]
