"""The producer's settings, its records (a group in flight, one step's batch) and its counters."""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field, replace

from megatron_dapo.config.coordination import MigrationConfig
from megatron_dapo.coordinator.groups import JudgedGroup
from megatron_dapo.rollout.types import Sample, SamplingParams


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
    seed: int | None = None  # base of per-sample sampling seeds (see the package doc); None = unseeded
    extra_samples: int = 0  # sample-level redundancy: n + this per group, keep the first n
    extra_prompts: int = 0  # prompt-level redundancy: B + this reservations per staleness buffer
    retry_threshold: int = 0  # proactive filter: largest gap it closes; 0 = off
    migration: MigrationConfig = field(default_factory=MigrationConfig)  # off unless enabled
    check_interval_s: float = 0.1  # how often migration examines the servers

    @property
    def aborts_groups(self) -> bool:
        """Some switch aborts requests by rid: send every group with a rid per sample."""
        return bool(self.extra_samples or self.extra_prompts or self.retry_threshold or self.migration.enabled)

    @property
    def gen_batch_groups(self) -> int:
        """Groups per generation batch: gen_batch_size, else B."""
        return self.gen_batch_size or self.train_batch_size

    def sampling_for(self, draw: int, index: int) -> SamplingParams:
        """Sample `index`'s own parameters (its seed when seeded) for the prompt at draw `draw`."""
        seed = None if self.seed is None else sample_seed(self.seed, draw, index)
        return replace(self.sampling, n=1, sampling_seed=seed)


@dataclass
class BatchInfo:
    """What it took to fill one step's batch (logged per step)."""

    groups: list[JudgedGroup]
    kept: int
    dropped_all_correct: int
    dropped_all_wrong: int
    gen_batches: int
    reward_failures: int
    reward_failure_types: Counter = field(default_factory=Counter)  # type name -> failed reward calls
    reward_calls_per_s: float = 0.0  # the reward runner's throughput since the last batch
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
        return {
            "rollout/reserved_slots": self.reserved_slots,
            "rollout/occupied_slots": self.occupied_slots,
            "rollout/partial_resumes": self.partial_resumes,
            "rollout/retractions": self.retractions,
            "rollout/tokens_regenerated": self.tokens_regenerated,
            **{f"rollout/{k}": float(v) for k, v in sorted(self.coordination.items())},
        }


COORDINATION_COUNTS = (
    "groups_aborted_surplus",
    "groups_aborted_retry",
    "groups_moved_down",
    "retries",
    "samples_aborted_surplus",
    "migrations",
    "requests_migrated",
    "routing_refusals",
    "router_queue",
)


def _coordination() -> Counter:
    return Counter({k: 0 for k in COORDINATION_COUNTS})


@dataclass
class ProducerCounters:
    """What happened since the last batch was taken (reset by `reset`), and `totals`, groups ever by
    fate: dropped (dynamic sampling) / aborted_surplus / aborted_retry."""

    judged: int = 0  # groups judged towards the next batch
    dropped_correct: int = 0
    dropped_wrong: int = 0
    reward_failures: int = 0
    reward_failure_types: Counter = field(default_factory=Counter)
    groups_reward_failed: int = 0  # groups with a failed reward call
    resumes: int = 0  # partial-rollout continuation requests
    regenerated: int = 0  # generated tokens thrown away
    coordination: Counter = field(default_factory=_coordination)
    refusals_taken: int = 0  # the router's refusal count at the last batch (not reset)
    rewards_taken: tuple[int, float] = (0, 0.0)  # the reward runner's activity() at the last batch (not reset)
    totals: Counter = field(default_factory=Counter)  # not reset

    def reset(self, judged: int) -> None:
        """A batch was taken; `judged`: groups already judged into later buffers."""
        self.judged = judged
        self.dropped_correct = self.dropped_wrong = self.reward_failures = self.groups_reward_failed = 0
        self.reward_failure_types = Counter()
        self.resumes = self.regenerated = 0
        self.coordination = _coordination()


@dataclass
class InFlight:
    """A dispatched group not yet judged: what a checkpoint needs to dispatch it again."""

    idx: int  # dataset index
    v_traj: int
    samples: list[Sample | None] | None = None  # the latest answers (aborted ones partial); None = none yet
    group_id: str | None = None  # the router's group id of the current attempt (to abort it)
