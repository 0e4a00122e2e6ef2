"""A per-server sync failure (policy greedy) reaches the coordinator and the trainer as a named error
within a bound, never a silent hang. Two real embedded servers on loopback, the real PerServerSync
(policy thread, one update group per server, the weight store) calling a real coordinator process
(the registry and the failure report cross the process by pickle, as in a run); the test process is
the trainer side. Server 1 is SIGKILLed between syncs; the next version's sync of it fails on
/pause_generation with an SGLangConnectionError, which used to fail to unpickle (SGLangError's
constructor needs its message) and vanish in a pool thread nobody joined."""

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
        return None if e is None else (type(e).__name__, str(e), getattr(e, "endpoint", None))

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
    servers, model = servers
    from megatron_dapo.config.schema import SyncConfig
    from megatron_dapo.coordinator.process import start_process_coordinator
    from megatron_dapo.rollout.client import SGLangConnectionError
    from megatron_dapo.sync.bridge import WeightSyncError
    from megatron_dapo.sync.per_server import PerServerSync, WeightStore

    urls = [s.url for s in servers]
    coord = start_process_coordinator(None, urls, objects=failure_objects)
    syncer = None
    try:
        store = WeightStore()
        store.put(0, _weights(model, 0))
        cfg = SyncConfig(bucket_mb=1, policy="greedy", check_interval_ms=20)
        syncer = PerServerSync(urls, cfg, coord.registry, store, on_error=coord.fail)
        syncer.connect()
        syncer.sync_all()
        syncer.start()
        assert [s.version for s in coord.registry.statuses()] == [0, 0]
        syncer.check()  # nothing failed yet

        servers[1].kill()
        store.put(1, _weights(model, 1))
        syncer.notify()
        _wait(lambda: syncer.error is not None, "recorded failure")

        # the coordinator process got the original error, type and fields intact
        _wait(lambda: coord.take_step(0, 1) is not None, "failure at the coordinator")
        name, message, endpoint = coord.take_step(0, 1)
        assert isinstance(syncer.error, SGLangConnectionError)
        assert (name, message) == ("SGLangConnectionError", str(syncer.error))
        assert endpoint == syncer.error.endpoint == f"POST {urls[1]}/pause_generation"
        # the trainer's per-step check raises it, named, with the original as its cause
        with pytest.raises(WeightSyncError, match="per-server weight sync failed: SGLangConnectionError") as e:
            syncer.check()
        assert e.value.__cause__ is syncer.error
        # the healthy server went on to the new version; the dead one kept its old one
        _wait(lambda: coord.registry.statuses()[0].version == 1, "healthy server at version 1")
        assert coord.registry.statuses()[1].version == 0
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
