import json
import math

import pytest

from megatron_dapo.config.cost_model import QWEN_7B_1GPU, CostModel


def test_step_time_and_throughput_follow_the_formula():
    m = CostModel(a_b=0.002, a_k=1e-7, o_thr=0.006, o_b=0.003, o_k=0.0001)
    # memory-bound floor: o_b + o_k * n = 0.0031 < o_thr
    assert m.step_time(1, 1000) == pytest.approx(0.002 + 1e-4 + 0.006)
    # compute bound: 0.003 + 0.0001 * 100 = 0.013 > o_thr
    assert m.step_time(100, 0) == pytest.approx(0.002 + 0.013)
    assert m.throughput(100, 0) == pytest.approx(100 / 0.015)
    assert m.throughput(0, 0) == 0.0
    # a request's marginal gain shrinks as the engine fills (what throughput_optimal routing uses)
    gain = lambda n: m.throughput(n + 1, 500 * (n + 1)) - m.throughput(n, 500 * n)
    assert gain(1) > gain(50) > 0


def test_save_load_roundtrip_and_errors(tmp_path):
    p = tmp_path / "cost.json"
    QWEN_7B_1GPU.save(p, fit_rel_error=0.03)
    assert json.loads(p.read_text())["fit_rel_error"] == 0.03
    assert CostModel.load(p) == QWEN_7B_1GPU
    p.write_text(json.dumps({"a_b": 1.0}))
    with pytest.raises(ValueError, match="missing coefficient"):
        CostModel.load(p)
    p.write_text(json.dumps({**QWEN_7B_1GPU.to_dict(), "o_k": -1}))
    with pytest.raises(ValueError, match="o_k"):
        CostModel.load(p)
    with pytest.raises(ValueError, match="finite"):
        CostModel(a_b=math.nan, a_k=0, o_thr=0, o_b=0, o_k=0)
