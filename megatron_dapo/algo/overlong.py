"""DAPO overlong handling: soft punishment of responses that run into the length limit, and the
option to mask truncated responses out of the loss.

Soft overlong punishment (DAPO eq. 13), with L_max = max_response_len, L_cache =
overlong_buffer_len and |y| the response length:

    R(y) = 0                                              |y| <= L_max - L_cache
    R(y) = (L_max - L_cache - |y|) / L_cache * penalty    L_max - L_cache < |y| <= L_max
    R(y) = -penalty                                       |y| > L_max

so the penalty ramps linearly from 0 to -penalty_factor over the last L_cache tokens. It is added
to the task reward before group normalisation.
"""

from __future__ import annotations

import torch


def overlong_reward(
    lengths: torch.Tensor, max_response_len: int, overlong_buffer_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """Length penalty per response [N] (<= 0, fp32)."""
    if not 0 < overlong_buffer_len <= max_response_len:
        raise ValueError(
            f"overlong_reward: need 0 < overlong_buffer_len ({overlong_buffer_len}) <= "
            f"max_response_len ({max_response_len})"
        )
    if penalty_factor < 0:
        raise ValueError(f"overlong_reward: penalty_factor must be >= 0, got {penalty_factor}")
    start = max_response_len - overlong_buffer_len
    excess = lengths.to(torch.float32) - start
    penalty = -excess.clamp(min=0) / overlong_buffer_len * penalty_factor
    return penalty.clamp(min=-penalty_factor)


def overlong_filter_mask(loss_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Loss mask with truncated responses (finish reason "length") zeroed out.

    Apply it after the advantages are computed: a truncated sample still counts in its group's
    mean / std (the baseline), it only stops contributing loss tokens.
    """
    if truncated.dim() != 1 or truncated.shape[0] != loss_mask.shape[0]:
        raise ValueError(
            f"overlong_filter_mask: truncated shape {tuple(truncated.shape)} must be "
            f"[{loss_mask.shape[0]}] (one flag per row of loss_mask)"
        )
    keep = ~truncated.bool()
    return loss_mask * keep.view(-1, *([1] * (loss_mask.dim() - 1))).to(loss_mask.dtype)
