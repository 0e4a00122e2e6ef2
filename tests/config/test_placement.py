"""trainer.placement and optimizer.cpu_offload: what a colocated run and megatron-core's CPU offload
refuse, by name, and what they derive."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_dapo.config import ConfigError, derived, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "qwen3"
TINY = CONFIGS / "tiny_qwen3_cpu.yaml"  # 2 trainer ranks, 2 embedded servers
COLOCATED = ["trainer.placement=colocated", "algo.staleness=0", "rollout.sync.pause_mode=abort"]


def _error(path, overrides) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_split_is_the_default_and_colocated_loads_when_synchronous():
    assert load_config(TINY, []).trainer.placement == "split"
    cfg = load_config(TINY, COLOCATED)
    assert derived.colocated(cfg) and derived.colocated_servers(cfg) == 2


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["algo.staleness=1"], "trainer.placement=colocated needs algo.staleness=0 (got 1)"),
        (["rollout.sync.pause_mode=in_place"], "needs rollout.sync.pause_mode=abort (got in_place)"),
        (["rollout.sync.pause_mode=retract"], "needs rollout.sync.pause_mode=abort (got retract)"),
        (["rollout.sync.policy=greedy"], "needs rollout.sync.policy=all_at_once (got greedy)"),
        (["rollout.num_servers=1"], "rollout.num_servers=1 must be 2, one server per rollout.server_tp=1"),
        (["rollout.servers=[http://127.0.0.1:3000]"], "external rollout.servers cannot share them"),
    ],
)
def test_colocated_refuses_what_needs_separate_engines(overrides, expected):
    assert expected in _error(TINY, [*COLOCATED, *overrides])


def test_colocated_sglang_servers_take_the_trainer_gpus():
    # 1 node x 8 GPUs: all 8 train, 2 SGLang servers of TP 4 on the same GPUs (none reserved for them)
    cfg = load_config(CONFIGS / "qwen3_30b_a3b_colocated.yaml", [])
    assert derived.launched_rollout_gpus(cfg) == 0
    assert derived.trainer_world_size(cfg) == 8 and derived.colocated_servers(cfg) == 2
    assert "rollout.server_tp=3 must divide trainer.gpus_per_node=8" in _error(
        CONFIGS / "qwen3_30b_a3b_colocated.yaml", ["rollout.server_tp=3"]
    )


def test_the_issue_command_on_the_split_yaml_names_what_colocated_needs():
    msg = _error(
        CONFIGS / "qwen3_30b_a3b.yaml",
        ["trainer.nnodes=1", "trainer.placement=colocated", "optimizer.cpu_offload=true"],
    )
    assert "algo.staleness=0 (got 3)" in msg and "pause_mode=abort" in msg and "num_servers=4 must be 2" in msg


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["optimizer.offload_fraction=0.5"], "optimizer.offload_fraction=0.5 applies only with optimizer.cpu_offload"),
        (["optimizer.cpu_offload=true", "optimizer.offload_fraction=1.5"], "offload_fraction=1.5 must be in [0, 1]"),
        (
            ["optimizer.cpu_offload=true", "optimizer.use_distributed_optimizer=false"],
            "optimizer.cpu_offload=true needs optimizer.use_distributed_optimizer=true",
        ),
        (
            ["optimizer.cpu_offload=true", "trainer.backend=fsdp2", "parallel.tp=1"],
            "optimizer.cpu_offload=true needs trainer.backend=megatron",
        ),
    ],
)
def test_cpu_offload_rules(overrides, expected):
    assert expected in _error(TINY, overrides)


def test_cpu_offload_loads_in_both_placements():
    assert load_config(TINY, ["optimizer.cpu_offload=true", "optimizer.offload_fraction=0.25"]).optimizer.cpu_offload
    assert load_config(TINY, [*COLOCATED, "optimizer.cpu_offload=true"]).optimizer.offload_fraction == 1.0


def test_torchrun_launches_the_servers_of_a_colocated_run_itself():
    """Split under torchrun needs external servers; colocated refuses them and the ranks launch their own."""
    one_node = CONFIGS / "qwen3_30b_a3b_colocated.yaml"
    assert load_config(one_node, ["trainer.launcher=torchrun"]).trainer.launcher == "torchrun"
    assert "trainer.launcher=torchrun starts no SGLang servers" in _error(
        CONFIGS / "qwen3_8b.yaml", ["trainer.launcher=torchrun"]
    )
