"""Context parallelism: the load-balanced split of packed micro-batches (in process) and the CP actor
under torchrun (numbers asserted in tests/workers/cp_checks.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.trainer.cp_split import load_balanced_index, split_micro_batch
from megatron_dapo.trainer.packing import pack


def test_load_balanced_index_keeps_chunks_r_and_2cp_minus_1_minus_r_of_each_sequence():
    cu = torch.tensor([0, 8, 12])  # segments of 8 and 4 tokens, cp=2: chunks of 2 and 1
    assert load_balanced_index(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert load_balanced_index(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    with pytest.raises(ValueError, match="not a multiple of 2\\*cp = 4"):
        load_balanced_index(torch.tensor([0, 6]), 2, 0)


def test_split_micro_batch_mask_is_the_packed_block_causal_mask_in_gathered_order():
    seqs = [[10, 11, 12, 13, 14], [20, 21, 22]]
    mb = pack(seqs, [2, 1], rows=[0, 1], length=16, seq_multiple=4)
    assert mb.cu_seqlens.tolist() == [0, 8, 12, 16]  # 5 -> 8, 3 -> 4, then a padding segment of 4
    assert mb.position_ids[0, :12].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    full = mb.attention_mask()[0, 0]
    parts = [split_micro_batch(mb, 2, r) for r in range(2)]
    order = torch.cat([p.index for p in parts])
    assert sorted(order.tolist()) == list(range(16)) and torch.equal(parts[0].order, order)
    for p in parts:
        assert torch.equal(p.attention_mask()[0, 0], full[p.index][:, order])
        assert torch.equal(p.tokens, mb.tokens[:, p.index]) and torch.equal(p.target_ids, mb.target_ids[:, p.index])
    with pytest.raises(ValueError, match="not a multiple of 4"):
        pack(seqs, [2, 1], rows=[0, 1], length=14, seq_multiple=4)


@pytest.mark.slow
@pytest.mark.torchrun_checks(2, ["cp_checks:logprobs_cp2", "cp_checks:train_cp2", "cp_checks:moe_cp2_ep2"], timeout=420)
def test_cp2_logprobs_match_hf_decoder_sees_its_share_and_step_equals_one_process(torchrun_checks):
    torchrun_checks()


@pytest.mark.slow
@pytest.mark.torchrun_checks(4, ["cp_checks:logprobs_cp2_tp2"], timeout=420)
def test_cp2_tp2_logprobs_match_hf_at_4_ranks(torchrun_checks):
    torchrun_checks()


def test_cp_config_is_accepted_and_cp_comm_type_refused_where_it_would_be_ignored():
    from megatron_dapo.config import ConfigError, load_config
    from tests.config.test_config import TINY

    cfg = load_config(TINY, ["parallel.tp=1", "parallel.cp=2"])
    assert cfg.parallel.cp == 2 and cfg.parallel.cp_comm_type is None
    assert load_config(TINY, ["parallel.tp=1", "parallel.cp=2", "parallel.cp_comm_type=all_gather"])
    refusals = [
        (["parallel.cp_comm_type=p2p"], "parallel.cp_comm_type=p2p applies to parallel.cp > 1 only"),
        (["parallel.tp=1", "parallel.cp=2", "parallel.cp_comm_type=a2a"], "needs model.transformer_impl"),
        (["trainer.backend=fsdp2", "parallel.tp=1", "parallel.cp=2"], "set parallel.cp=2 to 1"),
        (["parallel.tp=1", "parallel.cp=2", "parallel.cp_comm_type=ring"], "parallel.cp_comm_type"),
    ]
    for overrides, expected in refusals:
        with pytest.raises(ConfigError) as err:
            load_config(TINY, overrides)
        assert expected in str(err.value), str(err.value)


def test_plan_divides_a_rank_s_activations_along_the_sequence_by_cp():
    from megatron_dapo.config import load_config
    from megatron_dapo.config.shapes import resolve_model_shape
    from megatron_dapo.planner.memory import training_memory
    from tests.config.test_config import TINY

    def memory(cp):
        cfg = load_config(TINY, ["parallel.tp=1", f"parallel.cp={cp}", "trainer.gpus_per_node=4"])
        return training_memory(cfg, resolve_model_shape(cfg.model).shape)[0]

    one, two = memory(1), memory(2)
    assert two.activations * 2 == pytest.approx(one.activations, rel=1e-6) and two.activations > 0
    assert two.logits * 2 == pytest.approx(one.logits, rel=1e-6)
    assert two.params == one.params  # CP replicates the weights
