"""Weight sync from a trainer process into embedded servers over a real gloo group on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_dapo.coordinator.router import Router
from megatron_dapo.rollout.client import SGLangClient
from megatron_dapo.rollout.launcher import embedded_server, start_servers
from megatron_dapo.rollout.types import SamplingParams

pytestmark = pytest.mark.slow
KEY = "sync-secret"
ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "workers" / "sync_hf_trainer.py"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from megatron_dapo.models.tiny import save_tiny_hf_model

    d = tmp_path_factory.mktemp("ckpt")
    return {
        name: save_tiny_hf_model(fam, d / name, seed=seed)
        for name, fam, seed in [
            ("q3_a", "qwen3", 0),
            ("q3_b", "qwen3", 1),
            ("q3_c", "qwen3", 2),
            ("moe_a", "qwen3_moe", 0),
            ("moe_b", "qwen3_moe", 1),
        ]
    }


@pytest.fixture(scope="module")
def servers(ckpts, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    procs = {
        "q3": [embedded_server(str(ckpts["q3_a"]), logs / f"q3_{i}.log", api_key=KEY, seed=i) for i in range(2)],
        "moe": [embedded_server(str(ckpts["moe_a"]), logs / "moe.log", api_key=KEY)],
    }
    allp = [p for ps in procs.values() for p in ps]
    try:
        start_servers(allp, timeout_s=180)
        yield procs
    finally:
        for p in allp:
            p.stop()


def _worker(out, ckpt, urls, *extra, wait=True):
    cmd = [sys.executable, str(WORKER), str(out), str(ckpt), *urls, "--api-key", KEY, *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if not wait:
        return proc
    return _finish(proc, out)


def _finish(proc, out, timeout=180):
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        log, _ = proc.communicate()
        raise AssertionError(f"sync worker timed out\n{log[-4000:]}") from None
    assert proc.returncode == 0, log[-4000:]
    return json.loads(Path(out).read_text())


async def _logprobs_and_version(url, probe):
    async with SGLangClient(url, api_key=KEY) as c:
        return await c.prompt_logprobs(probe), (await c.get_model_info())["weight_version"]


def _max_diff(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.parametrize("mode", ["per_tensor", "flattened"])
def test_sync_makes_servers_match_the_trainer(servers, ckpts, tmp_path, mode):
    urls = [s.url for s in servers["q3"]]
    target = ckpts["q3_b"] if mode == "per_tensor" else ckpts["q3_c"]
    # flattened: the first sync re-homes the servers' parameters into their receive buffers, the second
    # (other weights, same bucket layout) is received straight into them
    extra = (
        ["--versions", "1,2"]
        if mode == "per_tensor"
        else ["--first-ckpt", str(ckpts["q3_b"]), "--versions", "3", "--flatten", "--bucket-mb", "0.2"]
    )
    if mode == "per_tensor":
        # a trainer that died mid-sync left server 0's weight-update session open: the bridge closes it
        async def leave_open():
            async with SGLangClient(urls[0], api_key=KEY) as c:
                await c.begin_weight_update()

        asyncio.run(leave_open())
    res = _worker(tmp_path / "out.json", target, urls, "--bad-name-first", *extra)
    # an update naming a tensor the servers lack fails with its name, and leaves the group usable
    assert "model.layers.0.mlp.bogus_proj.weight" in res["bad_name_error"]
    assert res["max_diff"] < 1e-4
    for st in res["stats"]:
        assert st["tensors"] == 47 and st["buckets"] > 1
    for url in urls:
        lps, version = asyncio.run(_logprobs_and_version(url, res["probe"]))
        assert _max_diff(lps, res["trainer"]) < 1e-4
        assert version == res["stats"][-1]["version"]
    # the check is not vacuous: the servers' original weights give visibly different logprobs
    import torch
    from transformers import AutoModelForCausalLM

    orig = AutoModelForCausalLM.from_pretrained(ckpts["q3_a"], dtype=torch.float32)
    with torch.no_grad():
        lp = torch.log_softmax(orig(torch.tensor([res["probe"]])).logits[0, :-1].double(), -1)
    before = lp.gather(-1, torch.tensor(res["probe"][1:]).unsqueeze(-1)).squeeze(-1).tolist()
    assert _max_diff(before, res["trainer"]) > 1e-2


def test_sync_into_moe_server_maps_per_expert_names(servers, ckpts, tmp_path):
    res = _worker(tmp_path / "out.json", ckpts["moe_b"], [servers["moe"][0].url], "--flatten", "--bucket-mb", "0.1")
    assert res["max_diff"] < 1e-4 and res["stats"][0]["tensors"] == 77


def _generate_in_background(urls, prompts, sp):
    """Run router.generate_groups on its own loop thread; returns (thread, result dict, router holder)."""
    result, holder = {}, {}

    def run():
        async def go():
            async with Router(urls, api_key=KEY) as r:
                holder["router"] = r
                result["groups"] = [g async for g in r.generate_groups(prompts, sp)]

        try:
            asyncio.run(go())
        except BaseException as e:  # surfaced by the test
            result["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, result, holder


@pytest.mark.parametrize("pause", [True, False])
def test_sync_with_requests_in_flight_loses_and_duplicates_nothing(servers, ckpts, tmp_path, pause):
    urls = [s.url for s in servers["q3"]]
    version = "10" if pause else "11"
    ready, go = tmp_path / "ready", tmp_path / "go"
    extra = ["--versions", version, "--ready-file", str(ready), "--go-file", str(go)]
    proc = _worker(tmp_path / "out.json", ckpts["q3_b"], urls, *extra, *([] if pause else ["--no-pause"]), wait=False)
    deadline = time.time() + 60
    while not ready.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert ready.exists(), proc.communicate()[0][-3000:] if proc.poll() is not None else "worker not ready"
    before = asyncio.run(_logprobs_and_version(urls[0], [1, 2, 3]))[1]

    prompts = {f"f{i}": [i + 3, i + 4] for i in range(8)}
    sp = SamplingParams(temperature=1.0, max_new_tokens=400, n=3)
    th, result, holder = _generate_in_background(urls, prompts, sp)
    deadline = time.time() + 30
    while time.time() < deadline and sum(s.outstanding for s in getattr(holder.get("router"), "servers", [])) < 20:
        time.sleep(0.01)
    time.sleep(0.3)
    go.touch()  # sync while the 24 requests are generating
    res = _finish(proc, tmp_path / "out.json")
    th.join(120)
    assert not th.is_alive() and "error" not in result, result.get("error")
    assert res["max_diff"] < 1e-4
    samples = [s for g in result["groups"] for s in g]
    assert sorted((s.group_id, s.index) for s in samples) == sorted((g, i) for g in prompts for i in range(3))
    assert len({s.rid for s in samples}) == len(samples) == 24
    assert all(s.finish_reason == "length" and len(s.output_ids) == 400 for s in samples)
    for s in samples:
        assert s.versions[-1] in (before, version) and set(s.versions) <= {before, version}
    if pause:
        # paused in place: requests that were running carry both versions, split where the weights changed
        mixed = [s for s in samples if s.versions == [before, version]]
        assert mixed, "no request straddled the sync"
        for s in mixed:
            (a, b) = s.weight_versions
            assert a.start == 0 and a.end == b.start and b.end == 400
    else:
        # unpaused: the server let in-flight requests finish before loading, so none is mixed
        assert all(len(s.versions) == 1 for s in samples)
        assert sum(s.versions == [before] for s in samples) >= 20  # those in flight finished on the old weights


def test_megatron_tp2_trainer_sync_matches_megatron_logprobs(servers, ckpts, tmp_path):
    pytest.importorskip("megatron_dapo.bridge.export")
    pytest.importorskip("megatron_dapo.models.provider")
    from tests.dist_utils import run_torchrun

    urls = [s.url for s in servers["q3"]]
    out = tmp_path / "meg.json"
    run_torchrun("sync_megatron_trainer.py", 2, str(out), str(ckpts["q3_b"]), KEY, *urls, timeout=240)
    rounds = json.loads(out.read_text())["rounds"]
    assert [r["version"] for r in rounds] == ["1", "2"]
    for r in rounds:
        assert r["max_diff"] < 1e-4 and r["tensors"] == 47
        assert r["server_versions"] == [r["version"]] * len(urls)
    for url in urls:
        assert asyncio.run(_logprobs_and_version(url, [1, 2]))[1] == "2"
