"""A server lost under per-server sync (policy greedy) either leaves the run going on with the others or,
below rollout.min_healthy_servers, reaches the coordinator and the trainer as a named error, within a
bound: never a silent hang. Two real embedded servers on loopback, the real PerServerSync (policy thread,
one update group per server, the weight store) calling a real coordinator process (the registry and the
failure report cross the process by pickle, as in a run); the test process is the trainer side. Server 1
is SIGKILLed between syncs; the next version's sync of it fails on /pause_generation with an
SGLangConnectionError, which used to fail to unpickle (SGLangError's constructor needs its message) and
vanish in a pool thread nobody joined."""

import time

import pytest
import torch

from megatron_dapo.coordinator.servers import ServerRegistry

pytestmark = pytest.mark.slow

BOUND_S = 60.0  # far above a refused connection's retries; a hang would never get there


class FailureRecorder:
    """The coordinator's side of `fail`, as the producer keeps it (its take_batch then raises it)."""

    def __init__(self):
        self.error = None

    def fail(self, error):
        self.error = self.error or error

    def take_step(self, step, dp_size):
        e = self.error
        return None if e is None else (type(e).__name__, str(e))

    def stop(self):
        pass


def failure_objects(cfg, server_urls):
    return {"coordinator": FailureRecorder(), "registry": ServerRegistry(server_urls, version=-1)}


@pytest.fixture
def servers(tmp_path):
    from megatron_dapo.models.tiny import save_tiny_hf_model
    from megatron_dapo.rollout.launcher import launch_embedded_servers

    model = save_tiny_hf_model("qwen3", tmp_path / "model", eos_token_id=2)
    procs = launch_embedded_servers(str(model), 2, tmp_path / "logs", timeout_s=240)
    try:
        yield procs, model
    finally:
        for s in procs:
            s.stop()


def _wait(cond, what):
    deadline = time.monotonic() + BOUND_S
    while not cond():
        assert time.monotonic() < deadline, f"no {what} within {BOUND_S}s: the failure vanished"
        time.sleep(0.02)


def test_a_killed_server_under_greedy_sync_surfaces_as_a_named_error(servers):
    """min_healthy_servers=2: losing one of two stops the run, naming the server and the failed call."""
    servers, model = servers
    from megatron_dapo.config.schema import SyncConfig
    from megatron_dapo.coordinator.process import start_process_coordinator
    from megatron_dapo.rollout.client import SGLangConnectionError
    from megatron_dapo.sync.errors import ServersLost, WeightSyncError
    from megatron_dapo.sync.per_server import PerServerSync, WeightStore

    urls = [s.url for s in servers]
    coord = start_process_coordinator(None, urls, objects=failure_objects)
    syncer = None
    try:
        store = WeightStore()
        store.put(0, _weights(model, 0))
        cfg = SyncConfig(bucket_mb=1, policy="greedy", check_interval_ms=20)
        syncer = PerServerSync(urls, cfg, coord.registry, store, on_error=coord.fail, min_live=2)
        syncer.connect()
        syncer.sync_all()
        syncer.start()
        assert [s.version for s in coord.registry.statuses()] == [0, 0]
        syncer.check()  # nothing failed yet

        servers[1].kill()
        store.put(1, _weights(model, 1))
        syncer.notify()
        _wait(lambda: syncer.error is not None, "recorded failure")

        # the original error first in the chain: the failed call on the dead server
        assert isinstance(syncer.error, WeightSyncError) and "fewer than rollout.min_healthy_servers=2" in str(
            syncer.error
        )
        assert isinstance(syncer.error.__cause__, ServersLost) and syncer.error.__cause__.urls == [urls[1]]
        original = syncer.error.__cause__.__cause__
        assert isinstance(original, SGLangConnectionError)
        # found at the sync point, before the sync: its check of the server's weight version cannot connect
        assert original.endpoint == f"GET {urls[1]}/get_model_info"
        assert f"{urls[1]}: unreachable: GET {urls[1]}/get_model_info: cannot connect" in str(syncer.error)
        # the coordinator process got the error, type and message intact
        _wait(lambda: coord.take_step(0, 1) is not None, "failure at the coordinator")
        assert coord.take_step(0, 1) == ("WeightSyncError", str(syncer.error))
        # the trainer's per-step check raises it, named, with the original as its cause
        with pytest.raises(WeightSyncError, match="per-server weight sync failed: WeightSyncError") as e:
            syncer.check()
        assert e.value.__cause__ is syncer.error
        # the healthy server went on to the new version; the dead one, marked down, kept its old one
        _wait(lambda: [s.version for s in coord.registry.statuses()] == [1], "healthy server alone at version 1")
        assert coord.registry.metrics()["server/1/version"] == 0 and coord.registry.metrics()["server/1/down"] == 1
    finally:
        if syncer is not None:
            syncer.close()
        coord.close()


def test_a_killed_server_under_greedy_sync_is_left_out_and_the_run_goes_on(servers):
    """min_healthy_servers=1: the dead server leaves routing and syncs; the other keeps taking versions."""
    servers, model = servers
    from megatron_dapo.config.schema import SyncConfig
    from megatron_dapo.coordinator.process import start_process_coordinator
    from megatron_dapo.sync.per_server import PerServerSync, WeightStore

    urls = [s.url for s in servers]
    coord = start_process_coordinator(None, urls, objects=failure_objects)
    syncer = None
    try:
        store = WeightStore()
        store.put(0, _weights(model, 0))
        cfg = SyncConfig(bucket_mb=1, policy="greedy", check_interval_ms=20)
        syncer = PerServerSync(urls, cfg, coord.registry, store, on_error=coord.fail, min_live=1)
        syncer.connect()
        syncer.sync_all()
        syncer.start()

        servers[1].kill()
        store.put(1, _weights(model, 1))
        syncer.notify()
        _wait(lambda: coord.registry.metrics()["server/1/down"] == 1, "dead server marked down")
        _wait(lambda: [s.version for s in coord.registry.statuses()] == [1], "healthy server alone at version 1")
        store.put(2, _weights(model, 2))
        syncer.notify()
        _wait(lambda: [s.version for s in coord.registry.statuses()] == [2], "healthy server at version 2")
        syncer.check()  # nothing the run must stop for
        assert syncer.error is None and coord.take_step(0, 1) is None
        assert coord.registry.metrics()["server/1/version"] == 0
    finally:
        if syncer is not None:
            syncer.close()
        coord.close()


def _weights(model_dir, version: int):
    """The tiny model's weights (HF names), perturbed by a seeded step per version."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    g = torch.Generator().manual_seed(version)
    return [(n, p.detach() + 0.01 * version * torch.randn(p.shape, generator=g)) for n, p in model.state_dict().items()]
