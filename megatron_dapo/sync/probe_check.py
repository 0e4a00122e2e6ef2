"""The check after a sync: the live servers' logprobs of a fixed probe sequence against the trainer's.

Every transport verifies this way (`rollout.sync.verify`); a server lost while asked is reported, not
compared, so the caller can leave it out and go on with the others, whose weights were checked.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_dapo.sync.errors import ServersLost, WeightSyncError
from megatron_dapo.sync.server_calls import ServerCalls


def probe_max_diff(
    calls: ServerCalls, probe_ids: Sequence[int], trainer_logprobs, tolerance: float
) -> tuple[float, ServersLost | None]:
    """Max |server - trainer| logprob over the probe, worst live server, and the servers lost meanwhile (or
    None). Raises a WeightSyncError past `tolerance`, or when a server answers another number of logprobs."""
    ref = torch.as_tensor(trainer_logprobs, dtype=torch.float64).reshape(-1)
    worst = 0.0
    asked = list(calls.members.live)
    answers = calls.ask_all("prompt_logprobs", list(probe_ids), return_exceptions=True)
    lost = None
    try:
        calls.raise_failed("prompt_logprobs of the verify probe", answers)
    except ServersLost as e:
        lost = e
    for url, lps in zip(asked, answers):
        if lost is not None and url in lost.reasons:
            continue
        got = torch.tensor(lps, dtype=torch.float64)
        if got.shape != ref.shape:
            raise WeightSyncError(f"{url}: {got.numel()} probe logprobs, trainer has {ref.numel()}")
        worst = max(worst, float((got - ref).abs().max()))
    if worst > tolerance:
        raise WeightSyncError(f"after sync, server logprobs differ from the trainer's by {worst:.3g} > {tolerance:g}")
    return worst, lost
