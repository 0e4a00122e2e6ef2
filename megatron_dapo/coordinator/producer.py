"""The rollout side of DAPO training: keep the servers busy, judge groups, buffer informative ones.

`RolloutProducer` runs an asyncio loop on its own thread of the coordinator process
(megatron_dapo.coordinator.service; not a trainer process). It submits prompt
groups (one `/generate` with n samples each; a batch of n seeded ones when seeded) through the
router; when a group's n samples are back it is scored (reward runner, overlong shaping) and judged
by dynamic sampling; kept groups occupy staleness slots, and the trainer takes step t's full buffer
with `take_batch(t)`.

Bounded staleness, by reservation (megatron_dapo.coordinator.staleness). The trainer at step t
holds weights version t and consumes buffer t. A group is dispatched only if it can reserve a slot
in a buffer no later than V_traj + s (V_traj: the servers' version at dispatch, bound s); when it
completes it occupies the earliest slot it may take, never a later buffer than it reserved. So the bound
holds by construction: no group is ever too old when trained, and none is thrown away for it (a
slow group holds its buffer back instead). A group dropped by dynamic sampling frees its slot and
a fresh prompt is dispatched at once. With s = 0 the producer generates exactly the next batch
(on-policy); with s = 1 it works on step v + 1's batch while step v trains.

Partial rollout (`partial_rollout`, megatron_dapo.coordinator.partial). A sample the server aborted
(e.g. a weight update that aborts requests) continues from its tokens and logprobs, on the same
seed, with the weights the server holds now; its spans record the version of every token. Without
it the whole group is generated again from scratch (its tokens counted as regenerated). A
checkpoint keeps the groups in flight with their slots and partial samples; a resumed producer
dispatches them again, continuing what the servers had answered.

Seeded rollouts. With `settings.seed` set, sample i of the prompt at draw number d (the sampler's
position, see `PromptSampler.next_draw`) is generated with `sampling_seed = sample_seed(seed, d, i)`,
as one batch request of n entries with n = 1 and a seed each (SGLang gives the n copies of one
seeded request the same seed, hence the same tokens). A group's samples then depend only on the
weights and on where the prompt was drawn, not on what else the servers were batching, and a batch
lists its groups in draw order, not in the order they finished. So a resumed synchronous run
(staleness 0) regenerates exactly the batches the interrupted one would have. SGLang honours the
seed only with --enable-deterministic-inference.

Dynamic sampling limit. Groups judged since the last batch was taken count towards the next
one; when they reach max_num_gen_batches * gen_batch_size without B kept, the producer stops
and `take_batch` raises `DynamicSamplingExhausted` with the counts.

Rollout coordination switches (all off by default; see README "Rollout coordination"):
- `extra_samples` (sample-level redundancy): n + extra samples per group, one request each; the
  first n to finish are kept (re-indexed 0..n-1 in index order), the rest aborted. Advantages use
  exactly the n kept.
- `extra_prompts` (prompt-level redundancy): each staleness buffer takes B + extra reservations and
  is ready with B completed groups; the controller moves or drops the surplus reservations
  (megatron_dapo.coordinator.staleness) and the producer aborts the dropped groups.
- `retry_threshold` (the proactive filter, megatron_dapo.coordinator.retry): while the trainer waits
  on a buffer a few groups short, its in-flight groups are aborted and completed groups of later
  buffers moved down into it.
- `migration` (megatron_dapo.coordinator.migration): every `check_interval_s` the servers' loads are
  compared; the chosen server's requests are aborted and continue elsewhere (partial rollout).
An aborted group's prompt counts as drawn (like a group dropped by dynamic sampling; the sampler is
a stream, and giving a prompt back would change which seed later draws get): `totals` counts every
such group by reason, so every draw is trained, waiting, in flight, dropped or aborted. With any of
the switches on, a group is sent as one batch request with a rid per sample (also unseeded), so the
router can abort it. Which samples and groups are kept then depends on timing: each sample keeps its
seed, but a seeded run no longer reproduces its batches exactly (not even at staleness 0).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace

from megatron_dapo.config.coordination import MigrationConfig
from megatron_dapo.coordinator import StalenessController, continuation_ids, finish_partial
from megatron_dapo.coordinator.groups import JudgedGroup, judge_group, sample_from_state, token_versions
from megatron_dapo.coordinator.load_poller import LOAD_TIMEOUT_S
from megatron_dapo.coordinator.migration import MigrationPolicy
from megatron_dapo.coordinator.retry import ProactiveRetry
from megatron_dapo.coordinator.staleness import OCCUPIED, RESERVED
from megatron_dapo.coordinator.sync_policy import ServerStatus
from megatron_dapo.rollout.types import Sample, SamplingParams

log = logging.getLogger(__name__)


def response_text(sample, tokenizer=None) -> str:
    """What the reward judges: the response tokens decoded without special tokens (a server's own
    `text` may keep the stop token, e.g. `<|im_end|>`, on the answer line)."""
    if tokenizer is None:
        return sample.text
    return tokenizer.decode(sample.output_ids, skip_special_tokens=True)


def sample_seed(seed: int, draw: int, index: int) -> int:
    """The sampling_seed of sample `index` of the prompt at sampler draw `draw`: a hash, so that
    neighbouring draws and samples get unrelated streams; in [0, 2**63) as SGLang requires."""
    digest = hashlib.blake2b(f"{int(seed)}/{int(draw)}/{int(index)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class DynamicSamplingExhausted(RuntimeError):
    """max_num_gen_batches generation batches did not yield a full batch of informative groups."""


@dataclass
class ProducerSettings:
    train_batch_size: int  # groups per step (B)
    n: int  # samples per group
    sampling: SamplingParams
    max_response_length: int
    staleness: int = 1
    gen_batch_size: int | None = None  # for counting generation batches; None = B
    max_num_gen_batches: int = 10  # 0 = no limit
    filter_metric: str | None = "acc"  # None = dynamic sampling off
    overlong: object = None  # OverlongBufferConfig
    max_resubmits: int = 3  # aborts in a row without a new token (partial) / group restarts (not partial)
    partial_rollout: bool = True  # continue aborted samples from their tokens instead of regenerating the group
    seed: int | None = None  # base of per-sample sampling seeds (see the module doc); None = unseeded
    extra_samples: int = 0  # sample-level redundancy: n + this per group, keep the first n
    extra_prompts: int = 0  # prompt-level redundancy: B + this reservations per staleness buffer
    retry_threshold: int = 0  # proactive filter: largest gap it closes; 0 = off
    migration: MigrationConfig = field(default_factory=MigrationConfig)  # off unless enabled
    check_interval_s: float = 0.1  # how often migration examines the servers

    @property
    def aborts_groups(self) -> bool:
        """Some switch aborts requests by rid: send every group with a rid per sample."""
        return bool(self.extra_samples or self.extra_prompts or self.retry_threshold or self.migration.enabled)


@dataclass
class BatchInfo:
    """What it took to fill one step's batch (logged per step)."""

    groups: list[JudgedGroup]
    kept: int
    dropped_all_correct: int
    dropped_all_wrong: int
    gen_batches: int
    reward_failures: int
    staleness: Counter = field(default_factory=Counter)  # staleness -> groups
    wait_s: float = 0.0
    reserved_slots: int = 0  # groups in flight holding a reservation, when the batch was taken
    occupied_slots: int = 0  # completed groups left in later buffers, when the batch was taken
    partial_resumes: int = 0  # continuation requests of aborted samples since the last batch
    tokens_regenerated: int = 0  # generated tokens thrown away (aborted groups restarted) since the last batch
    coordination: Counter = field(default_factory=Counter)  # aborts, retries, migrations since the last batch

    @property
    def retractions(self) -> int:
        """Times the servers retracted this batch's samples (a full KV pool) before they finished."""
        return sum(s.num_retractions for g in self.groups for s in g.samples)

    def metrics(self) -> dict[str, float]:
        return {"rollout/reserved_slots": self.reserved_slots, "rollout/occupied_slots": self.occupied_slots,
                "rollout/partial_resumes": self.partial_resumes, "rollout/retractions": self.retractions,
                "rollout/tokens_regenerated": self.tokens_regenerated,
                **{f"rollout/{k}": float(v) for k, v in sorted(self.coordination.items())}}


COORDINATION_COUNTS = ("groups_aborted_surplus", "groups_aborted_retry", "groups_moved_down", "retries",
                       "samples_aborted_surplus", "migrations", "requests_migrated", "routing_refusals",
                       "router_queue")


@dataclass
class InFlight:
    """A dispatched group not yet judged: what a checkpoint needs to dispatch it again."""

    idx: int  # dataset index
    v_traj: int
    samples: list[Sample | None] | None = None  # the latest answers (aborted ones partial); None = none yet
    group_id: str | None = None  # the router's group id of the current attempt (to abort it)


class RolloutProducer:
    def __init__(self, router_factory, dataset, sampler, reward_runner, settings: ProducerSettings, version: int = 0,
                 tokenizer=None, clock=time.monotonic):
        """`router_factory()` builds the router inside the producer's event loop (aiohttp sessions
        belong to the loop that creates them). With `tokenizer`, responses are judged on their
        tokens decoded here (special tokens skipped), whatever text the server returns."""
        self.tokenizer = tokenizer
        self.router_factory = router_factory
        self.dataset, self.sampler, self.rewards = dataset, sampler, reward_runner
        self.s = settings
        self.clock = clock
        self.gen_batch_size = settings.gen_batch_size or settings.train_batch_size
        self._cv = threading.Condition()
        self.version = version
        self.slots = StalenessController(settings.train_batch_size, settings.staleness, clock=clock,
                                         extra=settings.extra_prompts)
        self.retry = ProactiveRetry(settings.retry_threshold, clock) if settings.retry_threshold else None
        self.migration = MigrationPolicy(settings.migration, clock) if settings.migration.enabled else None
        self.coordination_since_take: Counter = Counter({k: 0 for k in COORDINATION_COUNTS})
        self._refusals_taken = 0  # the router's refusal count at the last batch
        self.totals: Counter = Counter()  # groups ever: dropped (dynamic sampling) / aborted_surplus / aborted_retry
        self._waiting_for: int | None = None  # the buffer take_batch waits on
        self._tasks: dict[int, asyncio.Task] = {}  # draw -> its group's task
        self._aborts: set[asyncio.Task] = set()  # abort calls in flight
        self._router = None
        self.judged_since_take = 0
        self.dropped_correct = self.dropped_wrong = self.failures_since_take = 0
        self.resumes_since_take = self.regenerated_since_take = 0
        self.flight: dict[int, InFlight] = {}  # draw -> its group in flight
        self._redispatch: list[int] = []  # draws restored in flight from a checkpoint
        self.error: BaseException | None = None
        self.exhausted = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._listeners: list = []  # called (under the lock) whenever take_batch may have an answer

    # ---- views of the staleness buffers (under self._cv) ----------------------------------------
    @property
    def consumed(self) -> int:
        """Groups handed to the trainer, ever (after resume: restored)."""
        return self.slots.next_buffer * self.s.train_batch_size

    @property
    def in_flight(self) -> int:
        return self.slots.count(RESERVED)

    @property
    def buffer(self) -> list[JudgedGroup]:
        """Completed groups waiting to be trained on, in buffer and slot order."""
        return [g for _, _, g in self.slots.occupied_items()]

    # ---- lifecycle (trainer thread) --------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._stop = True
            self._changed()
        self._poke()
        if self._thread is not None:
            self._thread.join(timeout)

    def add_listener(self, fn) -> None:
        """`fn()` is called, under the producer's lock, whenever `try_take_batch` may have a new answer
        (a group judged, an error, exhaustion, stop): how a caller on the producer's own event loop
        (the simulator's trainer) waits without blocking the loop."""
        self._listeners.append(fn)

    def _changed(self) -> None:
        self._cv.notify_all()
        for fn in self._listeners:
            fn()

    def _poke(self) -> None:
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def set_version(self, version: int) -> None:
        """A server now holds `version` (after a weight sync): later buffers open for reservations.
        Never backwards: with per-server sync, publishes of two servers may arrive out of order."""
        with self._cv:
            self.version = max(self.version, version)
        self._poke()

    def fail(self, error: BaseException) -> None:
        """Something outside the producer (a per-server weight sync) failed: take_batch raises it."""
        with self._cv:
            self.error = self.error or error
            self._changed()

    def _limit_reached(self) -> bool:
        limit = self.s.max_num_gen_batches * self.gen_batch_size
        return limit > 0 and self.judged_since_take >= limit and not self.slots.ready()

    # ---- the event loop ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            asyncio.run(self.run())
        except BaseException as e:  # surfaced to the trainer by take_batch
            log.exception("rollout producer failed")
            with self._cv:
                self.error = e
                self._changed()

    def _dispatchable(self) -> list[tuple[int, int, int]]:
        """Draw a prompt for every slot that can be reserved now: (dataset index, draw, V_traj)."""
        if self._limit_reached():
            self.exhausted = True
            self._changed()
        if self.exhausted:
            return []
        picks = [(self.flight[d].idx, d, self.flight[d].v_traj) for d in self._redispatch]
        self._redispatch = []
        # Oldest version first: a group of V_traj v may run on any server holding >= v, so with
        # per-server sync the lagging servers keep taking work while buffers up to v + s have room,
        # instead of every new group waiting for (and piling onto) the servers that synced first.
        for v in range(self._oldest_version(), self.version + 1):
            for _ in range(self.slots.reservable(v)):
                idx, draw = self.sampler.next_draw()
                self.slots.reserve(draw, v)
                self.flight[draw] = InFlight(idx, v)
                picks.append((idx, draw, v))
        return picks

    def _oldest_version(self) -> int:
        """The oldest weight version a healthy server holds (= self.version unless servers sync
        one by one, which only the registry's per-server versions show)."""
        registry = getattr(self._router, "registry", None)
        if registry is None:
            return self.version
        return min([self.version, *(registry.version(s.url) for s in self._router.healthy())])

    async def run(self) -> None:
        """The producer's loop: dispatch, judge, buffer until `stop()`. `start()` runs it on its own
        thread; a caller owning an event loop (the simulator) may run it as a task there instead."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        router = self._router = self.router_factory()
        tasks: set[asyncio.Task] = set()
        async with router:
            if self.migration is not None:
                tasks.add(asyncio.create_task(self._migration_loop(router)))
            while True:
                with self._cv:
                    if self._stop:
                        break
                    self._maybe_retry()
                    picks = self._dispatchable()
                for idx, draw, v_traj in picks:
                    t = asyncio.create_task(self._one_group(router, idx, draw, v_traj))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                    self._tasks[draw] = t
                    t.add_done_callback(lambda _t, d=draw: self._tasks.pop(d, None) if self._tasks.get(d) is _t
                                        else None)
                self._wake.clear()
                await self._wake.wait()
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ---- redundancy, proactive filter, migration (on the event loop, under self._cv) -----------
    def _abandon(self, draws, reason: str) -> None:
        """Give up groups whose slots the controller already freed: cancel their tasks and abort
        their requests on the servers. Their prompts count as drawn."""
        for d in draws:
            f = self.flight.pop(d, None)
            self.coordination_since_take[f"groups_aborted_{reason}"] += 1
            self.totals[f"aborted_{reason}"] += 1
            task = self._tasks.pop(d, None)
            if task is not None:
                task.cancel()
            if f is not None and f.group_id is not None and self._router is not None:
                t = asyncio.ensure_future(self._router.abort_group(f.group_id))
                self._aborts.add(t)  # the loop keeps only weak references to tasks
                t.add_done_callback(self._aborts.discard)

    def _maybe_retry(self) -> None:
        if self.retry is None:
            return
        out = self.retry.apply(self.slots, trainer_waiting=self._waiting_for == self.slots.next_buffer)
        if out is None:
            return
        log.info("proactive retry on buffer %d: %d in flight aborted, %d completed groups moved down",
                 out.buffer, len(out.aborted), len(out.moved))
        self.coordination_since_take["retries"] += 1
        self.coordination_since_take["groups_moved_down"] += len(out.moved)
        self._abandon(out.aborted, "retry")
        self._abandon(self.slots.take_dropped(), "surplus")
        self._changed()

    async def _server_statuses(self, router) -> list[ServerStatus]:
        """Healthy servers' versions and loads: the router's counts (and the registry's last load reports);
        with a throughput / kv_cache indicator, fresh /v1/loads reports overwrite them."""
        if router.registry is not None:
            statuses = router.registry.statuses()
        else:
            with self._cv:
                version = self.version
            statuses = [ServerStatus(s.url, version, running=s.outstanding) for s in router.servers]
        healthy = {s.url for s in router.healthy()}
        statuses = [s for s in statuses if s.url in healthy]
        for s in statuses:
            s.protected = router.protected_on(s.url)
        if self.migration.cfg.needs_loads:
            by_url = {s.url: s for s in router.servers}
            # the generation clients wait minutes for an answer; a load report that slow is no report
            rows = await asyncio.gather(*(asyncio.wait_for(by_url[s.url].client.get_loads(), LOAD_TIMEOUT_S)
                                          for s in statuses), return_exceptions=True)
            known = []
            for st, load in zip(statuses, rows):
                if isinstance(load, BaseException):  # no report: not a candidate this round
                    continue
                st.running, st.waiting, st.throughput = load.running, load.waiting, load.throughput
                st.kv_cache = load.kv_tokens / load.kv_capacity if load.kv_capacity else 0.0  # unrounded
                known.append(st)
            statuses = known
        return statuses

    async def _migration_loop(self, router) -> None:
        try:
            while True:
                await asyncio.sleep(self.s.check_interval_s)
                await self._migrate_once(router)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a broken migration loop is a failed run, not a silent stop of migrating
            log.exception("migration loop failed")
            self.fail(e)

    async def _migrate_once(self, router) -> None:
        m = self.migration.choose(await self._server_statuses(router))
        if m is None:
            return
        aborted = await router.migrate_from(m.source)
        log.info("migration: %d requests aborted on %s (ratio %.3g to starved %s)", aborted, m.source,
                 m.ratio, m.starved)
        if not aborted:  # all it runs continues earlier migrations (the router keeps them): nothing moved
            return
        with self._cv:
            self.coordination_since_take["migrations"] += 1
            self.coordination_since_take["requests_migrated"] += aborted

    def _sampling(self, draw: int, index: int) -> SamplingParams:
        """Sample `index`'s own parameters (its seed when seeded)."""
        seed = None if self.s.seed is None else sample_seed(self.s.seed, draw, index)
        return replace(self.s.sampling, n=1, sampling_seed=seed)

    def _v_traj(self, draw: int) -> int:
        with self._cv:
            return self.flight[draw].v_traj

    async def _generate(self, router, prompt: list[int], draw: int, group_id: str) -> list:
        # only on a server holding at least the group's V_traj (with per-server sync; else all hold it)
        v_traj = self._v_traj(draw)
        with self._cv:
            if draw in self.flight:
                self.flight[draw].group_id = group_id
        if self.s.seed is None and not self.s.aborts_groups:
            sampling = SamplingParams(**{**self.s.sampling.__dict__, "n": self.s.n})
            return await router.generate(prompt, sampling, group_id=group_id, min_version=v_traj)

        # one batch request: the server takes the group at once (n requests would straggle in)
        seeded = [self._sampling(draw, i) for i in range(self.s.n)]
        return await router.generate(prompt, seeded, group_id=group_id, rid=group_id, min_version=v_traj)

    def _count(self, resumes: int = 0, regenerated: int = 0) -> None:
        with self._cv:
            self.resumes_since_take += resumes
            self.regenerated_since_take += regenerated

    def _progress(self, draw: int, sample: Sample) -> None:
        with self._cv:
            if draw in self.flight:
                self.flight[draw].samples[sample.index] = sample

    async def _generate_group(self, router, prompt: list[int], idx: int, draw: int,
                              resumed: list[Sample] | None = None) -> list[Sample]:
        """The group's n finished samples; `resumed`: its answers saved by a checkpoint, continued."""
        if self.s.extra_samples:
            return await self._first_n(router, prompt, idx, draw, resumed)
        if resumed is not None and (len(resumed) != self.s.n or any(x is None for x in resumed)):
            resumed = None  # saved with other redundancy settings: generated again
        for attempt in range(self.s.max_resubmits + 1):
            if resumed is not None:
                samples, resumed = resumed, None
                with self._cv:
                    self.flight[draw].group_id = samples[0].group_id
            else:
                # a fresh group id per attempt: rids of an aborted attempt may still be in flight
                samples = await self._generate(router, prompt, draw, f"p{idx}-{uuid.uuid4().hex[:8]}")
                samples = sorted(samples, key=lambda s: s.index)
                for i, s in enumerate(samples):
                    s.index = i
            if not any(s.aborted for s in samples):
                return samples
            if self.s.partial_rollout:
                with self._cv:
                    self.flight[draw].samples = list(samples)
                return list(await asyncio.gather(*(self._finish(router, draw, s) for s in samples)))
            self._count(regenerated=sum(len(s.output_ids) for s in samples))
            log.info("group of prompt %d aborted by the server (attempt %d); resubmitting", idx, attempt)
        raise RuntimeError(f"prompt {idx}: generation aborted {self.s.max_resubmits + 1} times")

    async def _first_n(self, router, prompt: list[int], idx: int, draw: int,
                       resumed: list[Sample | None] | None) -> list[Sample]:
        """Sample-level redundancy: n + extra samples, one request each; the first n to finish are kept."""
        n_all = self.s.n + self.s.extra_samples
        gid = f"p{idx}-{uuid.uuid4().hex[:8]}"
        v_traj = self._v_traj(draw)
        with self._cv:
            f = self.flight[draw]
            f.group_id = gid
            if resumed is None or len(resumed) != n_all:
                resumed = [None] * n_all
            f.samples = list(resumed)

        async def one(i: int) -> Sample:
            prior = resumed[i]
            for _ in range(self.s.max_resubmits + 1):
                if prior is not None:
                    smp, prior = prior, None
                    smp.group_id = gid
                else:
                    (smp,) = await router.generate(prompt, [self._sampling(draw, i)], group_id=gid,
                                                   rid=f"{gid}-s{i}-{uuid.uuid4().hex[:4]}", min_version=v_traj)
                    smp.index = i
                    self._progress(draw, smp)
                if not smp.aborted:
                    return smp
                if self.s.partial_rollout:
                    return await self._finish(router, draw, smp)
                self._count(regenerated=len(smp.output_ids))
            raise RuntimeError(f"prompt {idx}: sample {i} aborted {self.s.max_resubmits + 1} times")

        tasks = [asyncio.ensure_future(one(i)) for i in range(n_all)]
        kept: list[Sample] = []
        try:
            for fut in asyncio.as_completed(tasks):
                kept.append(await fut)
                if len(kept) == self.s.n:
                    break
        finally:
            pending = [t for t in tasks if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                await router.abort_group(gid)
                with self._cv:
                    self.coordination_since_take["samples_aborted_surplus"] += len(pending)
            await asyncio.gather(*pending, return_exceptions=True)
        kept.sort(key=lambda smp: smp.index)
        for j, smp in enumerate(kept):
            smp.index = j
        return kept

    async def _finish(self, router, draw: int, sample: Sample) -> Sample:
        """Partial rollout of one aborted sample, on its group's server when it can."""

        v_traj = self._v_traj(draw)

        async def generate(so_far: Sample, sampling):
            rid = f"{sample.group_id}-{sample.index}-{uuid.uuid4().hex[:6]}"
            # a resumed trajectory: routing charges its generated tokens, priority queues order it by V_traj,
            # and it goes on at its newest tokens' version or later (never back to older weights)
            (piece,) = await router.generate(continuation_ids(so_far), sampling, group_id=sample.group_id, rid=rid,
                                             min_version=v_traj, generated=len(so_far.output_ids),
                                             newest_version=max(token_versions(so_far), default=None))
            return piece

        return await finish_partial(generate, sample, self._sampling(draw, sample.index), self.s.max_resubmits,
                                    on_resume=lambda: self._count(resumes=1),
                                    on_progress=lambda merged: self._progress(draw, merged))

    async def _one_group(self, router, idx: int, draw: int, v_traj: int) -> None:
        rec = self.dataset[idx]
        with self._cv:
            resumed = self.flight[draw].samples
        try:
            samples = await self._generate_group(router, list(rec.prompt_ids), idx, draw, resumed)
            extra = dict(rec.extra_info)
            items = [(response_text(s, self.tokenizer), rec.ground_truth, rec.data_source, extra) for s in samples]
            rewards = await asyncio.to_thread(self.rewards.score_many, items)
            group = judge_group(idx, samples, rewards, self.s.max_response_length, self.s.overlong, self.s.filter_metric)
            group.draw, group.v_traj = draw, v_traj
        except asyncio.CancelledError:
            with self._cv:
                if self.flight.pop(draw, None) is not None:  # not given up by the coordinator (slot freed)
                    self.slots.release(draw)
            raise
        except BaseException as e:
            with self._cv:
                if self.flight.pop(draw, None) is not None:
                    self.slots.release(draw)
                    self.error = e
                    self._changed()
            return
        with self._cv:
            if self.flight.pop(draw, None) is None:  # given up while it was being judged
                return
            self.judged_since_take += 1
            self.failures_since_take += group.reward_failures
            if group.kept:
                self.slots.occupy(draw, group)
                self._abandon(self.slots.take_dropped(), "surplus")  # a buffer filled: its surplus goes
            else:  # dynamic sampling: the slot goes to a fresh prompt at once
                self.slots.release(draw)
                self.totals["dropped"] += 1
                if group.accs and all(group.accs):
                    self.dropped_correct += 1
                else:
                    self.dropped_wrong += 1
            self._changed()
        self._wake.set()

    # ---- the trainer's side --------------------------------------------------------------------
    def take_batch(self, step: int, timeout_s: float = 3600.0) -> BatchInfo:
        """Block until step `step`'s buffer is full, then hand over its B groups (in draw order)."""
        with self._cv:
            if step != self.slots.next_buffer:
                raise ValueError(f"take_batch({step}): the next buffer is step {self.slots.next_buffer}'s")
            self._waiting_for = step  # the proactive filter acts only while the trainer waits
        self._poke()
        try:
            return self._take_batch(step, timeout_s)
        finally:
            with self._cv:
                self._waiting_for = None

    def _take_batch(self, step: int, timeout_s: float) -> BatchInfo:
        t0, waited = time.monotonic(), self.clock()
        with self._cv:
            while True:
                info = self._take_ready(step, waited)
                if info is not None:
                    break
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"no full batch for step {step} after {timeout_s}s "
                                       f"({self.slots.count(OCCUPIED, step)}/{self.s.train_batch_size} groups "
                                       f"kept, {self.in_flight} in flight)")
                self._cv.wait(1.0)
        self._poke()
        return info

    def try_take_batch(self, step: int, waiting_since: float | None = None) -> BatchInfo | None:
        """`take_batch` without waiting: step `step`'s batch if its buffer is full, else None
        (raises as take_batch does). `waiting_since`: clock() when the caller began waiting (wait_s)."""
        with self._cv:
            info = self._take_ready(step, self.clock() if waiting_since is None else waiting_since)
            began = info is None and self._waiting_for != step
            self._waiting_for = None if info is not None else step  # the caller waits until it has it
        if info is not None or began:  # the proactive filter acts only while the trainer waits
            self._poke()
        return info

    def _take_ready(self, step: int, waiting_since: float) -> BatchInfo | None:
        """Under self._cv: consume step `step`'s buffer if it is full; None if not yet."""
        B = self.s.train_batch_size
        if step != self.slots.next_buffer:
            raise ValueError(f"take_batch({step}): the next buffer is step {self.slots.next_buffer}'s")
        if self.error is not None:
            raise RuntimeError(f"rollout failed: {self.error!r}") from self.error
        if not self.slots.ready():
            if self.exhausted:
                raise DynamicSamplingExhausted(
                    f"dynamic sampling: {self.judged_since_take} groups judged in "
                    f"{math.ceil(self.judged_since_take / self.gen_batch_size)} generation batches "
                    f"(algo.filter_groups.max_num_gen_batches={self.s.max_num_gen_batches}, "
                    f"{self.gen_batch_size} prompts each), only {self.slots.count(OCCUPIED, step)} kept; dropped "
                    f"{self.dropped_correct} all-correct and {self.dropped_wrong} all-wrong groups; "
                    f"train_batch_size needs {B}. Raise max_num_gen_batches or n_resp_per_prompt, "
                    f"or use an easier / warmer start."
                )
            return None
        # Draw order, not finishing order: the order of a batch (hence its mini-batches) does not
        # depend on timing.
        groups = sorted(self.slots.consume(), key=lambda g: g.draw)
        later = self.slots.count(OCCUPIED)
        # Judged groups beyond this batch (already in later buffers) count towards the next one.
        judged = self.judged_since_take - later
        info = BatchInfo(
            groups, B, self.dropped_correct, self.dropped_wrong,
            gen_batches=max(1, math.ceil(judged / self.gen_batch_size)),
            reward_failures=self.failures_since_take,
            staleness=Counter(step - g.min_version for g in groups),
            wait_s=self.clock() - waiting_since,
            reserved_slots=self.in_flight, occupied_slots=later,
            partial_resumes=self.resumes_since_take, tokens_regenerated=self.regenerated_since_take,
            coordination=self._router_counts(self.coordination_since_take),
        )
        self.judged_since_take = later
        self.dropped_correct = self.dropped_wrong = self.failures_since_take = 0
        self.resumes_since_take = self.regenerated_since_take = 0
        self.coordination_since_take = Counter({k: 0 for k in COORDINATION_COUNTS})
        return info

    def _router_counts(self, counts: Counter) -> Counter:
        """`counts` plus the router's admission control since the last batch: times a request was
        refused (kept waiting), and requests waiting at the router now."""
        router = self._router
        if router is not None:
            refusals = router.refusals
            counts["routing_refusals"] += max(0, refusals - self._refusals_taken)
            counts["router_queue"] += len(router.dispatcher)
            self._refusals_taken = refusals
        return counts

    # ---- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Data position, the completed groups not yet trained and the groups in flight, with their
        slots. A resumed producer dispatches the in-flight groups again (same draw, V_traj and slot),
        continuing the samples the servers had answered partially (partial rollout); so no prompt is
        lost or drawn twice. Tokens a server had not yet answered are generated again."""
        from dataclasses import asdict

        with self._cv:
            occupied = self.slots.occupied_items()
            return {
                "sampler": self.sampler.state_dict(),
                "consumed": self.consumed,
                "version": self.version,
                "buffer": [g.to_state() for _, _, g in occupied],
                "slots": [[b, i] for b, i, _ in occupied],
                "in_flight": [
                    {"draw": d, "idx": f.idx, "v_traj": f.v_traj, "slot": list(self.slots.where[d]),
                     "samples": None if f.samples is None else [None if s is None else asdict(s)
                                                                for s in f.samples]}
                    for d, f in sorted(self.flight.items())
                ],
            }

    def load_state_dict(self, state: dict) -> None:
        B = self.s.train_batch_size
        consumed = int(state["consumed"])
        if consumed % B:
            raise ValueError(f"rollout state: {consumed} groups consumed is not a multiple of "
                             f"train_batch_size {B}")
        groups = [JudgedGroup.from_state(g) for g in state["buffer"]]
        # checkpoints older than the staleness slots: completed groups fill the next buffers in order
        where = state.get("slots") or [(consumed // B + i // B, i % B) for i in range(len(groups))]
        slots = StalenessController(B, self.s.staleness, clock=self.clock, next_buffer=consumed // B,
                                    extra=self.s.extra_prompts)
        for n, (g, (b, i)) in enumerate(zip(groups, where)):
            v_traj = g.v_traj if g.v_traj >= 0 else g.min_version
            slots.restore(g.draw if g.draw >= 0 else f"restored-{n}", v_traj, int(b), int(i), g)
        flight = {}
        for f in state.get("in_flight") or []:
            draw = int(f["draw"])
            slots.restore(draw, int(f["v_traj"]), int(f["slot"][0]), int(f["slot"][1]), state=RESERVED)
            samples = None if f["samples"] is None else [None if s is None else sample_from_state(s)
                                                         for s in f["samples"]]
            flight[draw] = InFlight(int(f["idx"]), int(f["v_traj"]), samples)
        with self._cv:
            self.sampler.load_state_dict(state["sampler"])
            self.version = int(state["version"])
            self.slots, self.flight, self._redispatch = slots, flight, sorted(flight)
