"""Replay of the requests third-party SGLang clients send, against a real `megatron-dapo serve`.

The bodies are written here from each client's documented request shapes (SGLang 0.5.23's
`RuntimeEndpoint` and `HttpServerEngineAdapter`, verl's `HttpServerAdapter` / `AsyncHttpServerAdapter`,
slime's rollout and its abort-until-idle loop); every answer is then read the way that client reads it.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import httpx
import pytest

from megatron_dapo.rollout.launcher import embedded_server, start_servers

pytestmark = pytest.mark.slow
KEY = "replay-secret"
NAME = "tiny-qwen3"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from megatron_dapo.data.char_tokenizer import build_char_tokenizer
    from megatron_dapo.models.tiny import save_tiny_hf_model

    d = save_tiny_hf_model("qwen3", tmp_path_factory.mktemp("qwen3"))
    build_char_tokenizer(d)
    srv = embedded_server(
        str(d), tmp_path_factory.mktemp("logs") / "server.log", api_key=KEY, extra_args=["--served-model-name", NAME]
    )
    start_servers([srv], timeout_s=120)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, trust_env=False, timeout=60) as c:
        yield c


def _ok(r: httpx.Response):
    assert r.status_code == 200, (r.request.url, r.text)
    return r


def _check_meta(answer: dict, version: str = "default"):
    """The meta_info fields SGLang fills for every finished request."""
    m = answer["meta_info"]
    assert m["completion_tokens"] == len(answer["output_ids"]) and m["cached_tokens"] == 0
    assert isinstance(m["e2e_latency"], float) and m["e2e_latency"] > 0
    assert m["weight_version"] == version
    assert m["weight_versions"] == [{"version": version, "start": 0, "end": len(answer["output_ids"])}]
    assert m["finish_reason"]["type"] in ("stop", "length")


def test_runtime_endpoint_shapes(http):
    info = _ok(http.get("/get_model_info")).json()
    assert info["model_path"] and info["tokenizer_path"] == info["model_path"] and info["served_model_name"] == NAME
    _ok(http.post("/flush_cache"))  # RuntimeEndpoint only checks the status (SGLang answers text)
    server_info = _ok(http.get("/server_info")).json()
    assert server_info["served_model_name"] == NAME and server_info["version"] == "0.5.23"
    assert isinstance(server_info["internal_states"], list)
    _ok(http.post("/generate", json={"text": "Q: 1+1?", "sampling_params": {"max_new_tokens": 0}}))  # cache_prefix

    sp = {
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "max_new_tokens": 6,
        "min_new_tokens": 2,
        "n": 1,
        "stop": [],
        "stop_token_ids": [],
        "stop_regex": [],
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "frequency_penalty": 0.3,
        "presence_penalty": 0.1,
        "ignore_eos": False,
        "regex": None,
        "json_schema": None,
    }
    obj = _ok(
        http.post(
            "/generate",
            json={
                "text": "Q: 1+1?",
                "sampling_params": sp,
                "return_logprob": True,
                "logprob_start_len": 0,
                "top_logprobs_num": 2,
                "return_text_in_logprobs": True,
            },
        )
    ).json()
    comp, meta = obj["text"], obj["meta_info"]
    assert isinstance(comp, str) and len(obj["output_ids"]) >= 2
    _check_meta(obj)
    assert all(len(row) == 2 and all(isinstance(t[2], str) for t in row) for row in meta["output_top_logprobs"])

    # select(): a batch of texts, input logprobs with their token texts, then the unconditional pass
    prefix, choices = "Q: 1+1? A:", [" 2", " 3", " 11"]
    prompt_len = _ok(http.post("/generate", json={"text": prefix, "sampling_params": {"max_new_tokens": 0}})).json()[
        "meta_info"
    ]["prompt_tokens"]
    out = _ok(
        http.post(
            "/generate",
            json={
                "text": [prefix + c for c in choices],
                "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                "return_logprob": True,
                "return_text_in_logprobs": True,
                "logprob_start_len": max(prompt_len - 2, 0),
            },
        )
    ).json()
    assert len(out) == len(choices)
    input_lps = [r["meta_info"]["input_token_logprobs"] for r in out]
    for lps, c in zip(input_lps, choices):
        assert isinstance(lps[0][-1], str) and "".join(t[2] for t in lps).endswith(c)
        assert all(isinstance(t[0], float) for t in lps)  # summed by compute_normalized_prompt_logprobs
    uncond = _ok(
        http.post(
            "/generate",
            json={
                "input_ids": [[t[1] for t in lps] for lps in input_lps],
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
            },
        )
    ).json()
    # SGLang 0.5.23 computes no input logprobs when logprob_start_len is unset (scheduler.py), nor does this server
    assert [r["meta_info"]["input_token_logprobs"] for r in uncond] == [[]] * len(choices)
    assert [r["meta_info"]["prompt_tokens"] for r in uncond] == [len(x) for x in input_lps]


def test_sglang_http_server_engine_adapter_shapes(http):
    payload = {
        "text": "hello",
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
        "return_logprob": False,
        "top_logprobs_num": 0,
        "priority": 1,
    }  # None values are left out
    answer = _ok(http.post("/generate", json=payload)).json()
    _check_meta(answer)
    ids = _ok(
        http.post(
            "/generate",
            json={
                "input_ids": [5, 6, 7],
                "sampling_params": {"max_new_tokens": 3},
                "return_logprob": True,
                "logprob_start_len": 1,
            },
        )
    ).json()
    assert [t[1] for t in ids["meta_info"]["output_token_logprobs"]] == ids["output_ids"]
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        r = _ok(http.post(path, json={}))
        assert r.headers["content-type"] == "application/json" and r.json() is None  # SGLang's handler returns None


def test_verl_http_server_adapter_shapes(server, http):
    sp = {
        "n": 1,
        "max_new_tokens": 5,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.05,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "ignore_eos": False,
    }
    answer = _ok(
        http.post("/generate", json={"input_ids": [10, 20, 30], "sampling_params": sp, "return_logprob": True})
    ).json()
    _check_meta(answer)
    assert [t[1] for t in answer["meta_info"]["output_token_logprobs"]] == answer["output_ids"]
    assert _ok(http.get("/flush_cache")).text.startswith("Cache flushed.")
    assert _ok(http.post("/release_memory_occupation", json={"tags": None})).json() is None
    assert _ok(http.post("/resume_memory_occupation", json={"tags": ["weights"]})).json() is None
    assert _ok(http.post("/abort_request", json={"rid": "", "abort_all": False})).content == b""

    async def async_adapter():  # AsyncHttpServerAdapter: aiohttp, resp.json(content_type=None)
        async with aiohttp.ClientSession(headers=AUTH) as s:
            async with s.post(
                server.url + "/generate",
                json={"input_ids": [10, 20, 30], "sampling_params": sp, "return_logprob": True},
            ) as resp:
                resp.raise_for_status()
                gen = await resp.json(content_type=None)
            async with s.post(server.url + "/release_memory_occupation", json={"tags": None}) as resp:
                resp.raise_for_status()
                released = await resp.json(content_type=None)
        return gen, released

    gen, released = asyncio.run(async_adapter())
    _check_meta(gen)
    assert released is None


def test_slime_rollout_and_abort_until_idle_shapes(http):
    sp = {
        "temperature": 1.0,
        "top_p": 0.95,
        "top_k": -1,
        "max_new_tokens": 6,
        "stop": None,
        "stop_token_ids": None,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
        "custom_params": {"return_top_p_token_ids": True},
        "sampling_seed": 7,
    }
    payload = {"sampling_params": sp, "return_logprob": True, "input_ids": [40, 41, 42]}
    outputs = [
        _ok(http.post("/generate", json=p)).json()
        for p in (payload, {**payload, "data_parallel_rank": 0}, {**payload, "return_routed_experts": False})
    ]
    for output in outputs:
        meta = output["meta_info"]
        tokens = [item[1] for item in meta["output_token_logprobs"]]
        log_probs = [item[0] for item in meta["output_token_logprobs"]]
        assert tokens == output["output_ids"] and all(lp <= 0 for lp in log_probs)
        assert isinstance(output["text"], str)
        _check_meta(output)
    assert outputs[0]["output_ids"] == outputs[1]["output_ids"] == outputs[2]["output_ids"]  # same seed

    # a feature this server does not implement is refused, naming the field
    r = http.post("/generate", json={**payload, "return_routed_experts": True})
    assert r.status_code == 400 and "return_routed_experts" in r.text
    r = http.post("/generate", json={**payload, "data_parallel_rank": 1})
    assert r.status_code == 400 and "data_parallel_rank" in r.text

    # abort_servers_until_idle: abort everything, then read the load until no request is left
    assert _ok(http.post("/abort_request", json={"abort_all": True})).status_code == 200
    load = _ok(http.get("/v1/loads", params={"include": "core,disagg,queues"})).json()
    assert load["loads"] and all(k in load for k in ("timestamp", "version", "accelerator", "num_accelerators"))
    (rank,) = load["loads"]
    assert rank["dp_rank"] == 0 and rank["num_running_reqs"] + rank["num_waiting_reqs"] == 0
    assert _ok(http.get("/v1/loads", params={"dp_rank": 3})).json()["loads"] == []
    assert http.get("/v1/loads", params={"include": "everything"}).status_code == 400


def test_openai_model_listing(server, http):
    with httpx.Client(trust_env=False, timeout=30) as anonymous:  # like every route but /health*, as SGLang
        for path in ("/v1/models", f"/v1/models/{NAME}", "/v1/loads", "/server_info", "/get_server_info"):
            assert anonymous.get(server.url + path).status_code == 401, path
    models = _ok(http.get("/v1/models")).json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [NAME]
    assert models["data"][0]["max_model_len"] > 0
    assert _ok(http.get(f"/v1/models/{NAME}")).json()["id"] == NAME
    r = http.get("/v1/models/other")
    assert r.status_code == 404 and json.loads(r.text)["error"]["code"] == "model_not_found"
