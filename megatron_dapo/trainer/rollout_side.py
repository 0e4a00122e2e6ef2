"""The rollout side of DAPO training: keep the servers busy, judge groups, buffer informative ones.

`RolloutProducer` runs an asyncio loop on its own thread (trainer rank 0). It submits prompt
groups (one `/generate` with n samples each; a batch of n seeded ones when seeded) through the
router; when a group's n samples are back it is scored (reward runner, overlong shaping) and judged
by dynamic sampling; kept groups enter a FIFO buffer that the trainer drains with `take_batch(step)`.

Bounded staleness. The trainer at step t holds weights version t; a group whose oldest token
came from version w has staleness t - w. With bound s, the producer running at version v may
have at most (v + s + 1) * B groups produced in total (B = train_batch_size): those consumed,
buffered, and in flight. So with s = 0 it generates exactly one step ahead of nothing (on-policy),
with s = 1 it works on step v + 1's batch while step v trains. A buffered group that is still
too old when taken (a slow request) is dropped and counted, never trained on.

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
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import threading
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field, replace

from megatron_dapo.rollout.types import SamplingParams
from megatron_dapo.trainer.groups import JudgedGroup, judge_group

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
    max_resubmits: int = 3  # a group aborted by the server (e.g. during an update) is sent again
    seed: int | None = None  # base of per-sample sampling seeds (see the module doc); None = unseeded


@dataclass
class BatchInfo:
    """What it took to fill one step's batch (logged per step)."""

    groups: list[JudgedGroup]
    kept: int
    dropped_all_correct: int
    dropped_all_wrong: int
    dropped_stale: int
    gen_batches: int
    reward_failures: int
    staleness: Counter = field(default_factory=Counter)  # staleness -> groups
    wait_s: float = 0.0


class RolloutProducer:
    def __init__(self, router_factory, dataset, sampler, reward_runner, settings: ProducerSettings, version: int = 0,
                 tokenizer=None):
        """`router_factory()` builds the router inside the producer's event loop (aiohttp sessions
        belong to the loop that creates them). With `tokenizer`, responses are judged on their
        tokens decoded here (special tokens skipped), whatever text the server returns."""
        self.tokenizer = tokenizer
        self.router_factory = router_factory
        self.dataset, self.sampler, self.rewards = dataset, sampler, reward_runner
        self.s = settings
        self.gen_batch_size = settings.gen_batch_size or settings.train_batch_size
        self._cv = threading.Condition()
        self.version = version
        self.consumed = 0  # groups handed to the trainer, ever (after resume: restored)
        self.buffer: deque[JudgedGroup] = deque()
        self.in_flight = 0
        self.judged_since_take = 0
        self.dropped_correct = self.dropped_wrong = self.failures_since_take = 0
        self.error: BaseException | None = None
        self.exhausted = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

    # ---- lifecycle (trainer thread) --------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._poke()
        if self._thread is not None:
            self._thread.join(timeout)

    def _poke(self) -> None:
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def set_version(self, version: int) -> None:
        """Servers now hold `version` (after a weight sync): more groups may be submitted."""
        with self._cv:
            self.version = version
        self._poke()

    # ---- capacity ------------------------------------------------------------------------------
    def _capacity(self) -> int:
        budget = (self.version + self.s.staleness + 1) * self.s.train_batch_size
        return budget - self.consumed - len(self.buffer) - self.in_flight

    def _limit_reached(self) -> bool:
        limit = self.s.max_num_gen_batches * self.gen_batch_size
        return limit > 0 and self.judged_since_take >= limit and len(self.buffer) < self.s.train_batch_size

    # ---- the event loop ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # surfaced to the trainer by take_batch
            log.exception("rollout producer failed")
            with self._cv:
                self.error = e
                self._cv.notify_all()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        router = self.router_factory()
        tasks: set[asyncio.Task] = set()
        async with router:
            while True:
                with self._cv:
                    if self._stop:
                        break
                    if self._limit_reached():
                        self.exhausted = True
                        self._cv.notify_all()
                    n_new = 0 if self.exhausted else max(0, self._capacity())
                    picks = [self.sampler.next_draw() for _ in range(n_new)]
                    self.in_flight += n_new
                for idx, draw in picks:
                    t = asyncio.create_task(self._one_group(router, idx, draw))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                self._wake.clear()
                await self._wake.wait()
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _generate(self, router, prompt: list[int], draw: int, group_id: str) -> list:
        if self.s.seed is None:
            sampling = SamplingParams(**{**self.s.sampling.__dict__, "n": self.s.n})
            return await router.generate(prompt, sampling, group_id=group_id)

        # one batch request: the server takes the group at once (n requests would straggle in)
        seeded = [replace(self.s.sampling, n=1, sampling_seed=sample_seed(self.s.seed, draw, i))
                  for i in range(self.s.n)]
        return await router.generate(prompt, seeded, group_id=group_id, rid=group_id)

    async def _one_group(self, router, idx: int, draw: int = -1) -> None:
        rec = self.dataset[idx]
        try:
            for attempt in range(self.s.max_resubmits + 1):
                # a fresh group id per attempt: rids of an aborted attempt may still be in flight
                samples = await self._generate(router, list(rec.prompt_ids), draw, f"p{idx}-{uuid.uuid4().hex[:8]}")
                if not any(s.aborted for s in samples):
                    break
                log.info("group of prompt %d aborted by the server (attempt %d); resubmitting", idx, attempt)
            else:
                raise RuntimeError(f"prompt {idx}: generation aborted {self.s.max_resubmits + 1} times")
            samples = sorted(samples, key=lambda s: s.index)
            for i, s in enumerate(samples):
                s.index = i
            extra = dict(rec.extra_info)
            items = [(response_text(s, self.tokenizer), rec.ground_truth, rec.data_source, extra) for s in samples]
            rewards = await asyncio.to_thread(self.rewards.score_many, items)
            group = judge_group(idx, samples, rewards, self.s.max_response_length, self.s.overlong, self.s.filter_metric)
            group.draw = draw
        except asyncio.CancelledError:
            with self._cv:
                self.in_flight -= 1
            raise
        except BaseException as e:
            with self._cv:
                self.in_flight -= 1
                self.error = e
                self._cv.notify_all()
            return
        with self._cv:
            self.in_flight -= 1
            self.judged_since_take += 1
            self.failures_since_take += group.reward_failures
            if group.kept:
                self.buffer.append(group)
            elif group.accs and all(group.accs):
                self.dropped_correct += 1
            else:
                self.dropped_wrong += 1
            self._cv.notify_all()
        self._wake.set()

    # ---- the trainer's side --------------------------------------------------------------------
    def take_batch(self, step: int, timeout_s: float = 3600.0) -> BatchInfo:
        """Block until B groups no older than `staleness` versions relative to `step` are buffered."""
        B, s = self.s.train_batch_size, self.s.staleness
        t0 = time.monotonic()
        dropped_stale = 0
        with self._cv:
            while True:
                if self.error is not None:
                    raise RuntimeError(f"rollout failed: {self.error!r}") from self.error
                while self.buffer and step - self.buffer[0].min_version > s:
                    self.buffer.popleft()  # too old by now: never trained on; frees capacity
                    dropped_stale += 1
                    self._poke()
                if len(self.buffer) >= B:
                    break
                if self.exhausted:
                    raise DynamicSamplingExhausted(
                        f"dynamic sampling: {self.judged_since_take} groups judged in "
                        f"{math.ceil(self.judged_since_take / self.gen_batch_size)} generation batches "
                        f"(algo.filter_groups.max_num_gen_batches={self.s.max_num_gen_batches}, "
                        f"{self.gen_batch_size} prompts each), only {len(self.buffer)} kept; dropped "
                        f"{self.dropped_correct} all-correct and {self.dropped_wrong} all-wrong groups; "
                        f"train_batch_size needs {B}. Raise max_num_gen_batches or n_resp_per_prompt, "
                        f"or use an easier / warmer start."
                    )
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"no full batch for step {step} after {timeout_s}s "
                                       f"({len(self.buffer)}/{B} groups kept, {self.in_flight} in flight)")
                self._cv.wait(1.0)
            # Draw order, not finishing order: the order of a batch (hence its mini-batches) does not
            # depend on timing.
            groups = sorted((self.buffer.popleft() for _ in range(B)), key=lambda g: g.draw)
            # Judged groups beyond this batch (already buffered) count towards the next one.
            judged = self.judged_since_take - len(self.buffer)
            info = BatchInfo(
                groups, B, self.dropped_correct, self.dropped_wrong, dropped_stale,
                gen_batches=max(1, math.ceil(judged / self.gen_batch_size)),
                reward_failures=self.failures_since_take,
                staleness=Counter(step - g.min_version for g in groups),
                wait_s=time.monotonic() - t0,
            )
            self.consumed += B  # stale drops free their budget: only trained groups count
            self.judged_since_take = len(self.buffer)
            self.dropped_correct = self.dropped_wrong = self.failures_since_take = 0
        self._poke()
        return info

    # ---- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Data position and the buffered (judged, not yet trained) groups. In-flight groups are lost
        on resume; the sampler position after them is kept, so no prompt is drawn twice."""
        with self._cv:
            return {
                "sampler": self.sampler.state_dict(),
                "consumed": self.consumed,
                "version": self.version,
                "buffer": [g.to_state() for g in self.buffer],
            }

    def load_state_dict(self, state: dict) -> None:
        with self._cv:
            self.sampler.load_state_dict(state["sampler"])
            self.version = int(state["version"])
            self.buffer = deque(JudgedGroup.from_state(g) for g in state["buffer"])
            # What was in flight at save time is gone: the budget counts only what exists.
            self.consumed = int(state["consumed"])
