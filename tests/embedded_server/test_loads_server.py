"""A real embedded server (its own process, 127.0.0.1): the load poller keeps its /v1/loads in the
registry while it generates, and `megatron-dapo profile-engine` measures it and writes a cost model
that loads back."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from megatron_dapo.cli import main as cli_main
from megatron_dapo.config.cost_model import CostModel
from megatron_dapo.coordinator.load_poller import LoadPoller
from megatron_dapo.coordinator.profile import ProfilePoint, relative_error
from megatron_dapo.coordinator.servers import ServerRegistry
from megatron_dapo.rollout import payloads
from megatron_dapo.runtime.net import LOOPBACK, free_port

pytestmark = pytest.mark.slow
KEY = "loads-key"
MAX_BATCH = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from megatron_dapo.models.tiny import save_tiny_hf_model
    from megatron_dapo.rollout.launcher import launch_embedded

    tmp = tmp_path_factory.mktemp("loads")
    model = save_tiny_hf_model("qwen3", tmp / "model")
    srv = launch_embedded(
        str(model),
        tmp / "server.log",
        api_key=KEY,
        timeout_s=120,
        extra_args=["--max-batch", str(MAX_BATCH), "--step-trace", str(tmp / "trace.jsonl")],
    )
    srv.context = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    srv.trace = tmp / "trace.jsonl"
    yield srv
    srv.stop()


def _generate_in_background(server, prompts, new_tokens) -> threading.Thread:
    def run():
        with httpx.Client(trust_env=False, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as http:
            http.post(server.url + "/generate", json=payloads.fixed_length_body(prompts, new_tokens)).raise_for_status()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _wait_for(predicate, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_poller_keeps_each_servers_load_in_the_registry(server):
    dead = f"http://{LOOPBACK}:{free_port()}"  # nothing listens there
    registry = ServerRegistry([server.url, dead])
    record = lambda: registry.records_snapshot()[0]  # noqa: E731
    prompts = [[5] * 20, [6] * 30, [7] * 10]
    with LoadPoller(registry, interval_s=0.02, api_key=KEY) as poller:
        _wait_for(lambda: record().load_time is not None, "a first report")
        assert record().kv_capacity == MAX_BATCH * server.context
        generating = _generate_in_background(server, prompts, new_tokens=80)
        _wait_for(lambda: record().running == 3, "the running batch in a report")
        busy = record()
        # every running sequence holds its prompt and the tokens made so far
        assert sum(map(len, prompts)) <= busy.kv_tokens <= sum(map(len, prompts)) + 3 * 80
        generating.join()
        _wait_for(lambda: record().running == 0, "the idle server in a report")
        assert record().throughput > 0 and record().kv_tokens == 0
    assert not poller._thread.is_alive() and min(poller.polls.values()) > 0
    unreachable = registry.records_snapshot()[1]
    assert unreachable.load_time is None and "cannot connect" in unreachable.load_error


def test_profile_engine_measures_the_server_and_writes_a_cost_model(server, tmp_path, capsys):
    out = tmp_path / "cost.json"
    rc = cli_main(
        [
            "profile-engine",
            "--server",
            server.url,
            "--api-key",
            KEY,
            "--out",
            str(out),
            "--batch-sizes",
            "1,3",
            "--prompt-lens",
            "8,40",
            "--new-tokens",
            "6",
            # the fit's quality is the machine's load, not this test's subject (a fit refused for its error:
            # tests/apps/test_profile_engine.py); at load ~130 one point measured 10x its neighbour
            "--max-fit-error",
            "1000",
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "fit relative error (rms):" in printed and "measured ms" in printed
    model = CostModel.load(out)
    saved = json.loads(out.read_text())
    points = [ProfilePoint(**p) for p in saved["points"]]
    # the server's own decode counters: exactly the 5 decode steps of each batch, at its full size
    assert sorted((p.n, p.steps) for p in points) == [(1.0, 5), (1.0, 5), (3.0, 5), (3.0, 5)]
    assert all(p.step_s > 0 for p in points)
    assert saved["fit_rel_error"] == pytest.approx(relative_error(model, points))
    assert f"{saved['fit_rel_error']:.2%}" in printed


def test_profile_engine_refuses_a_busy_server(server, tmp_path, capsys):
    generating = _generate_in_background(server, [[5] * 8], new_tokens=400)
    try:
        _wait_for(lambda: _running(server) > 0, "the generation to start")
        rc = cli_main(
            [
                "profile-engine",
                "--server",
                server.url,
                "--api-key",
                KEY,
                "--out",
                str(tmp_path / "c.json"),
                "--batch-sizes",
                "1,2",
                "--prompt-lens",
                "4,8",
                "--new-tokens",
                "2",
            ]
        )
        assert rc == 1 and "busy" in capsys.readouterr().err
        assert not (tmp_path / "c.json").exists()
    finally:
        with httpx.Client(trust_env=False, timeout=30, headers={"Authorization": f"Bearer {KEY}"}) as http:
            http.post(server.url + "/abort_request", json={"abort_all": True})
        generating.join()


def _running(server) -> int:
    with httpx.Client(trust_env=False, timeout=30, headers={"Authorization": f"Bearer {KEY}"}) as http:
        return http.get(server.url + "/v1/loads").json()["loads"][0]["num_running_reqs"]


def test_a_server_without_decode_counters_is_timed_from_outside(server):
    """SGLang before 0.5.23 reports no decode_moments: the step time then comes from wall times (a run
    minus the same batch making one token), and agrees with the server's own counters."""
    import asyncio
    import dataclasses
    import random

    from megatron_dapo.apps.profile_engine import measure_point
    from megatron_dapo.rollout.client import SGLangClient

    class WithoutCounters(SGLangClient):
        async def get_loads(self):
            return dataclasses.replace(await super().get_loads(), decode_moments=None)

    async def measure(client_cls):
        async with client_cls(server.url, api_key=KEY) as client:
            return await measure_point(client, 2, 16, 20, random.Random(0), 200)

    counted, timed = asyncio.run(measure(SGLangClient)), asyncio.run(measure(WithoutCounters))
    assert (counted.n, counted.steps) == (2.0, 19) and (timed.n, timed.steps) == (2.0, 19)
    assert timed.kv_tokens == counted.kv_tokens == 2 * (16 + 10)
    assert 0.25 < timed.step_s / counted.step_s < 4, (timed, counted)


def test_step_trace_holds_every_decode_step_the_server_counted(server):
    """`serve --step-trace`: after whatever the other tests ran, one line per decode step, agreeing with the
    server's own decode counters on /v1/loads (steps, batch sizes, microseconds)."""
    with httpx.Client(trust_env=False, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as http:
        http.post(server.url + "/generate", json=payloads.fixed_length_body([[5] * 12, [6] * 30], 9)).raise_for_status()
        moments = http.get(server.url + "/v1/loads").json()["loads"][0]["decode_moments"]
    rows = [json.loads(line) for line in server.trace.read_text().splitlines()]
    decode = [r for r in rows if r["kind"] == "decode"]
    assert moments[0] == len(decode) and moments[1] == sum(r["n"] for r in decode)
    assert moments[2] == pytest.approx(sum(r["s"] for r in decode) * 1e6, abs=len(decode))
    # the last batch: two prompts (12 and 30 tokens), 8 decode steps after the prefill's token
    assert [r["kv"] for r in decode[-8:]] == [12 + 30 + 2 * k for k in range(1, 9)]
