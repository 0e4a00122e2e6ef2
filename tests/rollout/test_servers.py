"""Embedded SGLang-compatible servers in subprocesses, driven over loopback HTTP by the client and router."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import torch

from megatron_dapo.coordinator.router import Router
from megatron_dapo.rollout import protocol
from megatron_dapo.rollout.client import SGLangClient, SGLangHTTPError
from megatron_dapo.rollout.launcher import embedded_server, launch_embedded_servers
from megatron_dapo.rollout.types import SamplingParams

pytestmark = pytest.mark.slow
KEY = "test-secret"
SENT: list[tuple[str, dict]] = []  # every body the client and router sent in this module


def _record(method: str, path: str, body: dict | None):
    if method in ("POST", "PUT"):
        SENT.append((path, json.loads(json.dumps(body)) if body is not None else {}))  # as it goes on the wire


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_dapo.models.tiny import save_tiny_hf_model

    return save_tiny_hf_model("qwen3", tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    procs = launch_embedded_servers(str(model_dir), 2, tmp_path_factory.mktemp("logs"), api_key=KEY, timeout_s=120)
    yield procs
    for p in procs:
        p.stop()


def _client(url, **kw):
    return SGLangClient(url, api_key=KEY, request_hook=_record, **kw)


def _reference_logprobs(model, prompt, output, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].double()
    lp = torch.log_softmax(logits / (temperature if temperature > 1e-6 else 1.0), -1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


def test_router_groups_are_sticky_and_logprobs_match_hf(servers, hf_model):
    prompts = {f"g{i}": [(7 * i + j) % 200 + 1 for j in range(3 + i % 4)] for i in range(6)}
    sp = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, max_new_tokens=10, n=4)

    async def go():
        async with Router([s.url for s in servers], api_key=KEY, client_kwargs={"request_hook": _record}) as r:
            return [g async for g in r.generate_groups(prompts, sp)]

    groups = asyncio.run(go())
    assert sorted(g[0].group_id for g in groups) == sorted(prompts)
    used = set()
    for g in groups:
        assert [s.index for s in g] == [0, 1, 2, 3]
        assert len({s.server for s in g}) == 1, "a group's samples must share one server"
        used.add(g[0].server)
        for s in g:
            assert s.prompt_ids == prompts[s.group_id] and len(s.output_ids) == len(s.logprobs) > 0
            assert s.finish_reason in ("stop", "length") and s.weight_version == "default"
            ref = _reference_logprobs(hf_model, s.prompt_ids, s.output_ids, 0.8)
            assert max(abs(a - b) for a, b in zip(s.logprobs, ref)) < 1e-4
    assert used == {s.url for s in servers}, "least-outstanding routing should use both servers"


def test_stop_token_ids_and_n_in_one_request(servers, hf_model):
    async def go():
        async with _client(servers[0].url) as c:
            greedy = (await c.generate([9, 8, 7], SamplingParams(temperature=0.0, max_new_tokens=8)))[0]
            stop = greedy.output_ids[3]
            stopped = (
                await c.generate([9, 8, 7], SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[stop]))
            )[0]
            many = await c.generate([9, 8, 7], SamplingParams(temperature=1.0, max_new_tokens=5, n=3))
            return greedy, stopped, many

    greedy, stopped, many = asyncio.run(go())
    hf = hf_model.generate(torch.tensor([[9, 8, 7]]), max_new_tokens=8, do_sample=False)[0, 3:].tolist()
    assert greedy.output_ids == hf and greedy.finish_reason == "length"
    cut = greedy.output_ids.index(greedy.output_ids[3]) + 1
    assert stopped.output_ids == greedy.output_ids[:cut] and stopped.finish_reason == "stop"
    assert stopped.matched_stop == greedy.output_ids[3]
    assert len(many) == 3 and all(len(s.output_ids) == 5 for s in many)


def test_batch_request_of_seeded_samples(servers, hf_model):
    """SGLang's batch form (input_ids and sampling_params as lists) with one sampling_seed per entry."""
    sps = [SamplingParams(temperature=1.0, max_new_tokens=6, sampling_seed=sd) for sd in (11, 12, 13, 11)]

    async def go():
        async with _client(servers[1].url) as c:
            return await c.generate([4, 5, 6], sps, rid="batch"), await c.generate([4, 5, 6], sps[0])

    batch, single = asyncio.run(go())
    assert [s.index for s in batch] == [0, 1, 2, 3] and [s.rid for s in batch] == [f"batch-{i}" for i in range(4)]
    assert batch[0].output_ids == batch[3].output_ids == single[0].output_ids  # same seed, same sample
    assert len({tuple(s.output_ids) for s in batch[:3]}) == 3
    for s in batch:
        ref = _reference_logprobs(hf_model, [4, 5, 6], s.output_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(s.logprobs, ref)) < 1e-4


def test_requests_after_the_servers_keep_alive_expired_do_not_fail(servers):
    """uvicorn (like SGLang) closes idle connections after 5 s; a client reusing one would fail its next request.
    The event loop is blocked across the server's close (as a busy rank 0 blocks it), so the client cannot
    have seen the close before it sends again."""

    async def go():
        async with _client(servers[0].url, retries=0) as c:
            first = await c.generate([3, 4, 5], SamplingParams(temperature=0.0, max_new_tokens=2))
            time.sleep(5.5)
            return first, await c.generate([3, 4, 5], SamplingParams(temperature=0.0, max_new_tokens=2))

    first, again = asyncio.run(go())
    assert first[0].output_ids == again[0].output_ids


def test_malformed_payloads_answer_400_naming_the_field(servers):
    url = servers[0].url
    h = {"Authorization": f"Bearer {KEY}"}
    cases = [
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"top_p": 2.0}}, "sampling_params.top_p"),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_tokens": 3}}, "sampling_params.max_tokens"),
        ("/generate", {"prompt_ids": [1]}, "prompt_ids"),
        ("/generate", {"input_ids": [1, 100000]}, "input_ids[1]"),
        ("/generate", {"input_ids": "abc"}, "input_ids"),
        ("/generate", {"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k"),
        ("/pause_generation", {"mode": "sideways"}, "mode"),
        (
            "/init_weights_update_group",
            {"master_address": "127.0.0.1", "rank_offset": 1, "world_size": 2},
            "master_port",
        ),
        ("/update_weights_from_distributed", {"dtypes": ["float32"], "shapes": [[1]]}, "names"),
        (
            "/update_weights_from_distributed",
            {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nope"},
            "group_name",
        ),
    ]
    with httpx.Client(trust_env=False, timeout=30) as http:
        assert http.post(url + "/begin_weight_update", json={}, headers=h).status_code == 200
        try:
            for path, body, field in cases:
                r = http.post(url + path, json=body, headers=h)
                assert r.status_code == 400, (path, body, r.text)
                assert field in r.text, (path, field, r.text)
        finally:
            assert http.post(url + "/end_weight_update", json={}, headers=h).status_code == 200
        r = http.post(url + "/generate", content=b"{not json", headers={**h, "Content-Type": "application/json"})
        assert r.status_code == 400

    async def via_client():
        async with _client(url) as c:
            with pytest.raises(SGLangHTTPError) as e:
                await c.generate([1, 10**6])
            return e.value

    err = asyncio.run(via_client())
    assert err.status == 400 and "/generate" in str(err) and "input_ids[1]" in str(err)


def test_without_the_key_every_endpoint_but_health_answers_401(servers):
    url = servers[0].url
    routes = [
        ("POST", "/generate", {"input_ids": [1]}),
        ("GET", "/get_model_info", None),
        ("POST", "/pause_generation", {}),
        ("POST", "/continue_generation", {}),
        ("POST", "/abort_request", {"abort_all": True}),
        ("POST", "/flush_cache", None),
        ("POST", "/init_weights_update_group", {}),
        ("POST", "/update_weights_from_distributed", {}),
        ("POST", "/update_weights_from_tensor", {}),
        ("POST", "/update_weight_version", {"new_version": "x"}),
        ("POST", "/release_memory_occupation", {}),
        ("POST", "/resume_memory_occupation", {}),
        ("POST", "/destroy_weights_update_group", {}),
    ]
    with httpx.Client(trust_env=False, timeout=30) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            for method, path, body in routes:
                r = http.request(method, url + path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers, r.status_code)
                assert r.json() == {"error": "Unauthorized"}
        assert http.get(url + "/health").status_code == 200  # open for probes, as in SGLang
        info = http.get(url + "/get_model_info", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert info["weight_version"] == "default" and info["model_type"] == "qwen3"


def test_pause_in_place_holds_requests_and_abort_by_rid(servers):
    long = SamplingParams(temperature=1.0, max_new_tokens=3000)

    async def go():
        async with _client(servers[1].url) as c:
            await c.pause_generation("in_place")
            held = asyncio.ensure_future(c.generate([1, 2, 3], SamplingParams(max_new_tokens=4)))
            await asyncio.sleep(0.5)
            assert not held.done(), "a request must wait while generation is paused"
            await c.continue_generation()
            (s_held,) = await held

            victim = asyncio.ensure_future(c.generate([4, 5], long, rid="victim-1"))
            await asyncio.sleep(0.4)
            await c.abort_request("victim-1")
            (s_abort,) = await asyncio.wait_for(victim, 30)

            victim2 = asyncio.ensure_future(c.generate([4, 6], long, rid="victim-2"))
            await asyncio.sleep(0.3)
            await c.pause_generation("abort")
            (s_pause_abort,) = await asyncio.wait_for(victim2, 30)
            await c.continue_generation()
            await c.flush_cache()
            await c.release_memory_occupation()
            await c.resume_memory_occupation()
            return s_held, s_abort, s_pause_abort

    s_held, s_abort, s_pause_abort = asyncio.run(go())
    assert len(s_held.output_ids) == 4 and s_held.finish_reason == "length"
    for s in (s_abort, s_pause_abort):
        assert s.finish_reason == "abort" and 0 <= len(s.output_ids) < 3000 and s.abort_message
        assert len(s.logprobs) == len(s.output_ids)


def _sglang_flattened_payload(named, monkeypatch):
    """Pickle a flattened bucket exactly as SGLang 0.5.23's senders do (srt/weight_sync/tensor_bucket.py),
    without SGLang: a dataclass with its fields, registered under its module and class name."""
    import dataclasses
    import sys
    import types

    from megatron_dapo.embedded_server.tensor_payload import forking_dumps

    mod = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")
    meta_cls = dataclasses.make_dataclass(
        "FlattenedTensorMetadata",
        [
            ("name", str),
            ("shape", torch.Size),
            ("dtype", torch.dtype),
            ("start_idx", int),
            ("end_idx", int),
            ("numel", int),
        ],
    )
    meta_cls.__module__ = mod.__name__
    mod.FlattenedTensorMetadata = meta_cls
    for name in ("sglang", "sglang.srt", "sglang.srt.weight_sync", mod.__name__):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    flats, metadata, start = [], [], 0
    for name, t in named:  # what FlattenedTensorBucket(named_tensors=...) computes
        flat = t.flatten().view(torch.uint8)
        metadata.append(meta_cls(name, t.shape, t.dtype, start, start + flat.numel(), flat.numel()))
        flats.append(flat)
        start += flat.numel()
    return forking_dumps({"flattened_tensor": torch.cat(flats), "metadata": metadata})


def test_update_weights_from_tensor_loads_sglang_payloads_and_refuses_code(model_dir, tmp_path, monkeypatch):
    import pickle

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megatron_dapo.embedded_server.tensor_payload import serialize_named_tensors
    from megatron_dapo.models.tiny import save_tiny_hf_model
    from megatron_dapo.rollout.launcher import start_servers

    new_dir = save_tiny_hf_model("qwen3", tmp_path / "new", seed=1)
    new = sorted(load_file(str(new_dir / "model.safetensors")).items())
    half = len(new) // 2
    probe = [(5 * i) % 200 + 1 for i in range(16)]
    want = _reference_logprobs(
        AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval(), probe[:1], probe[1:], 1.0
    )
    server = embedded_server(str(model_dir), tmp_path / "server.log", api_key=KEY)
    start_servers([server], timeout_s=120)
    try:

        async def go():
            async with _client(server.url) as c:  # its bodies are checked for conformance below too
                before = await c.prompt_logprobs(probe)
                with pytest.raises(SGLangHTTPError, match="must run between begin_weight_update"):
                    await c.update_weights_from_tensor([serialize_named_tensors(new[:half])], weight_version="t1")
                async with c.weight_update_session():
                    await c.update_weights_from_tensor([serialize_named_tensors(new[:half])], weight_version="t1")
                    await c.update_weights_from_tensor(
                        [_sglang_flattened_payload(new[half:], monkeypatch)],
                        load_format="flattened_bucket",
                        weight_version="t2",
                    )
                after = await c.prompt_logprobs(probe)
                version = (await c.get_model_info())["weight_version"]
                errors = []
                async with c.weight_update_session():
                    for bad in (
                        b"cbuiltins\nprint\n.",  # spelled out: an in-process Ray driver may have replaced print
                        b"cos\nsystem\n(S'true'\ntR.",
                        pickle.dumps([("model.norm.weight", torch.load)]),
                    ):
                        with pytest.raises(SGLangHTTPError) as e:
                            await c.update_weights_from_tensor([bad])
                        errors.append(str(e.value))
                    with pytest.raises(SGLangHTTPError, match="one TP rank, got 2"):
                        await c.update_weights_from_tensor([serialize_named_tensors(new[:1])] * 2)
                return before, after, version, errors, await c.prompt_logprobs(probe)

        before, after, version, errors, unchanged = asyncio.run(go())
    finally:
        server.stop()
    assert max(abs(a - b) for a, b in zip(before, want)) > 1e-2  # the update has something to change
    assert max(abs(a - b) for a, b in zip(after, want)) < 1e-4
    assert version == "t2" and unchanged == after  # refused payloads changed nothing
    assert "builtins.print is not allowed" in errors[0] and "os.system is not allowed" in errors[1]
    assert "torch.serialization.load is not allowed" in errors[2]


def test_killed_server_requests_complete_on_the_other_then_it_comes_back(servers, model_dir, tmp_path):
    survivor = servers[0]
    victim = embedded_server(str(model_dir), tmp_path / "victim.log", api_key=KEY).start(timeout_s=120)
    prompts = {f"k{i}": [i + 1, i + 2, i + 3] for i in range(12)}
    sp = SamplingParams(temperature=1.0, max_new_tokens=150, n=2)
    try:

        async def go():
            r = Router(
                [victim.url, survivor.url],
                api_key=KEY,
                health_interval_s=0.2,
                recover_after=2,
                client_kwargs={"request_hook": _record},
            )
            async with r:
                vstate = r.servers[0]
                gen = r.generate_groups(prompts, sp)
                first = asyncio.ensure_future(gen.__anext__())
                deadline = time.time() + 30
                while vstate.outstanding == 0 and time.time() < deadline:
                    await asyncio.sleep(0.01)
                assert vstate.outstanding > 0, "the victim never got work"
                await asyncio.sleep(0.2)
                victim.kill()  # mid-generation
                groups = [await first] + [g async for g in gen]
                assert not vstate.healthy
                victim.start(timeout_s=120)  # same port: health checks must bring it back
                deadline = time.time() + 30
                while not vstate.healthy and time.time() < deadline:
                    await asyncio.sleep(0.1)
                assert vstate.healthy, "a restarted server must be marked healthy again"
                return groups, vstate.stats["failovers_from"]

        groups, failovers = asyncio.run(go())
    finally:
        victim.stop()
    assert failovers > 0
    samples = [s for g in groups for s in g]
    assert len(samples) == 24 and sorted(g[0].group_id for g in groups) == sorted(prompts)
    assert sorted((s.group_id, s.index) for s in samples) == sorted((g, i) for g in prompts for i in range(2))
    assert all(s.finish_reason == "length" and len(s.output_ids) == 150 for s in samples)
    assert any(s.server == survivor.url for s in samples)


def test_a_new_update_group_replaces_one_whose_trainer_was_killed_mid_update(servers, hf_model):
    """A trainer SIGKILLed after announcing an update leaves the server with a group of the same name and a
    receive from a dead peer; the resumed trainer's /init_weights_update_group must replace that group
    (as SGLang does) and its updates must go through."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    from pathlib import Path

    from megatron_dapo.rollout import weight_group as wgroup
    from megatron_dapo.runtime.net import LOOPBACK, free_port

    url, group, name = servers[1].url, "resume_group", "model.norm.weight"
    weight = hf_model.state_dict()[name].detach().clone()  # the server's own values: nothing changes
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [
            sys.executable,
            str(root / "tests" / "workers" / "stale_group_trainer.py"),
            url,
            KEY,
            str(free_port()),
            group,
            name,
            json.dumps(list(weight.shape)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("announced"), line + proc.stdout.read()
        time.sleep(0.5)  # the server is receiving now
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    async def call(method, *args, **kw):
        async with _client(url, timeout_s=60) as c:
            return await getattr(c, method)(*args, **kw)

    def in_thread(out: dict, *args, **kw):
        t = threading.Thread(target=lambda: out.update(asyncio.run(call(*args, **kw))))
        t.start()
        return t

    port = free_port()
    answer, done = {}, {}
    t0 = time.time()
    joiner = in_thread(answer, "init_weights_update_group", LOOPBACK, port, 1, 2, group, "gloo")
    pg = wgroup.init_weight_update_group(LOOPBACK, port, 0, 2, group, "gloo", timeout_s=60)
    joiner.join(60)
    try:
        assert answer.get("success"), answer
        # the killed trainer left its weight-update session open: SGLang refuses a second begin until it ends
        with pytest.raises(SGLangHTTPError, match="already open"):
            asyncio.run(call("begin_weight_update"))
        assert asyncio.run(call("end_weight_update"))["success"]
        assert asyncio.run(call("begin_weight_update"))["success"]
        upd = in_thread(
            done,
            "update_weights_from_distributed",
            [name],
            ["float32"],
            [list(weight.shape)],
            group,
            weight_version="resumed",
        )
        wgroup.broadcast(weight, pg)
        upd.join(60)
        assert done.get("success"), done
        assert asyncio.run(call("end_weight_update"))["success"]
        assert time.time() - t0 < 30, "the stale group held the new one up"
        (s,) = asyncio.run(call("generate", [9, 8, 7], SamplingParams(temperature=0.0, max_new_tokens=4)))
        assert s.weight_version == "resumed"
        hf = hf_model.generate(torch.tensor([[9, 8, 7]]), max_new_tokens=4, do_sample=False)[0, 3:].tolist()
        assert s.output_ids == hf
        assert asyncio.run(call("update_weight_version", "default"))["success"]
    finally:
        asyncio.run(call("destroy_weights_update_group", group))
        wgroup.destroy_weight_update_group(pg)


def test_zz_every_request_sent_in_this_module_conforms_to_sglang():
    snap = protocol.load_snapshot()
    assert len(SENT) > 50
    seen = set()
    for path, body in SENT:
        if path in protocol.ROUTE_CLASSES:
            seen.add(path)
            assert protocol.check_request(snap, path, body) == [], (path, body)
    assert {
        "/generate",
        "/pause_generation",
        "/continue_generation",
        "/abort_request",
        "/release_memory_occupation",
        "/resume_memory_occupation",
    } <= seen
