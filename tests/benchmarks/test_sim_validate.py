"""benchmarks/sim_validate.py's reading of a real run: each server's pace from its step trace against the cost
fit (what the simulation of that run gives each engine)."""

import json

import pytest

from benchmarks.sim_validate import measured_speeds
from megatron_dapo.config.cost_model import CostModel

COST = CostModel(a_b=0.002, a_k=1e-6, o_thr=0.0, o_b=0.001, o_k=0.0005)


def _trace(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"t": 9.9, "kind": "dec')  # torn last line
    return str(path)


def test_each_server_paced_by_its_traced_decode_steps_against_the_fit(tmp_path):
    shapes = [(1, 10, 100), (2, 4, 800), (3, 12, 3000)]  # (t, n, kv)
    fast = [{"t": t, "kind": "decode", "n": n, "kv": kv, "s": COST.step_time(n, kv)} for t, n, kv in shapes]
    slow = [dict(r, s=r["s"] / 0.45) for r in fast]
    prefill = {"t": 2.5, "kind": "prefill", "n": 4, "tokens": 400, "s": 5.0}  # not a decode step
    outside = {"t": 7.0, "kind": "decode", "n": 1, "kv": 10, "s": 100.0}  # after the window
    paths = [_trace(tmp_path / "s0.jsonl", [*fast, prefill, outside]), _trace(tmp_path / "s1.jsonl", slow)]
    assert measured_speeds(paths, 0.5, 5.0, COST) == pytest.approx((1.0, 0.45))
    # a server with no decode step in the window keeps the model's pace
    assert measured_speeds(paths, 5.5, 6.5, COST) == (1.0, 1.0)
