"""Stop strings and stop regexes in the embedded server (issue 26, item 4): no request can stall it.

Where a request stops and what text it answers are checked against SGLang 0.5.23's own stop checks
(`Req.update_finish_state`, the detokenizer's `trim_matched_stop`), run by tests/sglang_peer.py on the
token sequences our engine generated. A real `megatron-dapo serve` on loopback receives a pattern that
makes Python's backtracking `re` run for ages, stays healthy, and dies on SIGTERM even while busy.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from pydantic import ValidationError

from megatron_dapo.embedded_server import schemas as S
from megatron_dapo.embedded_server.stops import regex_max_chars, stop_window

BACKTRACKING = r"([\s\S]+)+\x00"  # never matches; Python's re tries 2^n splits of the text first
PROMPT = [5, 9, 11, 200, 7]
N = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_dapo.data.char_tokenizer import build_char_tokenizer
    from megatron_dapo.models.tiny import save_tiny_hf_model

    return build_char_tokenizer(save_tiny_hf_model("qwen3", tmp_path_factory.mktemp("qwen3")))


@pytest.fixture(scope="module")
def tiny(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(
        model_dir
    )


def _generate(model, tok, reqs: list[dict]) -> list[dict]:
    from megatron_dapo.embedded_server.engine import Engine, GenRequest

    eng = Engine(model, tok, seed=0)
    try:
        futs = [eng.submit(GenRequest(rid=f"r{i}", prompt=PROMPT, **r)) for i, r in enumerate(reqs)]
        return [f.result(120) for f in futs]
    finally:
        eng.close()


# ---- request parsing --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "pattern, why",
    [
        (r"(a)\1", "invalid escape sequence"),  # backreference
        (r"a(?=b)", "invalid perl operator"),  # lookahead
        (r"(?<!a)b", "invalid perl operator"),  # lookbehind
        ("(", "missing )"),
        ("a" * 257, "over the 256-byte limit"),
        (["a"] * 33, "at most 32 patterns"),
    ],
)
def test_patterns_re2_cannot_run_are_refused_naming_stop_regex(pattern, why):
    with pytest.raises(ValidationError, match="stop_regex") as e:
        S.SamplingParamsIn.model_validate({"stop_regex": pattern})
    assert why in str(e.value)
    S.SamplingParamsIn.model_validate({"stop_regex": [BACKTRACKING, r"\d+\.", "a" * 256]})


def test_tail_window_sizes(tiny):
    _, tok = tiny
    assert regex_max_chars("ab(c|de)") == 4 and regex_max_chars(r"^x\b[0-9]{2,3}") == 4
    assert regex_max_chars("a+") >= 1 << 30 and regex_max_chars(r"\pL") >= 1 << 30  # RE2-only syntax
    assert stop_window(tok, (), ()) == 0
    assert stop_window(tok, ("abc",), ("xy",)) == len(tok.encode("abc", add_special_tokens=False)) + 1 == 4


# ---- the engine against SGLang's own stop checks ----------------------------------------------------
def _cases(free: list[int], tok) -> list[dict]:
    """Stop settings that cut the free-running greedy output `free` at different places, built from the
    text of its tokens (`piece[i]`)."""
    piece = [tok.decode([t]) for t in free]
    esc = [re.escape(p) for p in piece]
    return [
        {"stop": piece[2]},
        {"stop": piece[11], "no_stop_trim": True},
        {"stop": [piece[20], piece[11]]},
        {"stop": piece[11], "skip_special_tokens": False},
        {"stop": piece[8] + piece[9], "stop_token_ids": [free[9]]},  # both at once: SGLang's string wins
        {"stop_regex": esc[11] + "."},  # the pattern's own text does not occur: the text stays whole
        {"stop_regex": esc[6]},  # a plain pattern: the text is cut where it occurs, as SGLang's detokenizer does
        {"stop_regex": esc[6], "no_stop_trim": True},
        {"stop_regex": esc[2] + r"[\s\S]+" + esc[11]},  # unbounded: the window is the whole output
        {"stop_regex": "^" + re.escape(piece[4][0])},  # anchored at the start of the two-token tail window
        {"stop_regex": re.escape(piece[5][-4:]) + "." + re.escape(piece[6][:1]) + "?"},  # bounded, spans two tokens
        {"stop_regex": [r"zzzz\d", esc[20]], "stop": "never-there"},
        {"stop_token_ids": [free[7]]},
        {"stop_token_ids": [free[7]], "no_stop_trim": True},
        {"stop_token_ids": [free[7]], "ignore_eos": True},  # SGLang: ignore_eos ignores stop_token_ids too
        {},
    ]


@pytest.mark.slow  # runs SGLang 0.5.23's code in a process of its own (installed on first use)
def test_stop_positions_and_text_equal_sglangs(tiny, model_dir):
    from tests import sglang_peer

    model, tok = tiny
    sglang_peer.ensure_installed()
    (free,) = _generate(model, tok, [dict(max_new_tokens=N, temperature=0.0, ignore_eos=True)])
    free = free["output_ids"]
    cases = _cases(free, tok)
    ours = _generate(model, tok, [_engine_kwargs(c) for c in cases])
    patterns = ["ab(c|de)", r"^x\b[0-9]{2,3}", "[^x]y", "a|bcd|ef", r"(?:ab){3}c?", "a*", r"\d{2}", "(?P<n>ab)"]
    query = {
        "finish": [
            {
                "tokenizer": str(model_dir),
                "prompt": PROMPT,
                "eos_token_ids": [],  # the tiny model's config names none; SGLang still stops on the tokenizer's
                "sampling_params": {"max_new_tokens": N, "temperature": 0.0, **c},
                "tokens": free,
            }
            for c in cases
        ],
        "patterns": patterns,
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tests.sglang_peer", "stops"],
        input=json.dumps(query),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    cut = 0
    for case, a, b in zip(cases, ours, theirs["finish"]):
        got = {"output_ids": a["output_ids"], "finish_reason": a["meta_info"]["finish_reason"], "text": a["text"]}
        assert got == b, f"{case}: ours {got}, SGLang's {b}"
        cut += len(a["output_ids"]) < N
    assert cut >= len(cases) - 3, "the cases must mostly stop early to compare anything"
    assert [regex_max_chars(p) for p in patterns] == theirs["max_len"]


def _engine_kwargs(case: dict) -> dict:
    stop, regex = case.get("stop"), case.get("stop_regex")
    return dict(
        max_new_tokens=N,
        temperature=0.0,
        stop_strs=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        stop_regex=(regex,) if isinstance(regex, str) else tuple(regex or ()),
        stop_token_ids=frozenset(case.get("stop_token_ids", ())),
        ignore_eos=case.get("ignore_eos", False),
        no_stop_trim=case.get("no_stop_trim", False),
        skip_special_tokens=case.get("skip_special_tokens", True),
    )


# ---- a real server ----------------------------------------------------------------------------------
GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}


def _post(srv, path, body, timeout=120):
    import httpx

    return httpx.post(srv.url + path, json=body, trust_env=False, timeout=timeout)


def _get(srv, path):
    import httpx

    return httpx.get(srv.url + path, trust_env=False, timeout=30)


def _healthy_within(srv, deadline_s: float) -> bool:
    import httpx

    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(srv.url + "/health", trust_env=False, timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


def _in_background(fn) -> dict:
    out: dict = {}

    def run():
        try:
            out["result"] = fn()
        except Exception as e:  # e.g. the server went away under it; the caller reads out["error"]
            out["error"] = e

    out["thread"] = threading.Thread(target=run, daemon=True)
    out["thread"].start()
    return out


@pytest.fixture
def server(model_dir, tmp_path):
    from megatron_dapo.rollout.launcher import embedded_server

    srv = embedded_server(str(model_dir), tmp_path / "server.log")
    srv.start(timeout_s=120)
    try:
        yield srv
    finally:
        srv.kill()


@pytest.mark.slow
def test_backtracking_stop_regex_leaves_the_server_healthy(server):
    probe = {"input_ids": PROMPT, "sampling_params": GREEDY}
    before = _post(server, "/generate", probe).json()["output_ids"]
    hostile = {
        "input_ids": PROMPT,
        "sampling_params": {"stop_regex": BACKTRACKING, "ignore_eos": True, "max_new_tokens": 64},
    }
    pending = _in_background(lambda: _post(server, "/generate", hostile))
    deadline = time.monotonic() + 120
    while pending["thread"].is_alive():  # /health answers all along (a wedged server times this out)
        assert _get(server, "/health").status_code == 200
        assert time.monotonic() < deadline, "the backtracking request never finished"
        time.sleep(0.1)
    resp = pending.get("result")
    assert resp is not None and resp.status_code == 200, pending.get("error") or resp.text
    assert resp.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 64}
    assert len(resp.json()["output_ids"]) == 64
    assert _healthy_within(server, 60)
    assert _post(server, "/generate", probe).json()["output_ids"] == before
    bad = _post(server, "/generate", {"input_ids": PROMPT, "sampling_params": {"stop_regex": r"(\w)\1"}})
    assert bad.status_code == 400 and "sampling_params.stop_regex" in bad.text and "invalid escape" in bad.text


@pytest.mark.slow
def test_sigterm_ends_a_busy_server(server):
    from megatron_dapo.embedded_server.server import EXIT_DEADLINE_S

    long = {
        "input_ids": PROMPT,
        "sampling_params": {"stop_regex": BACKTRACKING, "ignore_eos": True, "max_new_tokens": 400},
    }
    pending = _in_background(lambda: _post(server, "/generate", long, timeout=300))
    deadline = time.monotonic() + 60
    while _get(server, "/v1/loads").json()["loads"][0]["num_running_reqs"] == 0:
        assert time.monotonic() < deadline, "the long request never started"
        time.sleep(0.05)
    os.killpg(server.proc.pid, signal.SIGTERM)
    server.proc.wait(EXIT_DEADLINE_S + 60)  # raises TimeoutExpired if SIGTERM was ignored
    pending["thread"].join(60)
    assert not pending["thread"].is_alive()


DEADLINE_CHILD = """
import contextlib, sys, time
import uvicorn
from fastapi import FastAPI
from megatron_dapo.embedded_server import server

server.EXIT_DEADLINE_S = 2

@contextlib.asynccontextmanager
async def lifespan(app):
    yield
    time.sleep(3600)  # a shutdown step that never returns, holding the event loop

app = FastAPI(lifespan=lifespan)
app.get("/health")(lambda: {})
server._deadline_server(uvicorn.Config(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")).run()
"""


@pytest.mark.slow
def test_sigterm_exit_deadline_ends_a_stuck_shutdown(tmp_path):
    from megatron_dapo.runtime.net import free_port

    port = free_port()
    log = open(tmp_path / "child.log", "w+")
    proc = subprocess.Popen([sys.executable, "-c", DEADLINE_CHILD, str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        srv = type("Srv", (), {"url": f"http://127.0.0.1:{port}"})()
        assert _healthy_within(srv, 120), (tmp_path / "child.log").read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) != 0  # the graceful path never returns: the deadline ended it
        assert "Timeout (0:00:02)!" in (tmp_path / "child.log").read_text()  # faulthandler's stack dump
    finally:
        proc.kill()
        proc.wait()
        log.close()
