"""Rollout routing replay (R3), items 3-5: the actor replays the rollout's routed experts with megatron-core's
RouterReplay. EP=2 and PP=2 steps with replay and full recompute against a forced-routing HF reference are
in tests/trainer/test_megatron_engine.py (moe_ep2, moe_replay_pp2); the tiny MoE config's end-to-end run in
tests/coordinator/test_routing_replay_data.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.trainer.packing import pack
from megatron_dapo.trainer.routing_replay import filler_rows, local_slice, packed_routing
from megatron_dapo.types import RolloutBatch, RoutingShape
from tests.dist_utils import run_torchrun

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "qwen3"
SHAPE = RoutingShape(num_layers=3, moe_layers=(1, 2), top_k=2, num_experts=8)


def _batch(lengths: list[int]) -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    ids = [list(range(n)) for n in lengths]
    routed = [torch.rand(n - 1, 2, 8, generator=g).topk(2, dim=-1).indices.to(torch.uint8) for n in lengths]
    n = len(lengths)
    return RolloutBatch(
        input_ids=ids,
        prompt_lengths=[2] * n,
        response_lengths=[k - 2 for k in lengths],
        advantages=torch.zeros(n),
        rollout_logprobs=[[0.0] * (k - 2) for k in lengths],
        response_loss_mask=[1] * n,
        token_versions=[[0] * (k - 2) for k in lengths],
        group_index=torch.arange(n),
        temperature=1.0,
        step=0,
        prompt_indices=list(range(n)),
        routed_experts=routed,
    )


def test_packed_routing_follows_the_packed_tokens_with_filler_rows_for_last_tokens_and_padding():
    batch = _batch([5, 3, 6])
    mb = pack(batch.input_ids, batch.prompt_lengths, [2, 0], length=14)
    rows, scored = packed_routing(batch, mb, SHAPE)
    assert rows.shape == (14, 2, 2) and rows.dtype == torch.int64
    assert torch.equal(rows[0:5], batch.routed_experts[2].long())  # row 2 first (6 tokens, 5 rows)
    assert torch.equal(rows[6:10], batch.routed_experts[0].long())
    filler = [5, 10, 11, 12, 13]  # each sequence's last token, then padding
    assert torch.equal(rows[filler], filler_rows(torch.tensor(filler), 8, 2)[:, None].expand(5, 2, 2))
    assert scored.tolist() == [i not in filler for i in range(14)]
    # sequence parallelism: each TP rank routes its contiguous share of the packed row
    assert local_slice(14, 1, 2, sequence_parallel=True) == slice(7, 14)
    assert local_slice(14, 1, 2, sequence_parallel=False) == slice(0, 14)
    batch.routed_experts[0] = batch.routed_experts[0][1:]
    with pytest.raises(ValueError, match=r"routed_experts row 0: shape \(3, 2, 2\), expected \(4, 2, 2\)"):
        packed_routing(batch, mb, SHAPE)


def test_fsdp2_refuses_moe_routing_replay_by_name():
    with pytest.raises(ConfigError, match="trainer.backend=fsdp2 does not replay the rollout's routing"):
        load_config(CONFIGS / "tiny_qwen3_moe_cpu.yaml", ["trainer.backend=fsdp2", "parallel.ep=1"])
    cfg = load_config(
        CONFIGS / "tiny_qwen3_moe_cpu.yaml", ["trainer.backend=fsdp2", "parallel.ep=1", "algo.routing_replay=none"]
    )
    assert cfg.algo.routing_replay == "none"


@pytest.mark.slow
def test_replay_gives_the_servers_logprobs_where_the_trainers_router_flipped(tmp_path):
    """A real embedded server on W0, a trainer on W1 whose router flips some tokens' experts: replayed
    logprobs equal the server's (< 1e-5) on every token, own-routed ones differ on the flipped tokens,
    and actor/routing_agreement equals HF's share (tests/workers/routing_replay_checks.py)."""
    out = run_torchrun("routing_replay_checks.py", 1, str(tmp_path), timeout=400)
    assert "CHECK PASSED routing_replay" in out, out[-4000:]
