"""Bounded staleness by reservation (PSRL's reserve / occupy / consume), for whole prompt groups.

One buffer of `slots` group slots per training version: a group dispatched at version V_traj reserves a slot
in a buffer <= V_traj + s and is trained there or earlier, so the bound holds by construction and nothing
completed is ever discarded for staleness. Prompt-level redundancy (`extra`, `take_dropped`) and the
proactive filter (`abort_reserved`, `move_down`) trade aborted generation for not waiting on a buffer's
slowest group. The protocol rule by rule, why reservation, and the comparison with PSRL's
`StalenessInventory`: docs/design/staleness-by-reservation.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from typing import Any

EMPTY, RESERVED, OCCUPIED = "empty", "reserved", "occupied"


class StalenessError(ValueError):
    """A reserve / occupy / consume call, or a restored state, that would break the protocol."""


@dataclass
class Slot:
    state: str = EMPTY
    key: Hashable | None = None
    v_traj: int = -1
    item: Any = None
    since: float = 0.0  # clock() when the slot took its current state


class StalenessController:
    """Reserve / occupy / consume over per-version buffers of `slots` group slots.

    Not thread-safe: the caller holds its own lock. `clock` (seconds, monotonic) only timestamps
    slots, for the ages and waits a scheduler may look at; it never changes a decision.
    """

    def __init__(
        self,
        slots: int,
        staleness: int,
        clock: Callable[[], float] = time.monotonic,
        next_buffer: int = 0,
        extra: int = 0,
    ):
        if slots < 1:
            raise ValueError(f"staleness buffers need at least one slot, got {slots}")
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        if extra < 0:
            raise ValueError(f"extra (redundant) slots must be >= 0, got {extra}")
        self.slots, self.staleness, self.clock = slots, staleness, clock
        self.extra = extra
        self.capacity = slots + extra  # slots per buffer; `slots` occupied make it ready
        self.next_buffer = next_buffer  # the buffer the trainer consumes next; earlier ones are gone
        self.buffers: dict[int, list[Slot]] = {}  # written only through _set (keeps _tally)
        # buffer -> slots per state: the fullness tests every dispatch and completion asks, without a scan
        self._tally: dict[int, dict[str, int]] = {}
        self.where: dict[Hashable, tuple[int, int]] = {}  # key -> (buffer, slot), reserved or occupied
        self._dropped: list[Hashable] = []  # reservations given up by the controller, for the caller to abort

    # ---- queries -------------------------------------------------------------------------------
    def _buffer(self, b: int) -> list[Slot]:
        if b not in self.buffers:
            self.buffers[b] = [Slot(since=self.clock()) for _ in range(self.capacity)]
            self._tally[b] = {EMPTY: self.capacity, RESERVED: 0, OCCUPIED: 0}
        return self.buffers[b]

    def _set(self, b: int, i: int, slot: Slot) -> None:
        """Put `slot` at (b, i), keeping the per-state tally of buffer b."""
        buf, tally = self.buffers[b], self._tally[b]
        tally[buf[i].state] -= 1
        tally[slot.state] += 1
        buf[i] = slot

    def _full(self, b: int) -> bool:
        self._buffer(b)
        return self._tally[b][OCCUPIED] >= self.slots

    def _has_room(self, b: int) -> bool:
        """Buffer `b` may still take a group: not full, and an empty slot."""
        return not self._full(b) and self._tally[b][EMPTY] > 0

    def _open(self, hi: int, lo: int | None = None) -> list[int]:
        """Buffers that may still take a group, from the next one (or `lo`) up to `hi`."""
        return [b for b in range(max(self.next_buffer, lo or 0), hi + 1) if self._has_room(b)]

    def reservable(self, v_traj: int) -> int:
        """Empty slots a group dispatched now at version `v_traj` could reserve."""
        return sum(self._tally[b][EMPTY] for b in self._open(v_traj + self.staleness))

    def count(self, state: str, buffer: int | None = None) -> int:
        if buffer is not None:
            return self._tally[buffer][state] if buffer in self._tally else 0
        return sum(t[state] for t in self._tally.values())

    def ready(self) -> bool:
        """The next buffer holds `slots` completed groups: the trainer may consume it."""
        return self.count(OCCUPIED, self.next_buffer) == self.slots

    def reserved_keys(self, buffer: int) -> list[Hashable]:
        """Groups in flight with a reservation in `buffer`, in slot order."""
        return [s.key for s in self.buffers.get(buffer, []) if s.state == RESERVED]

    def take_dropped(self) -> list[Hashable]:
        """Reservations the controller gave up since the last call (surplus of a full buffer):
        their groups must be aborted; their prompts count as drawn."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def occupied_items(self) -> list[tuple[int, int, Any]]:
        """(buffer, slot, item) of every completed, not yet consumed group, in buffer and slot order."""
        return [
            (b, i, s.item) for b in sorted(self.buffers) for i, s in enumerate(self.buffers[b]) if s.state == OCCUPIED
        ]

    def oldest_reservation_age(self) -> float:
        now = self.clock()
        return max((now - s.since for buf in self.buffers.values() for s in buf if s.state == RESERVED), default=0.0)

    # ---- the protocol --------------------------------------------------------------------------
    def reserve(self, key: Hashable, v_traj: int) -> tuple[int, int] | None:
        """Reserve the worst-case slot for a group about to be dispatched; None = may not dispatch."""
        if key in self.where:
            raise StalenessError(f"group {key!r} already holds a slot at {self.where[key]}")
        return self._reserve_worst_case(key, v_traj)

    def _reserve_worst_case(self, key: Hashable, v_traj: int, lo: int | None = None) -> tuple[int, int] | None:
        """The last empty slot of the highest buffer in [lo, V_traj + s] with room."""
        open_ = self._open(v_traj + self.staleness, lo)
        if not open_:
            return None
        b = open_[-1]
        buf = self.buffers[b]
        i = next(j for j in range(len(buf) - 1, -1, -1) if buf[j].state == EMPTY)
        self._set(b, i, Slot(RESERVED, key, v_traj, since=self.clock()))
        self.where[key] = (b, i)
        return b, i

    def release(self, key: Hashable) -> None:
        """Give a reserved slot back (the group was dropped, failed, or is abandoned)."""
        b, i = self._reserved(key)
        self._set(b, i, Slot(since=self.clock()))
        del self.where[key]

    def occupy(self, key: Hashable, item: Any) -> tuple[int, int]:
        """A reserved group completed: place it in the earliest empty slot; returns (buffer, slot).

        First, as PSRL's occupy does, the slot this group leaves goes to the earliest in-flight group
        reserved before it (earlier buffer, or earlier slot of the same buffer) whose bound still
        holds there: that group gets one more buffer of time, and the early buffers fill with groups
        in completion order instead of waiting for the ones reserved in them.
        """
        b_res, i_res = self._reserved(key)
        v_traj = self.buffers[b_res][i_res].v_traj
        self._set(b_res, i_res, Slot(since=self.clock()))
        later = self._earliest_movable(b_res, i_res)
        if later is not None:  # its worst case moves later, still within its bound
            moved = self.buffers[later[0]][later[1]]
            self._set(b_res, i_res, moved)
            self.where[moved.key] = (b_res, i_res)
            self._set(later[0], later[1], Slot(since=self.clock()))
        # the reserved buffer is not full (a full one holds no reservation), so it or an earlier
        # buffer has room: never later than reserved
        b = self._open(b_res)[0]
        i = next(i for i, s in enumerate(self.buffers[b]) if s.state == EMPTY)
        self._set(b, i, Slot(OCCUPIED, key, v_traj, item, since=self.clock()))
        self.where[key] = (b, i)
        if self._full(b):
            self._evict_reservations(b)
        return b, i

    def _earliest_movable(self, b_res: int, i_res: int) -> tuple[int, int] | None:
        """The first reservation before slot (b_res, i_res), in buffer and slot order, whose bound
        still holds in buffer b_res; buffers without reservations are skipped unread."""
        for b in range(self.next_buffer, b_res + 1):
            if not self._tally[b][RESERVED]:
                continue
            buf = self.buffers[b]
            for i in range(i_res if b == b_res else len(buf)):
                s = buf[i]
                if s.state == RESERVED and b_res <= s.v_traj + self.staleness:
                    return b, i
        return None

    def _evict_reservations(self, b: int) -> None:
        """Buffer `b` just filled: its remaining (redundant) reservations move to their worst case in
        a later buffer, or are dropped."""
        for key in self.reserved_keys(b):
            pos = self.where.pop(key)
            v_traj = self.buffers[b][pos[1]].v_traj
            self._set(b, pos[1], Slot(since=self.clock()))
            if self._reserve_worst_case(key, v_traj, lo=b + 1) is None:
                self._dropped.append(key)

    # ---- the proactive filter ------------------------------------------------------------------
    def abort_reserved(self, buffer: int) -> list[Hashable]:
        """Give up every reservation of `buffer`; returns their keys (the caller aborts the groups)."""
        keys = self.reserved_keys(buffer)
        for key in keys:
            self.release(key)
        return keys

    def movable(self, buffer: int) -> int:
        """Completed groups in buffers after `buffer` that could move down into it."""
        return sum(
            s.state == OCCUPIED and s.v_traj <= buffer for b, buf in self.buffers.items() if b > buffer for s in buf
        )

    def move_down(self, buffer: int, n: int) -> list[Hashable]:
        """Move up to `n` completed groups from the newest later buffers into `buffer`'s empty slots
        (their staleness only drops); returns the keys moved. Within a buffer the oldest V_traj goes
        first, as PSRL's proactive filter takes them."""
        candidates = [
            (b, i)
            for b in sorted((b for b in self.buffers if b > buffer), reverse=True)
            for i in sorted(
                (i for i, s in enumerate(self.buffers[b]) if s.state == OCCUPIED and s.v_traj <= buffer),
                key=lambda i, b=b: (self.buffers[b][i].v_traj, i),
            )
        ]
        moved: list[Hashable] = []
        for b, i in candidates:
            if len(moved) == n or not self._has_room(buffer):
                break
            slot = self.buffers[b][i]
            self._set(b, i, Slot(since=self.clock()))
            j = next(j for j, s in enumerate(self.buffers[buffer]) if s.state == EMPTY)
            self._set(buffer, j, replace(slot, since=self.clock()))
            self.where[slot.key] = (buffer, j)
            moved.append(slot.key)
        if self._full(buffer):
            self._evict_reservations(buffer)
        return moved

    def consume(self) -> list[Any]:
        """The next buffer's items in slot order; the trainer moves on to the buffer after it."""
        if not self.ready():
            raise StalenessError(
                f"buffer {self.next_buffer} is not full: "
                f"{self.count(OCCUPIED, self.next_buffer)}/{self.slots} slots occupied"
            )
        buf = self.buffers.pop(self.next_buffer)
        del self._tally[self.next_buffer]
        for s in buf:
            if s.state != EMPTY:
                del self.where[s.key]
            if s.state == RESERVED:  # only from a restored state: a full buffer's reservations move or drop
                self._dropped.append(s.key)
        self.next_buffer += 1
        return [s.item for s in buf if s.state == OCCUPIED]

    def _reserved(self, key: Hashable) -> tuple[int, int]:
        pos = self.where.get(key)
        if pos is None or self.buffers[pos[0]][pos[1]].state != RESERVED:
            raise StalenessError(f"group {key!r} holds no reservation")
        return pos

    # ---- checkpoints ---------------------------------------------------------------------------
    def restore(
        self, key: Hashable, v_traj: int, buffer: int, slot: int, item: Any = None, state: str = OCCUPIED
    ) -> None:
        """Put a group back where a checkpoint saw it: completed (`OCCUPIED`, with its item) or in
        flight (`RESERVED`, to be dispatched again)."""
        if buffer < self.next_buffer or not 0 <= slot < self.capacity:
            raise StalenessError(f"group {key!r}: slot ({buffer}, {slot}) is outside the open buffers")
        if buffer > v_traj + self.staleness:
            raise StalenessError(
                f"group {key!r} of version {v_traj} cannot sit in buffer {buffer} (staleness {self.staleness})"
            )
        s = self._buffer(buffer)[slot]
        if s.state != EMPTY or key in self.where:
            raise StalenessError(f"group {key!r}: slot ({buffer}, {slot}) is taken or the group is placed twice")
        self._set(buffer, slot, Slot(state, key, v_traj, item, since=self.clock()))
        self.where[key] = (buffer, slot)
