"""Server load reports and the cost-model fit, fast: the engine's counters against the requests it holds,
/v1/loads rows and their parsing, the registry's load fields, and the least-squares fit recovering known
coefficients. (SGLang's own code judges the report's shape in test_sglang_peer.py; a real server is
polled and profiled in test_loads_server.py.)"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from megatron_dapo.config.cost_model import QWEN_7B_1GPU, CostModel
from megatron_dapo.coordinator.profile import ProfilePoint, fit_cost_model, format_table, relative_error
from megatron_dapo.coordinator.servers import ServerRegistry
from megatron_dapo.embedded_server import load_report
from megatron_dapo.embedded_server.load_stats import LoadStats
from megatron_dapo.rollout import payloads
from megatron_dapo.rollout.types import ServerLoad
from tests.fake_clock import FakeClock


# ---- the engine's counters ---------------------------------------------------------------------------------
def test_decode_moments_sum_as_sglang_and_throughput_decays_then_goes_stale():
    clock = FakeClock(100.0)
    stats = LoadStats(clock=clock, window_steps=3, stale_s=30.0)
    assert stats.decode_moments() is None and stats.gen_throughput() == 0.0
    stats.prefill_step(12, 100.0, 100.5, generated=2)
    for i, (b, dt) in enumerate([(2, 0.25), (2, 0.25), (1, 0.5)]):
        start = 100.5 + i
        stats.decode_step(b, start, start + dt, generated=b)
    # [steps, sum b, sum step_us, sum b^2, sum b*step_us, sum generated]
    assert stats.decode_moments() == [3.0, 5.0, 1e6, 9.0, 2 * 250000 * 2 + 500000, 5.0]
    assert stats.prefill_totals() == (12, 500000)
    clock.t = 103.0  # the window keeps the last 3 steps: 5 tokens from 100.5 to now
    assert stats.gen_throughput() == pytest.approx(5 / 2.5)
    clock.t = 105.5  # idle: the rate decays
    assert stats.gen_throughput() == pytest.approx(5 / 5.0)
    clock.t = 133.1  # no step for more than stale_s
    assert stats.gen_throughput() == 0.0
    stats.decode_step(0, 133.1, 133.2, 0)  # an empty step is not counted
    assert stats.decode_moments()[0] == 3.0


@pytest.fixture(scope="module")
def engine():
    from transformers import AutoModelForCausalLM

    from megatron_dapo.embedded_server.engine import Engine
    from megatron_dapo.models.tiny import tiny_hf_config

    torch.manual_seed(0)
    eng = Engine(AutoModelForCausalLM.from_config(tiny_hf_config("qwen3"), dtype=torch.float32), max_batch=8)
    yield eng
    eng.close()


def _requests(prompts, max_new_tokens):
    from megatron_dapo.embedded_server.engine import GenRequest

    return [
        GenRequest(rid=f"r{i}-{time.monotonic_ns()}", prompt=p, max_new_tokens=max_new_tokens, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]


def test_engine_reports_the_requests_and_kv_tokens_it_holds(engine):
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [9, 10, 11, 12, 13, 14]]  # two identical: prefilled once
    moments0 = engine.stats.decode_moments() or [0.0] * 6
    prefill0 = engine.stats.prefill_totals()[0]

    engine.pause("in_place")
    reqs = _requests(prompts, max_new_tokens=200)
    engine.submit_many(reqs)
    load = engine.load_report()
    assert (load.running, load.waiting, load.resident_tokens, load.waiting_tokens) == (0, 3, 0, 16)
    assert load.capacity == engine.max_batch * engine.max_context

    engine.resume()
    deadline = time.monotonic() + 60
    while min(len(r.output) for r in reqs) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.pause("in_place")  # returns between steps: the counts below are exact
    load = engine.load_report()
    assert (load.running, load.waiting, load.paused) == (3, 0, 3)
    assert load.resident_tokens == sum(len(r.prompt) + len(r.output) for r in reqs)
    steps = len(reqs[0].output) - 1  # the first token came from the prefill
    moments = [a - b for a, b in zip(engine.stats.decode_moments(), moments0)]
    assert moments[0] == steps and moments[1] == 3 * steps and moments[5] == 3 * steps
    assert engine.stats.prefill_totals()[0] - prefill0 == 4 + 6

    engine.abort(abort_all=True)
    engine.resume()
    for r in reqs:
        assert r.future.result(timeout=60)["meta_info"]["finish_reason"]["type"] == "abort"
    assert engine.load_report().running == 0


def test_requests_submitted_together_run_in_one_batch(engine):
    reqs = _requests([[3, 4, 5]] * 5, max_new_tokens=4)
    before = engine.stats.decode_moments() or [0.0] * 6
    for f in engine.submit_many(reqs):
        f.result(timeout=60)
    after = engine.stats.decode_moments()
    assert [after[i] - before[i] for i in (0, 1)] == [3, 15]  # 3 decode steps of all 5
    with pytest.raises(ValueError, match="already in flight"):
        engine.submit_many(_requests([[1]], 4) * 2)


# ---- rows, selection, parsing --------------------------------------------------------------------------
def test_load_row_sections_are_selected_as_sglang_selects_them(engine):
    row = load_report.load_row(engine)
    sections = {"memory", "disaggregation", "queues"}
    assert sections <= set(row) and "speculative" not in row and "lora" not in row
    core = load_report.select(row, {"core"})
    assert not sections & set(core) and core["num_used_tokens"] == row["num_used_tokens"]
    assert set(load_report.select(row, {"memory", "queues"})) == set(core) | {"memory", "queues"}
    assert load_report.select(row, None) == load_report.select(row, {"all"}) == row
    assert load_report.parse_include("core, disagg") == {"core", "disagg"}
    with pytest.raises(ValueError, match="Invalid include sections"):
        load_report.parse_include("core,everything")


def test_prometheus_text_has_one_gauge_per_numeric_field():
    row = {
        "timestamp": 1.5,
        "dp_rank": 0,
        "num_running_reqs": 2,
        "decode_moments": None,
        "disaggregation": {"mode": "null", "kv_transfer_latency_ms": 0.5},
        "queues": {"waiting": 3},
    }
    assert load_report.prometheus_text([row]).splitlines() == [
        "# TYPE sglang_timestamp gauge",
        'sglang_timestamp{dp_rank="0"} 1.5',
        "# TYPE sglang_num_running_reqs gauge",
        'sglang_num_running_reqs{dp_rank="0"} 2',
        "# TYPE sglang_disagg_kv_transfer_latency_ms gauge",
        'sglang_disagg_kv_transfer_latency_ms{dp_rank="0"} 0.5',
        "# TYPE sglang_queues_waiting gauge",
        'sglang_queues_waiting{dp_rank="0"} 3',
    ]


def test_parse_loads_reads_the_fields_policies_need_and_names_a_bad_one(engine):
    row = load_report.load_row(engine)
    row.update(num_running_reqs=3, num_waiting_reqs=1, num_used_tokens=120, gen_throughput=42.5)
    load = payloads.parse_loads({"loads": [row]})
    assert (load.running, load.waiting, load.kv_tokens, load.throughput) == (3, 1, 120, 42.5)
    assert load.kv_capacity == engine.max_batch * engine.max_context
    for bad, field in (
        ({**row, "num_used_tokens": "many"}, "num_used_tokens"),
        ({k: v for k, v in row.items() if k != "max_total_num_tokens"}, "max_total_num_tokens"),
        ({**row, "decode_moments": [1.0]}, "decode_moments"),
    ):
        with pytest.raises(ValueError, match=field):
            payloads.parse_loads({"loads": [bad]}, server="http://s")
    with pytest.raises(ValueError, match="no load row"):
        payloads.parse_loads({"loads": []})


# ---- the registry ------------------------------------------------------------------------------------------
def test_registry_keeps_each_servers_last_load_for_the_policies():
    clock = FakeClock(5.0)
    reg = ServerRegistry(["http://a", "http://b/"], clock=clock)
    woken = threading.Event()
    reg.add_listener(woken.set)
    reg.update_load(
        "http://a",
        ServerLoad(
            running=4,
            waiting=2,
            kv_tokens=300,
            kv_capacity=1200,
            throughput=80.0,
            token_usage=0.25,
            max_running_requests=16,
        ),
    )
    assert woken.is_set()
    a, b = reg.records_snapshot()
    assert (a.running, a.waiting, a.kv_tokens, a.kv_capacity, a.throughput, a.load_time) == (4, 2, 300, 1200, 80.0, 5.0)
    assert b.load_time is None and b.kv_capacity == 0
    a.running = 99  # a copy: the registry is not changed through it
    assert reg.records_snapshot()[0].running == 4
    status = reg.statuses()[0]
    assert (status.waiting, status.throughput, status.kv_cache) == (2, 80.0, 0.25)
    reg.load_failed("http://a", "refused")
    a = reg.records_snapshot()[0]
    assert a.load_error == "refused" and a.kv_tokens == 300  # last values kept, marked


def test_poll_interval_follows_the_config():
    from megatron_dapo.config.errors import ConfigError
    from megatron_dapo.config.load import config_from_dict
    from megatron_dapo.config.validate import validate_config
    from megatron_dapo.coordinator.load_poller import poll_interval_s

    assert poll_interval_s(config_from_dict({}).rollout) is None
    assert poll_interval_s(config_from_dict({"rollout": {"loads": {"interval_ms": 50}}}).rollout) == 0.05
    with pytest.raises(ConfigError, match=r"rollout\.loads\.interval_ms=-1\.0 must be >= 0"):
        validate_config(config_from_dict({"rollout": {"loads": {"interval_ms": -1}}}))


# ---- the fit -----------------------------------------------------------------------------------------------
def _grid(model: CostModel, ns=(1, 2, 4, 8, 16, 32, 64, 128, 256), prompts=(256, 1024, 4096), noise=0.0, seed=0):
    rng = random.Random(seed)
    return [
        ProfilePoint(n, n * (p + 32), model.step_time(n, n * (p + 32)) * (1 + rng.gauss(0, noise)), 63)
        for n in ns
        for p in prompts
    ]


def _identifiable(m: CostModel) -> tuple[float, ...]:
    """What step times determine: the constant, the floor, and the two slopes (a_b vs o_b is a convention)."""
    return m.a_b + m.o_b, m.a_b + m.o_thr, m.a_k, m.o_k


@pytest.mark.parametrize(
    "truth",
    [
        QWEN_7B_1GPU,
        CostModel(a_b=0.0, a_k=2e-7, o_thr=0.004, o_b=0.004, o_k=0.0005),  # no flat part
        CostModel(a_b=0.001, a_k=0.0, o_thr=0.01, o_b=0.001, o_k=1e-4),  # flat up to n = 90
    ],
)
def test_fit_recovers_known_coefficients(truth):
    fitted, err = fit_cost_model(_grid(truth))
    assert err < 1e-5
    assert _identifiable(fitted) == pytest.approx(_identifiable(truth), rel=1e-3, abs=1e-12)


def test_fit_with_measurement_noise_stays_close():
    points = _grid(QWEN_7B_1GPU, noise=0.02, seed=3)
    fitted, err = fit_cost_model(points)
    assert 0.005 < err < 0.04 and err == pytest.approx(relative_error(fitted, points))
    for n, k in ((1, 1000), (16, 16 * 2000), (128, 128 * 4000), (256, 256 * 300)):
        assert fitted.step_time(n, k) == pytest.approx(QWEN_7B_1GPU.step_time(n, k), rel=0.05)
    table = format_table(fitted, points)
    assert len(table.splitlines()) == len(points) + 1 and "measured ms" in table


def test_fit_refuses_a_grid_that_cannot_tell_the_slopes_apart():
    one_prompt_len = _grid(QWEN_7B_1GPU, prompts=(512,))
    with pytest.raises(ValueError, match="context per request"):
        fit_cost_model(one_prompt_len)
    with pytest.raises(ValueError, match="at least 3"):
        fit_cost_model(one_prompt_len[:2])
    with pytest.raises(ValueError, match="step time > 0"):
        fit_cost_model([ProfilePoint(1, 10, 0.0)] * 3)
