"""The rollout coordinator: its process (service.py: the rollout side of a run, apart from the
trainer; process.py: where it runs, a subprocess of trainer rank 0 or a named Ray actor, and the
client rank 0 calls) and its policies: staleness by reservation (with redundant slots), partial
rollout, per-server sync decisions, the registry of each server's weight version (servers.py), the
proactive filter (retry.py) and request migration (migration.py).

The policies are plain classes and pure functions with an injectable clock and no I/O, so that the
async producer (megatron_dapo.coordinator.producer) and a simulator can drive the same code.
"""

from megatron_dapo.config.coordination import MigrationConfig
from megatron_dapo.coordinator.migration import MigrationPolicy
from megatron_dapo.coordinator.partial import (
    continuation_ids,
    continuation_sampling,
    finish_partial,
    merge_continuation,
)
from megatron_dapo.coordinator.retry import ProactiveRetry
from megatron_dapo.coordinator.staleness import StalenessController, StalenessError

__all__ = [
    "MigrationConfig",
    "MigrationPolicy",
    "ProactiveRetry",
    "StalenessController",
    "StalenessError",
    "continuation_ids",
    "continuation_sampling",
    "finish_partial",
    "merge_continuation",
]
