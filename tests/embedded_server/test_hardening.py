"""The embedded server against hostile and broken input (issue 13, server side).

Fast tests check the unpickler's allow-list in this process; slow ones drive a real `megatron-dapo serve`
subprocess on 127.0.0.1 through the whole hostile set and end by checking its greedy output is unchanged.
"""

from __future__ import annotations

import importlib
import itertools
import os

import psutil
import pytest
import torch

from megatron_dapo.embedded_server.tensor_payload import ALLOWED_GLOBALS

DATA_MODULES = {
    "builtins",
    "collections",
    "copyreg",
    "torch",
    "torch._utils",
    "torch._tensor",
    "torch.storage",
    "torch.serialization",
    "torch.nn.parameter",
    "torch.multiprocessing.reductions",
}


HUGE = 1 << 28  # a size a payload may ask for; anything that fills it shows in the traced peak


def _resources() -> dict:
    me = psutil.Process()
    return {
        "fds": me.num_fds(),
        "threads": me.num_threads(),
        "children": len(me.children(recursive=True)),
        "shm": len(os.listdir("/dev/shm")),
    }


def _call_with_hostile_args(obj) -> None:
    """Call `obj` as a pickle's REDUCE could: every 0-3 argument combination of a descriptor number, a huge
    size, names, None, a dtype, a storage class and a storage."""
    values = [0, HUGE, "x", None, torch.float32, torch.UntypedStorage, (), torch.UntypedStorage(4)]
    for k in range(4):
        for args in itertools.product(values, repeat=k):
            try:
                obj(*args)
            except Exception:
                pass


def _leaks(module: str, name: str) -> dict:
    """What calling this global with hostile arguments leaves behind in this process ({resource: (before,
    after)}), and whether it filled memory of the size it was asked for ("filled": peak bytes)."""
    import tracemalloc

    obj = getattr(importlib.import_module(module), name)
    before = _resources()
    tracemalloc.start()
    try:
        _call_with_hostile_args(obj)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    after = _resources()
    found = {k: (before[k], after[k]) for k in before if after[k] != before[k]}
    return found | ({"filled": peak} if peak >= HUGE // 2 else {})


def test_every_allowed_global_only_builds_data():
    """Every class or function the unpickler would resolve exists, comes from a data / torch rebuild module,
    and, called with any hostile arguments, leaves no descriptor, thread, process or shared-memory file."""
    import warnings

    assert ALLOWED_GLOBALS, "the allow-list is empty"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage's deprecation warning
        for module, name in sorted(ALLOWED_GLOBALS):
            assert module in DATA_MODULES, f"{module}.{name}: not a data or tensor-rebuild module"
            assert hasattr(importlib.import_module(module), name), f"{module}.{name} does not exist"
            assert not _leaks(module, name), f"{module}.{name} leaves {_leaks(module, name)}"
        # the check sees what the old allow-list let through: descriptors, and memory filled on request
        assert "fds" in _leaks("multiprocessing.resource_sharer", "DupFd")
        assert "filled" in _leaks("builtins", "bytearray") and "filled" in _leaks("builtins", "bytes")


def test_top_k_at_or_above_the_vocabulary_keeps_the_whole_vocabulary():
    # SGLang clients send 1 << 30 (its own "all") or the vocabulary size for "no top-k"; only values the
    # batch tensors cannot hold are refused.
    from megatron_dapo.embedded_server.limits import sampling_range_problem
    from megatron_dapo.embedded_server.sampling import filter_top_k_top_p
    from megatron_dapo.embedded_server.schemas import SamplingParamsIn

    probs = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), -1)
    top_p = torch.ones(3)
    whole = filter_top_k_top_p(probs, torch.full((3,), -1), top_p)
    for k in (50, 1 << 30):
        assert torch.equal(filter_top_k_top_p(probs, torch.full((3,), k), top_p), whole)
        assert sampling_range_problem(SamplingParamsIn(top_k=k), 50, "") is None
    assert torch.allclose(whole, probs)
    assert "top_k" in sampling_range_problem(SamplingParamsIn(top_k=2**31), 50, "")


def test_unpickler_refuses_descriptor_classes_before_building_any():
    import io
    import pickle

    from megatron_dapo.embedded_server.tensor_payload import SafeUnpickler

    before = _resources()["fds"]
    raw = b"(" + b"cmultiprocessing.resource_sharer\nDupFd\n(I0\ntR" * 100 + b"l."
    with pytest.raises(pickle.UnpicklingError, match="multiprocessing.resource_sharer.DupFd is not allowed"):
        SafeUnpickler(io.BytesIO(raw)).load()
    assert _resources()["fds"] == before


# ---- a real `megatron-dapo serve` subprocess through the hostile set ---------------------------------------
KEY = "hardening-secret"
LIMIT_BYTES, MAX_N, GROUP_TIMEOUT_S = 1 << 20, 8, 3
PROBE = [3, 1, 4, 1, 5, 9, 2, 6]
GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_dapo.data.char_tokenizer import build_char_tokenizer
    from megatron_dapo.models.tiny import save_tiny_hf_model

    return build_char_tokenizer(save_tiny_hf_model("qwen3", tmp_path_factory.mktemp("qwen3")))


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """One server with small limits; `server.baseline` is its greedy output for PROBE before any hostile input."""
    from megatron_dapo.rollout.launcher import embedded_server

    srv = embedded_server(
        str(model_dir),
        tmp_path_factory.mktemp("logs") / "server.log",
        api_key=KEY,
        extra_args=[
            "--max-request-bytes",
            str(LIMIT_BYTES),
            "--max-n",
            str(MAX_N),
            "--weight-group-timeout-s",
            str(GROUP_TIMEOUT_S),
        ],
    )
    srv.start(timeout_s=120)
    try:
        srv.baseline = _post(srv, "/generate", {"input_ids": PROBE, "sampling_params": GREEDY}).json()["output_ids"]
        # updates are refused outside a weight-update session (as in SGLang): the hostile set runs inside one
        assert _post(srv, "/begin_weight_update", {"selector": "all"}).status_code == 200
        yield srv
    finally:
        srv.stop()


def _http(srv, **kw):
    import httpx

    return httpx.AsyncClient(
        base_url=srv.url,
        headers={"Authorization": f"Bearer {KEY}"},
        trust_env=False,
        timeout=kw.pop("timeout", 60),
        **kw,
    )


def _post(srv, path, body=None, **kw):
    import httpx

    return httpx.post(
        srv.url + path,
        json=body if body is not None else {},
        trust_env=False,
        timeout=60,
        headers={"Authorization": f"Bearer {KEY}", **kw.pop("headers", {})},
        **kw,
    )


def _message(resp) -> str:
    body = resp.json()
    return body.get("message") or (body.get("error") or {}).get("message") or str(body)


@pytest.mark.slow
def test_descriptor_pickles_are_refused_and_the_server_fd_count_stays_flat(server):
    import base64
    import time

    raw = b"(" + b"(S'model.norm.weight'\ncmultiprocessing.resource_sharer\nDupFd\n(I0\ntRt" * 5000 + b"l."
    assert len(raw) * 4 // 3 < LIMIT_BYTES
    proc = psutil.Process(server.proc.pid)
    before = proc.num_fds()
    for _ in range(5):
        resp = _post(
            server, "/update_weights_from_tensor", {"serialized_named_tensors": [base64.b64encode(raw).decode()]}
        )
        assert resp.status_code == 400 and "multiprocessing.resource_sharer.DupFd is not allowed" in _message(resp)
    deadline = time.monotonic() + 10
    while proc.num_fds() > before and time.monotonic() < deadline:  # our closed connections go away
        time.sleep(0.1)
    assert proc.num_fds() <= before


@pytest.mark.slow
def test_oversized_bodies_and_too_many_sequences_are_refused(server):
    big = {"input_ids": PROBE, "sampling_params": GREEDY, "rid": "x" * LIMIT_BYTES}
    resp = _post(server, "/generate", big)
    assert resp.status_code == 400 and "--max-request-bytes" in _message(resp)
    import httpx

    assert httpx.post(server.url + "/generate", json=big, trust_env=False, timeout=60).status_code == 401  # no key

    def chunks():  # no Content-Length: the limit counts what arrives
        for _ in range(LIMIT_BYTES // 65536 + 2):
            yield b" " * 65536

    resp = httpx.post(
        server.url + "/generate",
        content=chunks(),
        trust_env=False,
        timeout=60,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert resp.status_code == 400 and "--max-request-bytes" in _message(resp)
    nested = httpx.post(
        server.url + "/generate",
        content=b"[" * (LIMIT_BYTES // 2),
        trust_env=False,
        timeout=60,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert nested.status_code == 400  # deeper than the JSON parser goes: a parse error, not a crash
    resp = _post(server, "/generate", {"input_ids": PROBE, "sampling_params": {**GREEDY, "n": MAX_N + 1}})
    assert resp.status_code == 400 and "sampling_params.n" in _message(resp) and "--max-n" in _message(resp)
    resp = _post(server, "/generate", {"input_ids": [PROBE] * (MAX_N + 1), "sampling_params": GREEDY})
    assert resp.status_code == 400 and "--max-n" in _message(resp)
    ok = _post(server, "/generate", {"input_ids": PROBE, "sampling_params": {**GREEDY, "n": MAX_N}})
    assert ok.status_code == 200 and [a["output_ids"] for a in ok.json()] == [server.baseline] * MAX_N


HOSTILE_SAMPLING = [
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": 2**31}, "top_k"),
    ({"top_k": 0}, "top_k"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_new_tokens": 2**40}, "max_new_tokens"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"sampling_seed": 2**64}, "sampling_seed"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids"),
    ({"n": 0}, "n"),
]


@pytest.mark.slow
def test_hostile_sampling_values_fail_only_their_own_request(server, hf_model):
    import asyncio
    import json

    async def go():
        async with _http(server) as c:

            def send(sp):  # json.dumps writes inf as `Infinity`, which the server's JSON parser reads
                return c.post(
                    "/generate",
                    content=json.dumps({"input_ids": PROBE, "sampling_params": sp}),
                    headers={"Content-Type": "application/json"},
                )

            honest = [send(GREEDY) for _ in range(3)]
            return await asyncio.gather(*honest, *(send({**GREEDY, **bad}) for bad, _ in HOSTILE_SAMPLING))

    answers = asyncio.run(go())
    hf = hf_model.generate(torch.tensor([PROBE]), max_new_tokens=12, do_sample=False)[0, len(PROBE) :].tolist()
    for resp in answers[:3]:
        assert resp.status_code == 200 and resp.json()["output_ids"] == hf == server.baseline
    for resp, (bad, field) in zip(answers[3:], HOSTILE_SAMPLING):
        assert resp.status_code == 400 and field in _message(resp), (bad, resp.text)


@pytest.mark.slow
def test_text_is_tokenized_off_the_event_loop(server):
    import asyncio

    text = "hostile text " * 40000  # about 0.5 MB: the tokenizer takes a second or more

    async def go():
        async with _http(server) as c:
            long = asyncio.ensure_future(c.post("/generate", json={"text": text, "sampling_params": GREEDY}))
            await asyncio.sleep(0.2)  # its body is in and being tokenized
            health = await c.get("/health")
            return health.status_code, long.done(), await long

    status, long_done_first, long = asyncio.run(go())
    assert status == 200 and not long_done_first, "/health waited for a tokenization"
    assert long.status_code == 400 and "does not fit the context" in _message(long)


@pytest.mark.slow
def test_admin_routes_answer_while_group_formations_hang(server):
    import asyncio

    from megatron_dapo.runtime.net import LOOPBACK, free_port

    nobody = free_port()  # nothing listens there: the store connection retries until the timeout

    async def go():
        async with _http(server) as c:
            forming = [
                asyncio.ensure_future(
                    c.post(
                        "/init_weights_update_group",
                        json={
                            "master_address": LOOPBACK,
                            "master_port": nobody,
                            "rank_offset": 1,
                            "world_size": 2,
                            "group_name": f"unreachable_{i}",
                            "backend": "gloo",
                        },
                    )
                )
                for i in range(8)
            ]
            await asyncio.sleep(0.3)
            admin = [
                await c.get("/health"),
                await c.post("/abort_request", json={"abort_all": True}),
                await c.post("/pause_generation", json={"mode": "abort"}),
                await c.post("/update_weight_version", json={"new_version": "during"}),
                await c.post("/continue_generation", json={}),
                await c.get("/get_model_info"),
                await c.post("/update_weight_version", json={"new_version": "default"}),
            ]
            pending = sum(not f.done() for f in forming)
            return admin, pending, await asyncio.gather(*forming)

    admin, pending, formed = asyncio.run(go())
    assert all(r.status_code == 200 for r in admin), [r.text for r in admin]
    assert admin[5].json()["weight_version"] == "during"
    assert pending == 8, "a group formation answered before the admin commands"
    for resp in formed:
        assert resp.status_code == 400 and f"within {GROUP_TIMEOUT_S}s" in _message(resp), resp.text
        assert "--weight-group-timeout-s" in _message(resp)


def _in_thread(fn, *args, **kw):
    import threading

    out = {}

    def run():
        try:
            out["resp"] = fn(*args, **kw)
        except Exception as e:  # e.g. the server stopped under it; the caller reads out["error"]
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _form_group(server, name):
    """This process as the trainer (rank 0) of a real gloo weight-update group with the server."""
    from megatron_dapo.rollout import weight_group as wgroup
    from megatron_dapo.runtime.net import LOOPBACK, free_port

    port = free_port()
    t, out = _in_thread(
        _post,
        server,
        "/init_weights_update_group",
        {
            "master_address": LOOPBACK,
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": name,
            "backend": "gloo",
        },
    )
    pg = wgroup.init_weight_update_group(LOOPBACK, port, 0, 2, name, "gloo", timeout_s=30)
    t.join(60)
    assert out["resp"].status_code == 200, out["resp"].text
    return pg


def _announce_and_send(server, pg, group, names, dtypes, shapes, tensors, version=None):
    """Announce an update and broadcast `tensors` (what the sender really has) as a trainer does."""
    import datetime

    from megatron_dapo.rollout import weight_group as wgroup

    t, out = _in_thread(
        _post,
        server,
        "/update_weights_from_distributed",
        {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group, "weight_version": version},
    )
    sent = []
    for x in tensors:
        try:
            wgroup.broadcast(x, pg, async_op=True).wait(datetime.timedelta(seconds=20))
            sent.append(True)
        except Exception:  # the server dropped the group under this broadcast
            sent.append(False)
    t.join(60)
    return out["resp"], sent


@pytest.mark.slow
def test_an_unreceivable_distributed_update_destroys_its_group_and_the_next_loads_fresh_bytes(server, hf_model):
    import copy

    from megatron_dapo.rollout import weight_group as wgroup

    name, group = "model.norm.weight", "hostile_update"
    weight = hf_model.state_dict()[name].detach().clone()
    shape = list(weight.shape)
    stale = torch.full_like(weight, 1000.0)  # what a refused update's sender puts on the wire
    hostile = [
        (["float99"], [shape], "float99"),
        (["float32"], [[-1] + shape], "negative size"),
        (["float32"], [[2**40]], "more than this server receives"),
    ]
    for dtypes, shapes, why in hostile:
        pg = _form_group(server, group)
        try:
            resp, _ = _announce_and_send(server, pg, group, [name], dtypes, shapes, [stale])
            assert resp.status_code == 400 and why in _message(resp), resp.text
            assert f"group {group!r} was destroyed" in _message(resp)
            again = _post(
                server,
                "/update_weights_from_distributed",
                {"names": [name], "dtypes": ["float32"], "shapes": [shape], "group_name": group},
            )
            assert again.status_code == 400 and "no group" in _message(again)
        finally:
            wgroup.destroy_weight_update_group(pg)

    # a new group's update loads its own bytes, never the refused ones
    doubled = copy.deepcopy(hf_model)
    doubled.model.norm.weight.data.mul_(2.0)
    pg = _form_group(server, group)
    try:
        resp, sent = _announce_and_send(
            server,
            pg,
            group,
            [name],
            ["float32"],
            [shape],
            [doubled.model.norm.weight.detach().clone()],
            version="doubled",
        )
        assert resp.status_code == 200 and sent == [True], resp.text
        got = _post(server, "/generate", {"input_ids": PROBE, "sampling_params": GREEDY}).json()
        want = doubled.generate(torch.tensor([PROBE]), max_new_tokens=12, do_sample=False)[0, len(PROBE) :].tolist()
        assert got["output_ids"] == want and got["meta_info"]["weight_version"] == "doubled"
        resp, _ = _announce_and_send(server, pg, group, [name], ["float32"], [shape], [weight], version="default")
        assert resp.status_code == 200, resp.text
        assert _post(server, "/destroy_weights_update_group", {"group_name": group}).status_code == 200
    finally:
        wgroup.destroy_weight_update_group(pg)


@pytest.mark.slow
def test_a_group_that_forms_after_its_client_was_answered_is_destroyed(server):
    """The trainer's store is up but the trainer joins only after the server answered 'did not form': the
    server's formation then completes in its thread, and the group must not be installed."""
    import time

    import torch.distributed as dist

    from megatron_dapo.rollout import weight_group as wgroup
    from megatron_dapo.runtime.net import LOOPBACK, free_port

    port, group = free_port(), "late_group"
    destroyed = "group 'late_group' formed after its request was answered; destroyed"

    def times_destroyed() -> int:  # the whole log: the teardown may log a C++ stack trace after the line
        return server.log_path.read_text(errors="replace").count(destroyed)

    before = times_destroyed()
    store = dist.TCPStore(
        LOOPBACK,
        port,
        2,
        is_master=True,
        multi_tenant=True,  # reachable, nobody joins yet
        wait_for_workers=False,
    )
    resp = _post(
        server,
        "/init_weights_update_group",
        {
            "master_address": LOOPBACK,
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": group,
            "backend": "gloo",
        },
    )
    assert resp.status_code == 400 and "did not form" in _message(resp), resp.text
    pg = wgroup.init_weight_update_group(LOOPBACK, port, 0, 2, group, "gloo", timeout_s=30)  # the late join
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            again = _post(
                server,
                "/update_weights_from_distributed",
                {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[1]], "group_name": group},
            )
            assert again.status_code == 400 and "no group" in _message(again), again.text
            if times_destroyed() > before:
                break
            time.sleep(0.2)
        assert times_destroyed() == before + 1, server.log_tail()
    finally:
        wgroup.destroy_weight_update_group(pg)
        del store


@pytest.mark.slow
def test_zz_greedy_output_is_unchanged_after_the_hostile_set(server, hf_model):
    got = _post(server, "/generate", {"input_ids": PROBE, "sampling_params": GREEDY}).json()
    hf = hf_model.generate(torch.tensor([PROBE]), max_new_tokens=12, do_sample=False)[0, len(PROBE) :].tolist()
    assert got["output_ids"] == server.baseline == hf
    assert got["meta_info"]["weight_version"] == "default"


@pytest.mark.slow
def test_zzz_sigterm_does_not_wait_on_a_hung_receive(server, hf_model):
    """Last: it stops the module's server. A trainer announces an update and never sends it."""
    import signal
    import time

    from megatron_dapo.rollout import weight_group as wgroup

    name = "model.norm.weight"
    pg = _form_group(server, "never_sent")
    try:
        _in_thread(
            _post,
            server,
            "/update_weights_from_distributed",
            {
                "names": [name],
                "dtypes": ["float32"],
                "shapes": [list(hf_model.state_dict()[name].shape)],
                "group_name": "never_sent",
            },
        )
        time.sleep(1.0)  # the server is receiving now
        server.stop(grace_s=30)  # SIGTERM, then SIGKILL after 30 s
    finally:
        wgroup.destroy_weight_update_group(pg)
    # uvicorn re-raises the SIGTERM once it has shut down; -SIGKILL would mean it waited on the receive
    assert server.proc.returncode in (0, -signal.SIGTERM), server.log_tail()
