"""Packing plans and packed tensors (no megatron-core needed)."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.shards import split_groups_over_ranks
from megatron_dapo.trainer.packing import IGNORE_INDEX, block_causal_mask, pack, plan_micro_batches


def test_plan_respects_budget_and_keeps_every_sequence():
    lengths = [7, 3, 9, 2, 5, 5, 1, 8]
    plan = plan_micro_batches(lengths, max_tokens=10)
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in plan)
    assert len(plan) == 4  # 40 tokens: first-fit decreasing fills 4 bins of 10 exactly


def test_plan_oversized_sequence_alone_and_min_count():
    plan = plan_micro_batches([30, 2, 2], max_tokens=10)
    assert [0] in plan and sorted(i for b in plan for i in b) == [0, 1, 2]
    plan = plan_micro_batches([2, 2], max_tokens=10, min_count=4)
    assert len(plan) == 4 and sorted(i for b in plan for i in b) == [0, 1] and plan.count([]) == 2
    with pytest.raises(ValueError, match="max_tokens"):
        plan_micro_batches([1], max_tokens=0)


def test_pack_targets_positions_and_mask():
    seqs = [[10, 11, 12, 13], [20, 21, 22], [30, 31]]
    prompts = [2, 1, 2]  # the last one has no response tokens
    mb = pack(seqs, prompts, rows=[0, 1, 2], length=12)
    assert mb.tokens[0, :9].tolist() == [10, 11, 12, 13, 20, 21, 22, 30, 31]
    assert mb.position_ids[0, :9].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1]
    assert mb.cu_seqlens.tolist() == [0, 4, 7, 9, 12]
    # Response token k of a sequence is predicted one position earlier, inside the same sequence.
    assert mb.target_ids[0, 1].item() == 12 and mb.target_ids[0, 2].item() == 13
    assert mb.target_ids[0, 4].item() == 21 and mb.target_ids[0, 5].item() == 22
    assert (mb.target_ids[0, [0, 3, 6, 7, 8, 9, 10, 11]] == IGNORE_INDEX).all()
    assert mb.target_valid.sum(1).tolist() == [2, 2, 0]
    vals = torch.arange(12.0)[None]
    assert mb.gather(vals)[0].tolist() == [1.0, 2.0] and mb.gather(vals)[1].tolist() == [4.0, 5.0]
    mask = mb.attention_mask()[0, 0]
    allowed = ~mask
    assert allowed[3, 0] and not allowed[4, 3] and allowed[6, 4] and not allowed[0, 1]  # causal, block-diagonal
    assert allowed.diagonal().all()  # padding rows attend to themselves: no empty softmax rows
    assert torch.equal(block_causal_mask(mb.cu_seqlens, 12), mb.attention_mask())


def test_pack_errors_and_empty():
    with pytest.raises(ValueError, match="do not fit"):
        pack([[1, 2, 3]], [1], [0], length=2)
    with pytest.raises(ValueError, match="prompt length 0"):
        pack([[1, 2, 3]], [0], [0])
    empty = pack([[1, 2]], [1], [], length=4)
    assert empty.rows == [] and (empty.target_ids == IGNORE_INDEX).all() and empty.num_tokens == 0


def test_split_groups_keeps_groups_whole_and_balances():
    groups = [0, 0, 1, 1, 2, 2, 3, 3]
    tokens = [10, 10, 1, 1, 9, 9, 2, 2]
    ranks = split_groups_over_ranks(groups, tokens, [0, 1, 2, 3], dp=2)
    assert sorted(r for rs in ranks for r in rs) == list(range(8))
    for rs in ranks:
        for g in {groups[r] for r in rs}:
            assert all(r in rs for r in range(8) if groups[r] == g)
    loads = [sum(tokens[r] for r in rs) for rs in ranks]
    assert abs(loads[0] - loads[1]) <= 6
