"""DAPO algorithm core: pure torch reference functions (the Triton kernels in
megatron_dapo.kernels implement the same signatures; megatron_dapo.kernels.backend chooses)."""

from .advantages import group_advantages, token_advantages
from .filter import FilterResult, dynamic_sampling_filter
from .logprobs import vocab_parallel_logprobs
from .loss import LOSS_AGG_MODES, dapo_policy_loss
from .overlong import overlong_filter_mask, overlong_reward

__all__ = [
    "FilterResult",
    "LOSS_AGG_MODES",
    "dapo_policy_loss",
    "dynamic_sampling_filter",
    "group_advantages",
    "overlong_filter_mask",
    "overlong_reward",
    "token_advantages",
    "vocab_parallel_logprobs",
]
