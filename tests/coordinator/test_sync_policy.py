"""Per-server sync policies: pure decisions over server snapshots, driven by a fake clock."""

import pytest

from megatron_dapo.config.coordination import SyncPolicyConfig
from megatron_dapo.coordinator.sync_policy import ServerStatus, make_sync_policy
from tests.fake_clock import FakeClock


def _servers():
    return [
        ServerStatus("a", 3, running=0),
        ServerStatus("b", 2, running=5, waiting=0, kv_cache=0.7),
        ServerStatus("c", 2, running=1, waiting=2),
        ServerStatus("d", 2, running=1, kv_cache=0.2, routable=4),
    ]


def test_all_at_once_waits_for_every_server_to_lag_and_greedy_does_not():
    servers = _servers()
    assert make_sync_policy(SyncPolicyConfig("all_at_once")).choose(servers, 3) == []  # "a" holds 3 already
    assert make_sync_policy(SyncPolicyConfig("all_at_once")).choose(servers, 4) == ["a", "b", "c", "d"]
    assert make_sync_policy(SyncPolicyConfig("greedy")).choose(servers, 3) == ["b", "c", "d"]
    servers[1].syncing = True
    assert make_sync_policy(SyncPolicyConfig("greedy")).choose(servers, 3) == ["c", "d"]
    assert make_sync_policy(SyncPolicyConfig("all_at_once")).choose(servers, 4) == []


@pytest.mark.parametrize(
    "indicator, threshold, check_req, want",
    [
        ("request_num", 1, True, []),  # "d" has 1 request but the router holds work it can serve
        ("request_num", 1, False, ["d"]),
        ("request_num", 5, False, ["b", "d"]),  # "c" has a waiting queue: never
        ("kv_cache", 0.5, False, ["d"]),
        ("kv_cache", 0.8, False, ["b", "d"]),
    ],
)
def test_status_based_indicator_threshold_and_router_check(indicator, threshold, check_req, want):
    cfg = SyncPolicyConfig("status_based", indicator=indicator, threshold=threshold, check_req_before_sync=check_req)
    assert make_sync_policy(cfg, FakeClock()).choose(_servers(), 3) == want


def test_status_based_checks_once_per_interval():
    clock = FakeClock()
    servers = [ServerStatus("a", 0, running=3, throughput=50.0)]
    policy = make_sync_policy(
        SyncPolicyConfig("status_based", indicator="throughput", threshold=10.0, check_interval_ms=100), clock
    )
    assert policy.choose(servers, 1) == []  # busy
    servers[0].throughput = 5.0
    clock.t = 0.05
    assert policy.choose(servers, 1) == []  # idle now, but the next check is at 0.1 s
    clock.t = 0.1
    assert policy.choose(servers, 1) == ["a"]


def test_bad_policy_settings_name_the_field():
    with pytest.raises(ValueError, match="rollout.sync.policy must be one of all_at_once, greedy, status_based"):
        SyncPolicyConfig("eager")
    with pytest.raises(ValueError, match="rollout.sync.indicator must be one of"):
        SyncPolicyConfig("status_based", indicator="gpu")
    with pytest.raises(ValueError, match="rollout.sync.check_interval_ms=0 must be > 0"):
        SyncPolicyConfig("status_based", check_interval_ms=0)


def test_policies_check_a_config_the_loader_filled_field_by_field():
    """The simulator loads configs without validation: the coordinator's policies and queues still refuse
    bad values."""
    from megatron_dapo.config import load_config
    from megatron_dapo.coordinator.migration import MigrationPolicy
    from megatron_dapo.coordinator.queues import RequestQueues
    from megatron_dapo.coordinator.routing import make_routing_policy

    cfg = load_config(
        "configs/qwen3/tiny_qwen3_cpu.yaml",
        [
            "rollout.sync.check_interval_ms=0",
            "rollout.migration.threshold=0.5",
            "rollout.routing.request_budget=0",
            "rollout.queue.order=short",
        ],
        validate=False,
    )
    r = cfg.rollout
    for build, section, message in [
        (make_sync_policy, r.sync, "rollout.sync.check_interval_ms=0.0 must be > 0"),
        (MigrationPolicy, r.migration, "rollout.migration.threshold=0.5 must be >= 1"),
        (make_routing_policy, r.routing, "rollout.routing.request_budget must be >= 1"),
        (RequestQueues, r.queue, "rollout.queue.order='short' needs rollout.queue.policy=priority"),
    ]:
        with pytest.raises(ValueError, match=message):
            build(section)
