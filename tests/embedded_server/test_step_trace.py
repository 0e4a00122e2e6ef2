"""The embedded engine's step trace (serve --step-trace) and the cost-model fit from it
(`profile-engine --from-trace`), fast: a real engine (tiny model, in-process) traces its steps, the lines
agree with its own decode counters, and a fit of one half of a workload predicts the other half."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from megatron_dapo.cli import main as cli_main
from megatron_dapo.config.cost_model import CostModel
from megatron_dapo.coordinator.profile import read_step_trace, trace_points


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """An engine with a step trace, and its file. Steps are timed by the engine thread's CPU time with one
    torch thread, so every step's seconds are its own work: wall-clock steps on a loaded CI machine carry
    the scheduler's pauses, which no fit can predict (the held-out check failed at load average 25)."""
    from transformers import AutoModelForCausalLM

    from megatron_dapo.embedded_server.engine import Engine
    from megatron_dapo.embedded_server.load_stats import StepTrace
    from megatron_dapo.models.tiny import tiny_hf_config

    path = tmp_path_factory.mktemp("trace") / "server_0.jsonl"
    torch.manual_seed(0)
    eng = Engine(
        AutoModelForCausalLM.from_config(tiny_hf_config("qwen3"), dtype=torch.float32),
        max_batch=16,
        step_trace=StepTrace(path),
        step_clock=time.thread_time,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield eng, path
    finally:
        eng.close()
        torch.set_num_threads(threads)


def _run(engine, n: int, prompt_len: int, new_tokens: int) -> None:
    """One batch of n distinct prompts, each generating exactly new_tokens."""
    from megatron_dapo.embedded_server.engine import GenRequest

    reqs = [
        GenRequest(
            rid=f"r{i}-{time.monotonic_ns()}",
            prompt=[1 + (i + j) % 50 for j in range(prompt_len)],
            max_new_tokens=new_tokens,
            ignore_eos=True,
        )
        for i in range(n)
    ]
    for f in engine.submit_many(reqs):
        f.result(timeout=120)


def _workload(engine, path, runs: int = 3) -> tuple[list, list]:
    """Every batch shape 2 x `runs` times in a row, into halves A and B in turns (A B then B A: the two halves
    see the same machine load); of each shape's `runs` in a half, the fastest two are kept (time windows, wall
    clock as the trace's). Even CPU-time steps slow down when the other hardware thread of the core is busy
    (the held-out check failed at 0.86 s traced against 0.50 s predicted on a CI machine shared with
    simulations): a burst of load lengthens a run, never shortens it, so the fastest runs are the machine's."""
    a, b = [], []
    for i, (n, prompt_len) in enumerate((n, p) for n in (1, 4, 12) for p in (8, 120)):
        shape = {id(a): [], id(b): []}
        for _ in range(runs):
            for half in (a, b) if i % 2 == 0 else (b, a):
                t = time.time()
                _run(engine, n, prompt_len, new_tokens=20)
                shape[id(half)].append((t, time.time()))
        for half in (a, b):
            fastest = sorted(shape[id(half)], key=lambda w: sum(r["s"] for r in _rows(path, [w])))[:2]
            half.extend(sorted(fastest))
    return a, b


def _rows(path, windows, kind: str = "decode") -> list[dict]:
    return [r for since, until in windows for r in read_step_trace([path], since, until, kind)]


def test_trace_has_every_step_with_its_batch_and_kv(traced):
    engine, path = traced
    before = engine.stats.decode_moments() or [0.0] * 6
    lines0 = len(path.read_text().splitlines())
    _run(engine, 3, prompt_len=10, new_tokens=6)
    rows = [json.loads(x) for x in path.read_text().splitlines()[lines0:]]
    moments = [a - b for a, b in zip(engine.stats.decode_moments(), before)]
    assert [r["kind"] for r in rows] == ["prefill"] + ["decode"] * 5  # the first token comes from the prefill
    assert rows[0]["n"] == 3 and rows[0]["tokens"] == 30
    # resident KV before each decode step: 3 prompts of 10 plus the tokens made so far
    assert [r["kv"] for r in rows[1:]] == [3 * (10 + k) for k in range(1, 6)]
    # against the engine's own counters (SGLang's decode moments): steps, batch sum, microseconds
    decode = rows[1:]
    assert moments[0] == len(decode) and moments[1] == sum(r["n"] for r in decode)
    assert moments[2] == pytest.approx(sum(r["s"] for r in decode) * 1e6, abs=len(decode))
    assert all(r["t"] >= rows[0]["t"] for r in decode) and all(r["s"] > 0 for r in decode)


def test_fit_of_one_half_predicts_the_other_within_its_error(traced, tmp_path, capsys):
    engine, path = traced
    a, b = _workload(engine, path)
    first, prefills = _rows(path, a), _rows(path, a, "prefill")
    half = tmp_path / "half_a.jsonl"  # the trace lines of half A, as a file of their own
    half.write_text("".join(json.dumps(r) + "\n" for r in first + prefills))
    out = tmp_path / "cost.json"
    assert cli_main(["profile-engine", "--from-trace", str(half), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    fit = json.loads(out.read_text())
    model = CostModel.load(out)
    assert "fit relative error" in printed and f"wrote {out}" in printed
    assert fit["steps"] == len(first) == 12 * 19  # 12 batches of 19 decode steps each

    # the reported error, recomputed here: rms over the points, each counted by its steps
    points = trace_points(first)
    rel = [(model.step_time(p.n, p.kv_tokens) - p.step_s) / p.step_s for p in points]
    w = [p.steps for p in points]
    assert fit["fit_rel_error"] == pytest.approx(math.sqrt(sum(wi * r * r for wi, r in zip(w, rel)) / sum(w)))
    # a fit weighted by steps keeps the total time of the steps it was fitted on
    assert abs(fit["total_time_rel_error"]) < 0.02
    # prefill: one per batch (12), its seconds per prefilled token
    assert fit["prefills"] == len(prefills) == 12
    assert model.p_k == pytest.approx(sum(r["s"] for r in prefills) / sum(r["tokens"] for r in prefills))

    # half B (the same batches, each run beside its twins): the fit predicts its total decode time within
    # twice the fit's own error (held-out steps still carry cache and frequency noise the fit never saw:
    # with wall-clock steps and a bound of 1x it failed 1 run in 4 at load average 5)
    second = _rows(path, b)
    traced_s = sum(r["s"] for r in second)
    predicted_s = sum(model.step_time(r["n"], r["kv"]) for r in second)
    assert abs(predicted_s - traced_s) / traced_s <= max(2 * fit["fit_rel_error"], 0.10)


def test_trace_reader_skips_a_torn_last_line_and_names_a_bad_one(tmp_path):
    good = '{"t":1.0,"kind":"decode","n":2,"kv":10,"s":0.01}\n'
    torn = tmp_path / "killed.jsonl"
    torn.write_text(good * 2 + '{"t":2.0,"kind":"dec')  # a server killed mid-write
    assert len(read_step_trace([torn])) == 2
    assert len(read_step_trace([torn], since=1.5)) == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(good + "not json\n" + good)
    with pytest.raises(ValueError, match=r"bad.jsonl, line 2"):
        read_step_trace([bad])


def test_from_trace_with_too_few_steps_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "short.jsonl"
    path.write_text('{"t":1.0,"kind":"decode","n":2,"kv":10,"s":0.01}\n')
    assert cli_main(["profile-engine", "--from-trace", str(path), "--out", str(tmp_path / "c.json")]) == 1
    assert "1 decode steps" in capsys.readouterr().err and not (tmp_path / "c.json").exists()


def test_a_slowed_engine_stretches_every_step_to_one_over_its_speed(tmp_path, monkeypatch):
    """serve --slowdown F: each prefill and decode step sleeps until it has taken 1/F of its own time, and
    the trace and the load counters see the stretched step (as from a slower engine). The engine's sleep
    is recorded instead of slept, so each step's sleep is checked against its traced seconds exactly."""
    from transformers import AutoModelForCausalLM

    from megatron_dapo.embedded_server import engine as engine_module
    from megatron_dapo.embedded_server.load_stats import StepTrace
    from megatron_dapo.embedded_server.server import build_parser
    from megatron_dapo.models.tiny import tiny_hf_config

    slept = []
    monkeypatch.setattr(engine_module.time, "sleep", slept.append)  # the module's `time` is the stdlib's
    path = tmp_path / "slow.jsonl"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_hf_config("qwen3"), dtype=torch.float32)
    eng = engine_module.Engine(model, max_batch=8, step_trace=StepTrace(path), speed=0.25)
    try:
        _run(eng, 3, prompt_len=10, new_tokens=6)
        moments = eng.stats.decode_moments()
    finally:
        eng.close()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["prefill"] + ["decode"] * 5 and len(slept) == 6
    for row, sleep in zip(rows, slept):  # slept = traced - computed, traced = computed / 0.25
        assert sleep > 0 and sleep == pytest.approx(0.75 * row["s"], rel=1e-6, abs=2e-6)
    assert moments[2] / 1e6 == pytest.approx(sum(r["s"] for r in rows[1:]), abs=1e-5)  # decode µs counted stretched
    with pytest.raises(ValueError, match=r"speed must be in \(0, 1\], got 1.5"):
        engine_module.Engine(model, speed=1.5)
    for bad in ("0", "1.5", "nan", "x"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--model", "m", "--slowdown", bad])
    assert build_parser().parse_args(["--model", "m"]).slowdown == 1.0
