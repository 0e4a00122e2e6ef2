"""DAPO algorithm core: pure torch reference functions (the Triton kernels in
megatron_dapo.kernels implement the same signatures; megatron_dapo.kernels.backend chooses)."""

from .advantages import group_advantages, reinforce_plus_plus_advantages, rloo_advantages, token_advantages
from .filter import FilterResult, dynamic_sampling_filter
from .logprobs import vocab_parallel_logprobs
from .loss import LOSS_AGG_MODES, POLICY_LOSSES, cispo_policy_loss, dapo_policy_loss, gspo_policy_loss
from .overlong import overlong_filter_mask, overlong_reward
from .rollout_correction import CORRECTION_MODES, Correction, mismatch_sums, rollout_correction

__all__ = [
    "CORRECTION_MODES",
    "Correction",
    "FilterResult",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "cispo_policy_loss",
    "dapo_policy_loss",
    "gspo_policy_loss",
    "mismatch_sums",
    "reinforce_plus_plus_advantages",
    "rloo_advantages",
    "rollout_correction",
    "dynamic_sampling_filter",
    "group_advantages",
    "overlong_filter_mask",
    "overlong_reward",
    "token_advantages",
    "vocab_parallel_logprobs",
]
