"""The rollout coordinator: the rollout side of a run, in a process of its own.

`CoordinatorService` owns everything that generates training data: the prompt sampler, the router,
the server registry (each server's weight version, routing state, sync / idle time), the staleness
buffers and partial trajectories (all inside `RolloutProducer`, whose policies it leaves alone), the
reward runner (its own worker pool when `reward.num_workers > 0`), the load poller that keeps each
server's `/v1/loads` report in the registry (`rollout.loads`) and the validation set. It runs
in a subprocess of trainer rank 0 under torchrun, in a named Ray actor under Ray
(megatron_dapo.coordinator.process), so generation, reward scoring and routing never share an
interpreter (GIL) with training.

For step t it builds the batch (advantages need whole groups), cuts it into data-parallel shards
(megatron_dapo.shards) and hands them to trainer rank 0 with the step's rollout metrics;
each rank then receives only its own shard. The registry lives here, beside the router that reads
it; the per-server syncer (trainer rank 0, which holds the weight store) changes it remotely.

The remote interface is declared once, here: `REMOTE_CALLS` names each object the coordinator
serves ("coordinator": the service, "registry": its ServerRegistry) and the methods a client may
call on it; process.py serves exactly these, under either transport. A call's arguments and result
must pickle (plain pickle: tensors travel as bytes, whatever the transport).
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

from megatron_dapo.coordinator.servers import ServerRegistry
from megatron_dapo.data.dataset import DatasetError
from megatron_dapo.errors import CheckpointError
from megatron_dapo.types import StepData

# The rest (the producer and its builders, batches, shards, evaluation) is imported where used: it pulls in
# torch and transformers, which the coordinator process loads at `setup`, not at start (nor rank 0, which
# imports this module for its call tables).

log = logging.getLogger(__name__)

# what a client may call on each object the coordinator serves
COORDINATOR_CALLS = (
    "setup",
    "restore",
    "start",
    "stop",
    "take_step",
    "set_version",
    "fail",
    "checkpoint_state",
    "snapshot",
    "validate",
)
REGISTRY_CALLS = (
    "begin_sync",
    "end_sync",
    "mark_down",
    "mark_up",
    "publish_all",
    "statuses",
    "metrics",
    "take_events",
    "state",
    "load_state",
)
REMOTE_CALLS = {"coordinator": COORDINATOR_CALLS, "registry": REGISTRY_CALLS}


def step_metrics(info, cfg, batch) -> dict[str, float]:
    """Rollout metrics of one step's batch, logged by trainer rank 0."""
    from megatron_dapo.coordinator.metrics import batch_metrics, response_metrics, staleness_metrics

    m = response_metrics(info.groups)
    m.update(batch_metrics(batch))
    m.update(
        {
            "groups/kept": info.kept,
            "groups/dropped_all_correct": info.dropped_all_correct,
            "groups/dropped_all_wrong": info.dropped_all_wrong,
            "groups/gen_batches": info.gen_batches,
            "reward/failures": info.reward_failures,
            "reward/calls_per_s": info.reward_calls_per_s,
            # measured on the batch, not assumed: the reservation protocol keeps it at 0
            "groups/over_staleness_bound": sum(n for k, n in info.staleness.items() if k > cfg.algo.staleness),
        }
    )
    m.update({f"reward/failures/{t}": n for t, n in sorted(info.reward_failure_types.items())})
    m.update(info.metrics())
    m.update(staleness_metrics(info.staleness, cfg.algo.staleness))
    return m


_BATCH_INFO_COUNTS = (
    "kept",
    "dropped_all_correct",
    "dropped_all_wrong",
    "gen_batches",
    "reward_failures",
    "reward_calls_per_s",
    "wait_s",
    "reserved_slots",
    "occupied_slots",
    "partial_resumes",
    "tokens_regenerated",
)


def batch_info_state(info) -> dict:
    return {
        **{k: getattr(info, k) for k in _BATCH_INFO_COUNTS},
        "staleness": dict(info.staleness),
        "coordination": dict(info.coordination),
        "reward_failure_types": dict(info.reward_failure_types),
        "groups": [g.to_state() for g in info.groups],
    }


def batch_info_from_state(state: dict):
    from megatron_dapo.coordinator.groups import JudgedGroup
    from megatron_dapo.coordinator.producer import BatchInfo

    state = dict(state)
    state.pop("dropped_stale", None)  # checkpoints from before staleness by reservation
    return BatchInfo(
        groups=[JudgedGroup.from_state(g) for g in state.pop("groups")],
        staleness=Counter({int(k): v for k, v in state.pop("staleness").items()}),
        coordination=Counter(state.pop("coordination", {})),
        reward_failure_types=Counter(state.pop("reward_failure_types", {})),
        **state,
    )


class CoordinatorService:
    """Built cheaply (it may be constructed remotely); `setup` loads data and builds the producer."""

    def __init__(self, cfg, server_urls: list[str]):
        self.cfg, self.urls = cfg, list(server_urls)
        # each server's weight version, routing state and sync / idle time (versions set by the first sync)
        self.registry = ServerRegistry(self.urls, version=-1)
        self.producer = self.val_data = self.poller = None
        self._pending: dict = {}  # step -> BatchInfo taken before its step (for a checkpoint, or restored)

    # ---- lifecycle -------------------------------------------------------------------------------
    def setup(self) -> dict:
        """Tokenizer, datasets, reward runner, router and producer. Raises DatasetError / ValueError /
        OSError naming what is wrong. Returns the dataset sizes (for the trainer's log)."""
        from megatron_dapo.coordinator.build import build_producer, load_tokenizer, prompt_dataset

        cfg = self.cfg
        tokenizer = load_tokenizer(cfg)
        dataset = prompt_dataset(cfg, cfg.data.train_files, tokenizer)
        if cfg.data.val_files:
            self.val_data = prompt_dataset(cfg, cfg.data.val_files, tokenizer)
        self.producer = build_producer(cfg, self.urls, dataset, tokenizer, self.registry)
        return {
            "train": len(dataset),
            "dropped": dataset.num_dropped_too_long,
            "truncated": dataset.num_truncated,
            "val": 0 if self.val_data is None else len(self.val_data),
        }

    def restore(self, found: str, state: dict, next_step: int) -> None:
        """Load a checkpoint's rollout state; its saved batch is step `next_step`'s. A state that does
        not fit (missing keys, wrong types) is a CheckpointError naming the file."""
        state = dict(state)
        try:
            saved = state.pop("next_batch")
            pending = None if saved is None else batch_info_from_state(saved)
            self.producer.load_state_dict(state)
        except DatasetError:  # a sampler state for another dataset: it says so
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(
                f"{Path(found) / 'rollout.json'} does not fit this run ({type(e).__name__}: {e})"
            ) from None
        if pending is not None:
            self._pending[next_step] = pending

    def start(self) -> None:
        from megatron_dapo.coordinator.load_poller import LoadPoller, poll_interval_s

        if (interval := poll_interval_s(self.cfg.rollout)) is not None:  # each server's own load, in the registry
            self.poller = LoadPoller(self.registry, interval, api_key=self.cfg.rollout.api_key).start()
        self.producer.start()

    def stop(self) -> None:
        if self.poller is not None:
            self.poller.stop()
        if self.producer is not None:
            self.producer.stop()
            close = getattr(self.producer.rewards, "close", None)
            if close is not None:
                close()

    # ---- the trainer's side ----------------------------------------------------------------------
    def _take(self, step: int):
        info = self._pending.pop(step, None)
        return info if info is not None else self.producer.take_batch(step)

    def take_step(self, step: int, dp_size: int) -> StepData:
        """Step `step`'s batch as `dp_size` shards with its metrics."""
        from megatron_dapo.coordinator.batch import build_batch
        from megatron_dapo.shards import shard_batch

        cfg = self.cfg
        info = self._take(step)
        batch = build_batch(
            info.groups,
            step,
            cfg.rollout.sampling.temperature,
            cfg.algo.norm_adv_by_std,
            cfg.algo.overlong_filter,
            cfg.algo.adv_estimator,
        )
        return StepData(
            shards=shard_batch(batch, dp_size, cfg.algo.ppo_mini_batch_size),
            metrics=step_metrics(info, cfg, batch),
            staleness=Counter(info.staleness),
            extra={
                "prompt_indices": batch.prompt_indices,
                "sample_versions": [min(v) if v else step for v in batch.token_versions],
            },
            tokens=sum(len(x) for x in batch.input_ids),
        )

    def set_version(self, version: int) -> None:
        self.producer.set_version(version)

    def fail(self, error: BaseException) -> None:
        self.producer.fail(error)

    def checkpoint_state(self, next_step: int | None) -> dict:
        """The producer's state plus step `next_step`'s batch, taken now (None: the run ends here),
        so that a resumed run trains the next step on exactly this data."""
        if next_step is not None:
            self._pending[next_step] = self._take(next_step)
        return self.snapshot(next_step)

    def snapshot(self, next_step: int | None) -> dict:
        """The producer's state plus step `next_step`'s batch if it was taken already (by a checkpoint),
        never waiting for one: what a restarted coordinator resumes from (`restore`), kept by trainer
        rank 0 after every step (coordinator/restart.py)."""
        info = self._pending.get(next_step)
        state = self.producer.state_dict()
        state["next_batch"] = None if info is None else batch_info_state(info)
        return state

    def validate(self) -> dict | None:
        """Validation metrics on the servers (None: no validation set)."""
        if self.val_data is None:
            return None
        from megatron_dapo.coordinator.evaluate import ValSettings, evaluate

        cfg = self.cfg
        return evaluate(
            self.urls,
            self.val_data,
            self.producer.rewards,
            ValSettings.from_config(cfg),
            api_key=cfg.rollout.api_key,
            tokenizer=self.producer.tokenizer,
            timeout_s=cfg.rollout.request_timeout_s,
        ).metrics
