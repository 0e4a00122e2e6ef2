"""Which trainer ranks broadcast a sync, in what order, and how the trainer ranks agree on its outcome.

`SingleSource`: trainer rank 0 broadcasts every tensor (the others only take part in the export's gathers).
`TurnTaking` (`rollout.sync.sources: per_stage`): each source rank broadcasts the tensors it rebuilt itself
over a group of its own, one source after another, handing a token over a gloo group of the sources (SGLang
serves one call at a time: two sources broadcasting at once could each hold a different server and deadlock);
every rank then exchanges the outcome and raises the same error. Trainer rank 0 is the controller in both: it
decides re-admissions and holds the servers' session. The protocol: docs/rollout-and-weight-sync.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_dapo.sync.errors import ServersLost, WeightSyncError, failure_reason
from megatron_dapo.sync.update_group import StreamCounts


@dataclass
class Outcome:
    """A sync's outcome, the same on every trainer rank that takes part."""

    failure: BaseException | None  # what every rank raises (after the cleanup)
    lost: ServersLost | None  # the servers every rank leaves out first
    counts: dict[int, StreamCounts]  # what each source rank streamed

    @property
    def failed(self) -> bool:
        return self.failure is not None


def _describe(error: BaseException) -> str:
    return str(error) if isinstance(error, WeightSyncError) else failure_reason(error)


class Topology(ABC):
    NOTHING_TO_SEND = "sync(): the weight iterator yielded no tensors"  # what a source that has none raises

    def __init__(self, sources: Sequence[int], rank: int):
        self.sources, self.rank = list(sources), rank

    @property
    def is_source(self) -> bool:
        return self.rank in self.sources

    @property
    def is_last_source(self) -> bool:
        """The source whose last bucket carries the version (and the cache flush)."""
        return self.rank == self.sources[-1]

    @abstractmethod
    def group_name(self, base: str) -> str:
        """This rank's update group's name."""

    @abstractmethod
    def connect(self, form: Callable[[], None]) -> None:
        """Form every source's group (`form` on a source: its own)."""

    @abstractmethod
    def own_tensors(self, items: Iterator) -> Iterator:
        """The `(name, tensor)` pairs this source broadcasts, from the export's `items`."""

    @abstractmethod
    def wait_turn(self) -> bool:
        """Block until this source may broadcast; whether every source before it succeeded."""

    @abstractmethod
    def pass_turn(self, ok: bool) -> None:
        """Hand the turn on, saying whether this source and those before it succeeded."""

    @abstractmethod
    def agree(self, error: BaseException | None, counts: StreamCounts) -> Outcome:
        """The sync's outcome from this rank's `error` (None: none) and what it streamed."""

    @abstractmethod
    def regroup(self, reform: Callable[[], None], catch: bool = False) -> list[str]:
        """`reform` each source's group (its own, on a source). With `catch`, the failures, named by source
        rank, on every rank; without, a failure is raised."""

    @abstractmethod
    def decide(self, decide: Callable[[], tuple]) -> tuple | None:
        """Trainer rank 0's `decide()`, on every rank that acts on it (None on a rank that does not)."""

    @abstractmethod
    def regroup_after_verify_loss(self, reform: Callable[[], None]) -> None:
        """After rank 0 lost servers at the verify probe (and left them out), alone."""

    def source_bytes(self, outcome: Outcome) -> dict[int, int] | None:
        """What each source broadcast, for SyncStats (several sources only)."""
        return None


class SingleSource(Topology):
    def __init__(self, rank: int):
        super().__init__([0], rank)

    def group_name(self, base: str) -> str:
        return base

    def connect(self, form: Callable[[], None]) -> None:
        if self.is_source:
            form()

    def own_tensors(self, items: Iterator) -> Iterator:
        return ((n, t) for n, t in items if t is not None)

    def wait_turn(self) -> bool:
        return True  # the only source

    def pass_turn(self, ok: bool) -> None:
        pass

    def agree(self, error: BaseException | None, counts: StreamCounts) -> Outcome:
        lost = error if isinstance(error, ServersLost) else None
        return Outcome(error, lost, {self.rank: counts} if self.is_source else {})

    def regroup(self, reform: Callable[[], None], catch: bool = False) -> list[str]:
        if not self.is_source:
            return []
        try:
            reform()
        except Exception as e:
            if not catch:
                raise
            return [f"source rank {self.rank}: {_describe(e)}"]
        return []

    def decide(self, decide: Callable[[], tuple]) -> tuple | None:
        return decide() if self.is_source else None

    def regroup_after_verify_loss(self, reform: Callable[[], None]) -> None:
        reform()


class TurnTaking(Topology):
    NOTHING_TO_SEND = "the export yielded no tensor on this source (export with EACH_SOURCE)"

    def __init__(self, sources: Sequence[int], rank: int):
        if len(sources) < 2:
            raise ValueError(f"turn-taking needs two sources or more, got {list(sources)}")
        super().__init__(sources, rank)
        self._turns = None  # the sources' gloo group, over which they hand on the token

    def group_name(self, base: str) -> str:
        return f"{base}_src{self.rank}"

    def connect(self, form: Callable[[], None]) -> None:
        self._turns = dist.new_group(self.sources, backend="gloo")  # every rank, in the same order
        if not self.is_source:
            return
        for source in self.sources:  # one at a time: a server joins one group at a time
            if source == self.rank:
                form()
            dist.barrier(group=self._turns)

    def own_tensors(self, items: Iterator) -> Iterator:
        """The export yields each source's tensors as one run (None elsewhere). Its first tensor is rebuilt
        now, before this source waits for its turn: a source that is also a TP peer of an earlier one takes
        part in that one's gathers first."""
        first = next(((n, t) for n, t in items if t is not None), None)  # earlier sources' items are None here
        return self._run_from(first, items)

    @staticmethod
    def _run_from(first, items: Iterable) -> Iterator:
        if first is None:
            return
        yield first
        for name, tensor in items:
            if tensor is None:
                return
            yield name, tensor

    def wait_turn(self) -> bool:
        i = self.sources.index(self.rank)
        if i == 0:
            return True
        token = torch.zeros(1, dtype=torch.int64)
        dist.recv(token, src=self.sources[i - 1], group=self._turns)
        return bool(token.item())

    def pass_turn(self, ok: bool) -> None:
        i = self.sources.index(self.rank)
        if i + 1 < len(self.sources):
            dist.send(torch.tensor([int(ok)], dtype=torch.int64), dst=self.sources[i + 1], group=self._turns)

    def agree(self, error: BaseException | None, counts: StreamCounts) -> Outcome:
        """Every rank's outcome, exchanged: one ServersLost naming every server lost and the source that lost
        it when each failure lost servers, else one WeightSyncError naming each failed source."""
        outcomes = [None] * dist.get_world_size()
        why = None if error is None else _describe(error)
        gone = error.reasons if isinstance(error, ServersLost) else None
        dist.all_gather_object(outcomes, (self.rank, why, gone, counts))
        failures = [f"source rank {rank}: {why}" for rank, why, _, _ in outcomes if why is not None]
        by_source = {rank: c for rank, _, _, c in outcomes if rank in self.sources}
        if not failures:
            return Outcome(None, None, by_source)
        failed = [gone for _, why, gone, _ in outcomes if why is not None]
        if all(gone is not None for gone in failed):
            reasons = {url: reason for gone in failed for url, reason in gone.items()}
            lost = ServersLost("weight sync lost servers; " + "; ".join(failures), reasons)
            failure = lost
        else:
            lost, failure = None, WeightSyncError("weight sync failed; " + "; ".join(failures))
        failure.__cause__ = error
        return Outcome(failure, lost, by_source)

    def regroup(self, reform: Callable[[], None], catch: bool = False) -> list[str]:
        """Each source in turn (a server joins one group at a time); with `catch`, a source's failure is kept
        until after its turn, so the later sources still take theirs, then every rank's are exchanged."""
        error = None
        if self.is_source:
            for source in self.sources:
                if source == self.rank:
                    try:
                        reform()
                    except Exception as e:  # any: the other sources wait for this one's turn to end
                        if not catch:
                            raise
                        error = _describe(e)
                dist.barrier(group=self._turns)
        if not catch:
            return []
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        return [f"source rank {rank}: {e}" for rank, e in enumerate(errors) if e is not None]

    def decide(self, decide: Callable[[], tuple]) -> tuple | None:
        decision = [decide() if self.rank == 0 else None]
        dist.broadcast_object_list(decision, src=0)
        return decision[0]

    def regroup_after_verify_loss(self, reform: Callable[[], None]) -> None:
        """Nothing now: the sources re-form their groups together, at the next re-admission."""

    def source_bytes(self, outcome: Outcome) -> dict[int, int] | None:
        return {rank: c.nbytes for rank, c in outcome.counts.items()}
