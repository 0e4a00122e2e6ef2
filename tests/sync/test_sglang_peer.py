"""SGLang 0.5.23's own code judges the bridge, the client's payloads and the embedded server's gate.

The peer (tests/sglang_peer.py) runs SGLang's HTTP app, tokenizer-manager control path, scheduler
weight-update manager and model-runner receive code; only the model (it records what it loads) and
generation are replaced.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from safetensors.torch import load

from megatron_dapo.config.schema import SyncConfig
from megatron_dapo.embedded_server.tensor_payload import serialize_named_tensors
from megatron_dapo.rollout import payloads
from megatron_dapo.rollout.client import SGLangClient, SGLangHTTPError
from megatron_dapo.rollout.types import SamplingParams
from megatron_dapo.sync import session as session_mod
from megatron_dapo.sync.broadcast import BroadcastTransport
from megatron_dapo.sync.errors import WeightSyncError
from tests.conftest import SGLANG_PEER_KEY as KEY

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """An embedded server with the peer's api key, to hold against SGLang's answers."""
    from megatron_dapo.models.tiny import save_tiny_hf_model
    from megatron_dapo.rollout.launcher import launch_embedded

    tmp = tmp_path_factory.mktemp("embedded")
    server = launch_embedded(
        str(save_tiny_hf_model("qwen3", tmp / "model")), tmp / "server.log", api_key=KEY, timeout_s=120
    )
    server.model_dir = tmp / "model"
    yield server
    server.stop()


def _weights() -> list[tuple[str, torch.Tensor]]:
    """Mixed bf16 / fp32 tensors of odd sizes (flattened offsets must respect each dtype's alignment)."""
    g = torch.Generator().manual_seed(0)
    shapes = [
        ("model.embed_tokens.weight", (97, 24), torch.bfloat16),
        ("model.layers.0.self_attn.q_proj.weight", (24, 24), torch.float32),
        ("model.layers.0.input_layernorm.weight", (24,), torch.bfloat16),
        ("model.layers.0.mlp.up_proj.weight", (33, 24), torch.float32),
        ("model.layers.0.mlp.down_proj.weight", (24, 33), torch.bfloat16),
        ("model.norm.weight", (7,), torch.float32),
        ("lm_head.weight", (97, 24), torch.float32),
    ]
    return [(n, torch.randn(s, generator=g).to(dt)) for n, s, dt in shapes]


def _http(peer) -> httpx.Client:
    return httpx.Client(base_url=peer.url, headers={"Authorization": f"Bearer {KEY}"}, trust_env=False, timeout=60)


def _sync_into_peer(peer, flatten: bool, pause: str | None, version: str, bucket_mb: float = 0.004):
    cfg = SyncConfig(
        bucket_mb=bucket_mb, flatten_bucket=flatten, pause_generation=pause is not None, pause_mode=pause or "in_place"
    )
    bridge = BroadcastTransport([peer.url], cfg, api_key=KEY, group_name=f"peer_{version}", backend="gloo")
    bridge.connect()
    try:
        return bridge.sync(_weights(), version=version)
    finally:
        bridge.close()


@pytest.mark.parametrize(
    "flatten,pause,running",
    [(False, "in_place", 1), (True, "in_place", 1), (True, "retract", 1), (False, "abort", 1), (True, None, 0)],
)
def test_bridge_syncs_every_tensor_exactly_into_sglang(sglang_peer, flatten, pause, running):
    """Sessions opened and closed, several buckets, per-tensor and flattened, each pause mode: SGLang's
    receive code gets every tensor with its dtype, shape and bits, and reports the new version. With no
    pause SGLang drains running requests before it loads, so the peer starts idle then."""
    version = f"v-{int(flatten)}-{pause}"
    with _http(sglang_peer) as http:
        http.post("/peer/reset", params={"running": running}).raise_for_status()
        stats = _sync_into_peer(sglang_peer, flatten, pause, version)
        state = http.get("/peer/state").json()
        got = load(http.get("/peer/received").content)
        info = http.get("/get_model_info").json()
    want = _weights()
    assert stats.num_buckets >= 3 and stats.num_tensors == len(want)
    assert state["names"] == [n for n, _ in want]  # each once, in the order sent
    for name, t in want:
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t), name
    assert info["weight_version"] == version == state["weight_version"]
    assert not state["session_open"]
    # in_place keeps the running request (and no flush is asked for); retract re-queues it; abort ends it
    expect = {"in_place": (1, 0, 0), "retract": (0, 1, 1), "abort": (0, 0, 1), None: (0, 0, 1)}[pause]
    assert (state["running"], state["waiting"], state["flushes"]) == expect


@pytest.mark.parametrize("flatten", [False, True])
def test_two_sources_sync_every_tensor_exactly_into_sglang(sglang_peer, flatten):
    """rollout.sync.sources=per_stage against SGLang's own code: two trainer ranks (torchrun) each
    broadcast their part over their own update group, which SGLang holds side by side; one session,
    every tensor once with its bits, the version and the cache flush once, after the second source."""
    from tests.dist_utils import run_torchrun

    version = f"two-sources-{int(flatten)}"
    with _http(sglang_peer) as http:
        http.post("/peer/reset", params={"running": 1}).raise_for_status()
        args = [sglang_peer.url, KEY, version, "4", *(["--flatten"] if flatten else [])]
        out = run_torchrun("sync_two_sources_peer.py", 2, *args, timeout=180)
        state = http.get("/peer/state").json()
        got = load(http.get("/peer/received").content)
    want = _weights()
    assert "two-source sync done" in out
    assert state["names"] == [n for n, _ in want]  # each once: rank 0's part, then rank 1's
    for name, t in want:
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert state["weight_version"] == version and not state["session_open"]
    assert (state["running"], state["waiting"], state["flushes"]) == (0, 1, 1)  # retract: one flush, at the end


def test_bridge_closes_a_session_a_dead_trainer_left_open(sglang_peer):
    """SGLang refuses a second begin while a session is open (as a trainer killed mid-sync leaves it):
    the bridge ends that session and opens its own."""
    with _http(sglang_peer) as http:
        http.post("/peer/reset", params={"running": 0}).raise_for_status()
        assert http.post("/begin_weight_update", json=payloads.begin_update_body()).json()["success"]
        stats = _sync_into_peer(sglang_peer, False, "retract", "after-a-dead-trainer", bucket_mb=64)
        state = http.get("/peer/state").json()
    assert stats.num_tensors == len(_weights()) and state["weight_version"] == "after-a-dead-trainer"
    assert not state["session_open"]


def test_flush_after_an_in_place_pause_fails_alike_in_sglang_and_the_embedded_server(
    sglang_peer, embedded, monkeypatch
):
    """The old bridge (flush_cache on the last bucket after an in_place pause) fails in SGLang with its own
    message, and the embedded server says the same; the bridge's error names the server and the tensor."""
    monkeypatch.setattr(session_mod, "flushes_cache", lambda pause_generation, pause_mode: True)
    with _http(sglang_peer) as http:
        http.post("/peer/reset", params={"running": 1}).raise_for_status()
        with pytest.raises(WeightSyncError) as e:
            _sync_into_peer(sglang_peer, False, "in_place", "flush-in-place", bucket_mb=64)
        state = http.get("/peer/state").json()
    msg = str(e.value)
    assert "the cache was not flushed because requests are still running or queued" in msg
    assert sglang_peer.url in msg and "'model.embed_tokens.weight'" in msg
    assert not state["session_open"], "the bridge must end the session after a failed bucket"
    assert state["weight_version"] == "flush-in-place"  # SGLang loaded the weights, then failed the call

    # the embedded server, with a request really running when paused in place
    from safetensors.torch import load_file

    new = sorted(load_file(str(embedded.model_dir / "model.safetensors")).items())[:2]  # its own values

    async def go():
        async with SGLangClient(embedded.url, api_key=KEY) as c:
            long = asyncio.ensure_future(
                c._post(
                    "/generate",
                    {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}},
                )
            )
            await asyncio.sleep(0.3)
            await c.pause_generation("in_place")
            assert not long.done(), "the request must still be running when paused"
            async with c.weight_update_session():
                with pytest.raises(SGLangHTTPError) as refused:
                    await c.update_weights_from_tensor([serialize_named_tensors(new)], flush_cache=True)
                kept = await c.update_weights_from_tensor([serialize_named_tensors(new)], flush_cache=False)
            with pytest.raises(SGLangHTTPError) as busy:
                await c.flush_cache()
            await c.continue_generation()
            await long
            await c.flush_cache()  # idle again: flushes
            return refused.value, kept, busy.value

    refused, kept, busy = asyncio.run(go())
    assert refused.status == 400 and refused.server_message in msg
    assert kept["success"] and busy.status == 400


def test_update_session_gate_answers_as_sglang_does(sglang_peer, embedded):
    """Update outside a session, begin twice, end without begin: status and body equal SGLang's."""
    steps = [
        ("/update_weights_from_distributed", payloads.update_distributed_body(["x"], ["float32"], [[1]])),
        ("/update_weights_from_tensor", payloads.update_tensor_body([serialize_named_tensors([])])),
        ("/end_weight_update", payloads.end_update_body()),
        ("/begin_weight_update", payloads.begin_update_body()),
        ("/begin_weight_update", payloads.begin_update_body()),
        ("/end_weight_update", payloads.end_update_body()),
    ]
    answers = {}
    for name, url in (("sglang", sglang_peer.url), ("embedded", embedded.url)):
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {KEY}"}, trust_env=False, timeout=60
        ) as http:
            answers[name] = [(r.status_code, r.json()) for r in (http.post(p, json=b) for p, b in steps)]
    assert answers["embedded"] == answers["sglang"]
    assert [s for s, _ in answers["sglang"]] == [400, 400, 400, 200, 400, 200]


def test_api_key_behaviour_agrees_route_by_route(sglang_peer, embedded):
    routes = [
        ("GET", "/health"),
        ("GET", "/health_generate"),
        ("GET", "/get_model_info"),
        ("GET", "/model_info"),
        ("POST", "/generate"),
        ("POST", "/flush_cache"),
        ("GET", "/flush_cache"),
        ("POST", "/abort_request"),
        ("POST", "/pause_generation"),
        ("POST", "/continue_generation"),
        ("POST", "/init_weights_update_group"),
        ("POST", "/destroy_weights_update_group"),
        ("POST", "/begin_weight_update"),
        ("POST", "/end_weight_update"),
        ("POST", "/update_weights_from_distributed"),
        ("POST", "/update_weights_from_tensor"),
        ("POST", "/update_weight_version"),
        ("POST", "/release_memory_occupation"),
        ("POST", "/resume_memory_occupation"),
    ]
    headers = {"none": {}, "wrong": {"Authorization": "Bearer nope"}, "scheme": {"Authorization": f"Basic {KEY}"}}
    table = {}
    for name, url in (("sglang", sglang_peer.url), ("embedded", embedded.url)):
        with httpx.Client(base_url=url, trust_env=False, timeout=60) as http:
            for method, path in routes:
                for h, hdr in headers.items():
                    # refused (401), or let through to the route, whatever it then answers: the peer's
                    # /health* ask a scheduler it does not run, and fail
                    try:
                        r = http.request(
                            method, path, headers={**hdr, "Connection": "close"}, json={} if method == "POST" else None
                        )
                        refused = r.status_code == 401
                    except httpx.TransportError:
                        refused = False
                    table.setdefault((method, path, h), {})[name] = refused
    differ = {k: v for k, v in table.items() if v["sglang"] != v["embedded"]}
    assert not differ, differ
    assert table[("GET", "/health", "none")] == {"sglang": False, "embedded": False}
    assert table[("POST", "/begin_weight_update", "wrong")] == {"sglang": True, "embedded": True}


def test_every_generate_payload_means_the_same_to_sglang(sglang_peer):
    """The client's /generate bodies, built by payloads.generate_body, through SGLang's own
    GenerateReqInput.normalize_batch_and_arguments and SamplingParams.normalize/verify."""
    one = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=16, stop_token_ids=[5, 7])
    bodies = [
        payloads.generate_body([1, 2, 3], one, rid="r1"),
        payloads.generate_body([1, 2, 3], SamplingParams(n=4, temperature=1.0, max_new_tokens=8, sampling_seed=11)),
        payloads.generate_body([4, 5], [SamplingParams(max_new_tokens=8, sampling_seed=s) for s in (1, 2, 3)], rid="g"),
        payloads.generate_body(
            [1, 2, 3, 4], SamplingParams(temperature=1.0, max_new_tokens=0), rid="p", logprob_start_len=0
        ),
        payloads.generate_body([9], SamplingParams(temperature=0.0, max_new_tokens=2), return_logprob=False),
        payloads.fixed_length_body([[1, 2], [3, 4, 5]], 6),
    ]
    with _http(sglang_peer) as http:
        parsed = http.post("/peer/parse", json=bodies).raise_for_status().json()
    assert all(p["ok"] for p in parsed), parsed
    single, group, batch, prompt, greedy, fixed = parsed
    assert single["is_single"] and single["rid"] == "r1" and single["return_logprob"] is True
    assert single["sampling"] == [
        {
            "n": 1,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "max_new_tokens": 16,
            "sampling_seed": None,
            "stop_token_ids": [5, 7],
        }
    ]
    # n=4 in one request: SGLang expands it to a batch of 4 copies of the prompt, sharing the seed
    assert group["batch_size"] == 1 and group["sampling"][0]["n"] == 4 and group["sampling"][0]["sampling_seed"] == 11
    assert not batch["is_single"] and batch["batch_size"] == 3 and batch["rid"] == ["g-0", "g-1", "g-2"]
    assert [s["sampling_seed"] for s in batch["sampling"]] == [1, 2, 3] and batch["input_ids"] == [[4, 5]] * 3
    assert prompt["logprob_start_len"] == 0 and prompt["sampling"][0]["max_new_tokens"] == 0
    assert greedy["return_logprob"] is False and greedy["sampling"][0]["top_k"] == 1  # SGLang's greedy form
    assert fixed["batch_size"] == 2 and fixed["input_ids"] == [[1, 2], [3, 4, 5]]
    assert [s["max_new_tokens"] for s in fixed["sampling"]] == [6, 6]


DRIFTING = ("timestamp", "gen_throughput")  # move between two reads of an idle server


def _steady(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in DRIFTING} for row in rows]


def _prometheus_samples(text: str) -> list[tuple[str, str]]:
    """(metric line name, value) pairs, drifting fields' values blanked."""
    out = []
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        out.append((name, "" if any(f"sglang_{f}{{" in line for f in DRIFTING) else value))
    return out


@pytest.mark.parametrize("include", [None, "core", "all", "memory,queues", "disagg", "spec,lora"])
def test_embedded_load_report_is_what_sglang_serves_for_it(sglang_peer, embedded, include):
    """The embedded server's /v1/loads row, published in the SGLang peer as a scheduler publishes its load
    (SGLang's LoadSnapshot, its msgpack encoder, its shared-memory slot, its typed decoder), is served back by
    SGLang's own /v1/loads route unchanged, for every include= selection and in Prometheus format; SGLang's
    answer parses in our client to the same load."""
    params = {"include": include} if include else {}
    with _http(embedded) as ours, _http(sglang_peer) as peer:
        # work first, so the counters (decode moments, prefill totals, throughput) have all moved
        before = ours.get("/v1/loads").json()["loads"][0]["total_prefill_uncached_tokens"]
        ours.post(
            "/generate",
            json={
                "input_ids": [[5, 6, 7, 8], [9, 10, 11]],
                "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
            },
        ).raise_for_status()
        full = ours.get("/v1/loads").json()
        answer = ours.get("/v1/loads", params=params).json()
        assert full["loads"][0]["decode_moments"] and full["loads"][0]["total_prefill_uncached_tokens"] == before + 7

        r = peer.post("/peer/load", json=answer["loads"][0])
        assert r.status_code == 200, r.text
        theirs = peer.get("/v1/loads", params=params).json()
        assert theirs["loads"] == answer["loads"]  # SGLang's to_dict of our row reproduces it exactly
        assert list(theirs) == list(answer)
        assert {k: type(v) for k, v in theirs.items()} == {k: type(v) for k, v in answer.items()}
        assert _prometheus_samples(
            peer.get("/v1/loads", params={**params, "format": "prometheus"}).text
        ) == _prometheus_samples(ours.get("/v1/loads", params={**params, "format": "prometheus"}).text)

        # the full row, selected by SGLang, is what our server selects
        peer.post("/peer/load", json=full["loads"][0]).raise_for_status()
        assert _steady(peer.get("/v1/loads", params=params).json()["loads"]) == _steady(answer["loads"])

        async def client_loads():
            async with SGLangClient(sglang_peer.url, api_key=KEY) as c:
                return await c.get_loads()

        assert asyncio.run(client_loads()) == payloads.parse_loads(peer.get("/v1/loads").json())
        assert payloads.parse_loads(full).kv_capacity == full["loads"][0]["max_total_num_tokens"] > 0


def test_sglang_refuses_a_malformed_load_row(sglang_peer):
    """The check above can fail: SGLang's classes refuse a row with a wrong type or an unknown field."""
    with _http(sglang_peer) as peer:
        assert peer.post("/peer/load", json={"num_running_reqs": 1.5}).status_code == 400
        assert peer.post("/peer/load", json={"num_running_kv": 1}).status_code == 400
        assert peer.post("/peer/load", json={"queues": {"waiting": 1}}).status_code == 400


@pytest.mark.parametrize("flatten", [False, True], ids=["named_tensors", "flattened_bucket"])
def test_ipc_transport_syncs_every_tensor_exactly_into_sglang(sglang_peer, flatten):
    """rollout.sync.transport=ipc against SGLang's own /update_weights_from_tensor: its tokenizer manager,
    its TpModelWorker.deserialize_own_rank (MultiprocessingSerializer, SafeUnpickler) and its WeightUpdater
    (FlattenedTensorBucket for flattened_bucket) rebuild every tensor from our shared-memory handles with its
    dtype, shape and bits, over several buckets bounded by the bucket size."""

    version = f"ipc-{int(flatten)}"
    stats, state, got = _ipc_sync_into_sglang(sglang_peer, _weights(), version, flatten)
    want = _weights()
    assert stats.num_buckets >= 3 and stats.num_tensors == len(want)
    assert stats.payload_bytes < stats.nbytes  # handles, not the tensors' bytes
    assert state["names"] == [n for n, _ in want]  # each once, in the order sent
    for name, t in want:
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t), name
    assert state["weight_version"] == version and not state["session_open"]
    assert (state["running"], state["waiting"], state["flushes"]) == (0, 1, 1)  # retract: flushed once, at the end


def _ipc_sync_into_sglang(sglang_peer, weights, version: str, flatten: bool):
    """One IpcTransport sync of `weights` into the SGLang peer (4 KiB buckets, retract pausing with one request
    running): the sync's stats, the peer's state and the tensors SGLang rebuilt."""
    from megatron_dapo.sync.ipc import IpcTransport

    cfg = SyncConfig(flatten_bucket=flatten, pause_mode="retract")
    with _http(sglang_peer) as http:
        http.post("/peer/reset", params={"running": 1}).raise_for_status()
        transport = IpcTransport([sglang_peer.url], cfg, api_key=KEY)
        transport.bucket_bytes = 4096
        transport.connect()
        try:
            stats = transport.sync(iter(weights), version=version)
        finally:
            transport.close()
        state = http.get("/peer/state").json()
        got = load(http.get("/peer/received").content)
    return stats, state, got


def _fp8_weights() -> list[tuple[str, torch.Tensor]]:
    """`_weights` (bf16) through the FP8 block stage: float8_e4m3fn linear weights of odd sizes (whole and partial
    128 x 128 blocks; 33 x 25 = 825 bytes, so the next float32 scales would start misaligned) each followed by
    its float32 `weight_scale_inv`, between bf16 embeddings, norms and lm_head."""
    from megatron_dapo.bridge.fp8 import quantize_stream

    shapes = {"model.layers.0.mlp.up_proj.weight": (33, 25), "model.layers.0.self_attn.q_proj.weight": (130, 24)}
    g = torch.Generator().manual_seed(1)
    weights = [(n, torch.randn(shapes.get(n, t.shape), generator=g).to(torch.bfloat16)) for n, t in _weights()]
    return list(quantize_stream(weights))


@pytest.mark.parametrize("flatten", [False, True], ids=["named_tensors", "flattened_bucket"])
def test_ipc_transport_syncs_the_fp8_block_stream_exactly_into_sglang(sglang_peer, flatten):
    """rollout.weight_format=fp8_block over rollout.sync.transport=ipc, judged by SGLang's own
    /update_weights_from_tensor (its SafeUnpickler, MultiprocessingSerializer and, flattened, its multi-dtype
    FlattenedTensorBucket): every float8 weight and float32 scale arrives with its dtype, shape and bytes,
    mixed with bf16 tensors in the same buckets (shared-memory handles to float8 storages)."""
    from megatron_dapo.bridge import fp8

    want = _fp8_weights()
    assert {t.dtype for _, t in want} == {torch.float8_e4m3fn, torch.float32, torch.bfloat16}
    version = f"ipc-fp8-{int(flatten)}"
    stats, state, got = _ipc_sync_into_sglang(sglang_peer, want, version, flatten)
    assert stats.num_buckets >= 3 and stats.num_tensors == len(want)
    assert state["names"] == [n for n, _ in want]  # each weight, then its scales, in the order sent
    for name, t in want:
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name  # bytes: no float8 ==
    scales = [n for n, _ in want if fp8.scale_base(n)]
    assert len(scales) == 3 and all(got[n].dtype == torch.float32 for n in scales)
    assert state["weight_version"] == version and not state["session_open"]


def test_release_and_resume_with_tags_are_accepted_by_sglang_as_the_embedded_server_answers(sglang_peer, embedded):
    """Our client's /release_memory_occupation and /resume_memory_occupation, with tags, in the colocated
    cycle's order, reach SGLang's own handlers: each tag paused and resumed in SGLang's memory saver, the
    weights updated in between. A release while a request runs is refused by SGLang's idle assertion, and
    by the embedded server with the same message."""
    from megatron_dapo.sync.ipc import IpcTransport

    async def cycle(url):
        async with SGLangClient(url, api_key=KEY) as c:
            await c.release_memory_occupation(["kv_cache", "weights"])
            await c.resume_memory_occupation(["weights"])
        return url

    with _http(sglang_peer) as http:
        http.post("/peer/reset", params={"running": 0}).raise_for_status()
        asyncio.run(cycle(sglang_peer.url))
        released = http.get("/peer/state").json()["offload_tags"]
        transport = IpcTransport([sglang_peer.url], SyncConfig(), api_key=KEY)
        transport.connect()
        try:
            transport.sync(iter(_weights()), version="after-resume")
        finally:
            transport.close()

        async def resume_kv():
            async with SGLangClient(sglang_peer.url, api_key=KEY) as c:
                await c.resume_memory_occupation(["kv_cache"])

        asyncio.run(resume_kv())
        state = http.get("/peer/state").json()
        http.post("/peer/reset", params={"running": 1}).raise_for_status()

        async def release_busy(url):
            async with SGLangClient(url, api_key=KEY) as c:
                with pytest.raises(SGLangHTTPError) as e:
                    await c.release_memory_occupation(["weights"])
            return e.value

        sglang_refusal = asyncio.run(release_busy(sglang_peer.url))
    assert released == ["kv_cache"]  # weights resumed; kv_cache still released
    assert state["memory_saver_calls"] == [
        ["pause", "kv_cache"],
        ["pause", "weights"],
        ["resume", "weights"],
        ["resume", "kv_cache"],
    ]
    assert state["offload_tags"] == [] and state["weight_version"] == "after-resume"
    assert state["names"] == [n for n, _ in _weights()]
    assert "should be called only when server is idle" in sglang_refusal.server_message

    async def embedded_busy():
        async with SGLangClient(embedded.url, api_key=KEY) as c:
            long = asyncio.ensure_future(c.generate([1, 2, 3], SamplingParams(max_new_tokens=4000)))
            while (await c.get_loads()).running == 0:  # state, not time: the request is running
                await asyncio.sleep(0.01)
            with pytest.raises(SGLangHTTPError) as e:
                await c.release_memory_occupation(["weights"])
            await c.abort_request(abort_all=True)
            await long
            await c.release_memory_occupation(["weights", "kv_cache"])  # idle now: accepted
            await c.resume_memory_occupation(None)
        return e.value

    embedded_refusal = asyncio.run(embedded_busy())
    assert embedded_refusal.status == sglang_refusal.status == 400
    assert embedded_refusal.server_message == sglang_refusal.server_message
