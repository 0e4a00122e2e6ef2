"""Proactive filtering (`retry`, PSRL's proactive_filter_strategy): unstick the buffer the trainer waits on.

With reservations a buffer is full only when its slowest groups complete; under heavy-tailed
response lengths the trainer then waits for a few stragglers while later buffers already hold
completed groups. When the trainer waits on buffer t, t lacks `gap` groups with 0 < gap <=
`threshold`, and later buffers hold at least `gap` completed groups that could be trained at t,
the policy gives up t's in-flight groups, moves `gap` completed groups down from the newest later
buffers (their staleness only drops) and lets the producer dispatch as many fresh prompts as it
gave up (their slots are free again). PSRL: `AgentLoopManager.handle_waiting_buffer`.

The given-up groups' prompts count as drawn (as dynamic sampling's drops do); their tokens are
wasted. A plain class over the controller, no I/O: the caller aborts the returned groups' requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from megatron_dapo.coordinator.staleness import OCCUPIED, StalenessController, StalenessError


@dataclass
class RetryOutcome:
    buffer: int
    gap: int
    aborted: list[Hashable] = field(default_factory=list)  # in-flight groups given up
    moved: list[Hashable] = field(default_factory=list)  # completed groups moved down into `buffer`
    at: float = 0.0  # clock() of the decision


class ProactiveRetry:
    def __init__(self, threshold: int = 4, clock: Callable[[], float] = time.monotonic):
        if threshold < 1:
            raise ValueError(f"rollout.retry.threshold must be >= 1, got {threshold}")
        self.threshold, self.clock = threshold, clock
        self.history: list[RetryOutcome] = []

    def gap(self, c: StalenessController) -> int:
        """Groups the trainer's next buffer still lacks."""
        return c.slots - c.count(OCCUPIED, c.next_buffer)

    def should_retry(self, c: StalenessController, trainer_waiting: bool) -> bool:
        gap = self.gap(c)
        return trainer_waiting and 0 < gap <= self.threshold and c.movable(c.next_buffer) >= gap

    def apply(self, c: StalenessController, trainer_waiting: bool) -> RetryOutcome | None:
        """Retry if the rule says so: the next buffer becomes ready; None = nothing done."""
        if not self.should_retry(c, trainer_waiting):
            return None
        t, gap = c.next_buffer, self.gap(c)
        aborted = c.abort_reserved(t)
        moved = c.move_down(t, gap)
        if not c.ready():  # movable() >= gap guarantees it
            raise StalenessError(f"proactive retry moved {len(moved)} of {gap} groups into buffer {t}")
        out = RetryOutcome(t, gap, aborted, moved, self.clock())
        self.history.append(out)
        return out
