"""Per-server sync lets each server take new weights on its own time: a slow server never holds a fast
one back. Two real embedded servers on loopback, the real PerServerSync (policy thread, one update group
per server, the weight store, the registry); the test process is the trainer side (rank 0 of both
update groups) and stores weight versions itself.

- greedy: server 1 is made slow for real (SIGSTOP: its sync of version 1 cannot finish while stopped).
  Server 0 meanwhile takes versions 1 and 2; then server 1, resumed, takes 1 and 2 as well.
- status_based (request_num <= 0): server 1 is busy with a long request. Server 0 syncs at once; server 1
  only after its request has finished, and that request ran on version 0 throughout (never paused).

After each sync `rollout.sync.verify` compares the server's probe logprobs with an HF forward of the
stored version's weights (1e-4): each server holds exactly the weights its registry version names.
"""

import asyncio
import os
import signal
import time

import pytest
import torch

pytestmark = pytest.mark.slow

PROBE = list(range(5, 29))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from megatron_dapo.models.tiny import save_tiny_hf_model
    from megatron_dapo.rollout.launcher import launch_embedded_servers

    root = tmp_path_factory.mktemp("sync_timing")
    model = save_tiny_hf_model("qwen3", root / "model", eos_token_id=2)
    servers = launch_embedded_servers(str(model), 2, root / "logs", timeout_s=240)
    try:
        yield {"model": model, "servers": servers, "urls": [s.url for s in servers]}
    finally:
        for s in servers:
            if s.alive():
                os.killpg(s.proc.pid, signal.SIGCONT)
            s.stop()


@torch.no_grad()
def _version(env, v: int):
    """Weights of version v (the HF model, perturbed by a seeded step per version) and their probe logprobs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(env["model"], torch_dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(v)
    for p in model.parameters():
        p.add_(0.02 * v * torch.randn(p.shape, generator=g))
    logits = model(torch.tensor([PROBE])).logits[0].double()
    lp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(PROBE[1:]).unsqueeze(1)).squeeze(1)
    return list(model.state_dict().items()), lp.tolist()


def _syncer(env, policy):
    from megatron_dapo.config.schema import SyncConfig
    from megatron_dapo.coordinator.servers import ServerRegistry
    from megatron_dapo.sync.per_server import PerServerSync, WeightStore

    cfg = SyncConfig(bucket_mb=1, verify=True, policy=policy, check_interval_ms=20)
    registry, store = ServerRegistry(env["urls"], version=-1), WeightStore()
    store.put(0, *_version(env, 0))
    syncer = PerServerSync(env["urls"], cfg, registry, store, probe=PROBE)
    syncer.connect()
    syncer.sync_all()
    assert [registry.version(u) for u in env["urls"]] == [0, 0]
    registry.take_events()
    syncer.start()
    return syncer, registry, store


def _wait(cond, timeout_s=60.0, what=""):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _events(registry):
    return {(e["server"], e["version"]): e for e in registry.take_events()}


def test_greedy_fast_server_takes_two_versions_while_the_slow_one_is_stuck(env):
    fast, slow = env["urls"]
    slow_pid = env["servers"][1].proc.pid
    syncer, registry, store = _syncer(env, "greedy")
    events = {}
    try:
        os.killpg(slow_pid, signal.SIGSTOP)
        try:
            store.put(1, *_version(env, 1))
            syncer.notify()
            _wait(lambda: registry.version(fast) == 1, what="the fast server at version 1")
            store.put(2, *_version(env, 2))  # the slow server still reads version 1: no wait for it
            syncer.notify()
            _wait(lambda: registry.version(fast) == 2, what="the fast server at version 2")
            # greedy started the slow server's sync at once; stopped, it cannot finish it
            assert registry.version(slow) == 0 and registry.statuses()[1].syncing
            events.update(_events(registry))
        finally:
            os.killpg(slow_pid, signal.SIGCONT)
        _wait(lambda: registry.version(slow) == 2, what="the resumed slow server at version 2")
        events.update(_events(registry))
    finally:
        syncer.close()
    assert syncer.error is None
    assert set(events) == {(0, 1), (0, 2), (1, 1), (1, 2)}  # every version, verified against the HF forward
    # the fast server finished both syncs before the slow one finished its first: never held back
    assert events[(0, 2)]["end"] < events[(1, 1)]["end"]
    assert events[(1, 1)]["start"] < events[(0, 2)]["start"]  # ... though the slow one began version 1 first
    assert events[(1, 2)]["start"] >= events[(1, 1)]["end"]


def test_status_based_syncs_the_idle_server_and_the_busy_one_after_its_request(env):
    from megatron_dapo.rollout.client import SGLangClient
    from megatron_dapo.rollout.types import SamplingParams

    fast, slow = env["urls"]
    syncer, registry, store = _syncer(env, "status_based")

    async def long_request():
        async with SGLangClient(slow) as client:
            task = asyncio.ensure_future(
                client.generate(
                    list(range(3, 12)), SamplingParams(n=4, max_new_tokens=300, temperature=1.0, sampling_seed=7)
                )
            )
            while (await client.get_loads()).running == 0:  # running before the new version exists
                await asyncio.sleep(0.01)
            await asyncio.to_thread(store.put, 1, *_version(env, 1))
            syncer.notify()
            samples = await task
            return samples, time.monotonic()

    try:
        samples, request_end = asyncio.run(long_request())
        _wait(lambda: registry.version(slow) == 1, what="the slow server at version 1 after its request")
        events = _events(registry)
    finally:
        syncer.close()
    assert syncer.error is None and set(events) == {(0, 1), (1, 1)}
    assert events[(0, 1)]["end"] < request_end  # the idle server took version 1 while the other was busy ...
    assert events[(1, 1)]["start"] > events[(0, 1)]["end"]  # ... which synced later, when idle
    # ... and its request was never paused or interrupted for it: every token from version 0
    assert max(len(s.output_ids) for s in samples) > 50
    for s in samples:
        assert s.finish_reason in ("stop", "length") and s.weight_version == "0"
        assert all(span.version == "0" for span in s.weight_versions)
