"""Simulator realism (issue 25): engines of uneven speed and KV pool, transient slowdowns, lengths by
mean and cap share, the trainer and weight sync from the hardware, seeds, and the analytic ceiling."""

from __future__ import annotations

import asyncio

import pytest

from megatron_dapo.config.cost_model import CostModel
from megatron_dapo.sim.engine import SimEngine
from megatron_dapo.sim.vtime import run_virtual

COST = CostModel(a_b=2e-3, a_k=1e-6, o_thr=5e-3, o_b=1e-3, o_k=0.5e-3)


def test_a_retracted_then_readmitted_request_decodes_all_its_tokens():
    """One of two requests is retracted at step 15 with 15 tokens and readmitted when the other is
    aborted (step 18); it needs 15 more steps: it must not finish at its first admission's finish
    step (30)."""

    async def main():
        loop = asyncio.get_running_loop()
        engine = SimEngine(COST, kv_capacity=130, max_running=8, loop=loop)
        futures = {rid: engine.submit(rid, 50, 30) for rid in ("a", "b")}
        t18 = sum(COST.step_time(2, 100 + 2 * k) for k in range(15)) + sum(COST.step_time(1, 65 + k) for k in range(3))
        await asyncio.sleep(t18 - 1e-9)  # mid-step 18 of "old" alone
        (running,) = engine.running
        engine.abort(running)
        r_aborted = await futures.pop(running)
        r_readmitted = await futures.popitem()[1]
        return engine, r_aborted, r_readmitted, t18, loop.time()

    engine, r_aborted, r_readmitted, t18, end = run_virtual(main())
    assert engine.stats.retractions == 1 and r_aborted.aborted and r_aborted.generated == 18
    assert not r_readmitted.aborted and r_readmitted.generated == 30
    assert engine.stats.tokens == 18 + 30  # every token it reports was decoded
    readmitted = sum(COST.step_time(1, 65 + k) for k in range(15))  # 50 input + 15 kept, 15 steps
    assert end == pytest.approx(t18 + readmitted, rel=1e-9)
