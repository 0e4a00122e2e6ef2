"""`plan`, `simulate` and `profile-engine` take one definition of the cluster flags
(megatron_dapo.planner.cluster_args): the same names, types, choices and defaults everywhere."""

import argparse

import pytest

from megatron_dapo.apps.plan import build_parser as plan_parser
from megatron_dapo.apps.profile_engine import build_parser as profile_parser
from megatron_dapo.planner.cluster_args import CLUSTER_FLAGS, add_cluster_args
from megatron_dapo.sim.cli import build_parser as simulate_parser

PARSERS = {"plan": plan_parser, "simulate": simulate_parser, "profile-engine": profile_parser}


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions}


def _shape(action: argparse.Action) -> tuple:
    kind = getattr(action.type, "__name__", action.type)  # runtime.cli_args.number names its range
    return (tuple(action.option_strings), action.default, kind, action.choices, action.nargs, action.metavar)


def _reference() -> dict[str, argparse.Action]:
    parser = argparse.ArgumentParser()
    add_cluster_args(parser)
    return _actions(parser)


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_plan_and_simulate_define_every_cluster_flag_as_the_shared_definition(command):
    actions, reference = _actions(PARSERS[command]()), _reference()
    assert set(CLUSTER_FLAGS) <= set(reference)
    for dest in CLUSTER_FLAGS:
        assert dest in actions, f"{command} lacks {dest}"
        assert _shape(actions[dest]) == _shape(reference[dest]), f"{command} {dest}"


def test_profile_engine_defines_no_cluster_flag_of_its_own():
    """It measures one server: none of the cluster's flags, so none that could drift from the others."""
    reference_options = {o for dest in CLUSTER_FLAGS for o in _reference()[dest].option_strings}
    options = {o for a in profile_parser()._actions for o in a.option_strings}
    assert not options & reference_options


def test_plan_and_simulate_parse_the_cluster_flags_to_the_same_values():
    argv = ["c.yaml", "a.b=1", "--nodes", "4", "--gpus-per-node", "8", "--gpu-mem-gib", "141", "--trainer-gpu", "h200"]
    argv += ["--mfu", "0.4"]
    plan = vars(plan_parser().parse_intermixed_args(argv))
    simulate = vars(simulate_parser().parse_intermixed_args(argv))
    assert {k: plan[k] for k in CLUSTER_FLAGS} == {k: simulate[k] for k in CLUSTER_FLAGS}
    assert plan["nodes"] == 4 and plan["gpu_mem_gib"] == 141.0 and plan["overrides"] == ["a.b=1"]


def test_plan_requires_the_cluster_shape_and_simulate_keeps_the_configs():
    with pytest.raises(SystemExit):
        plan_parser().parse_intermixed_args(["c.yaml"])
    assert simulate_parser().parse_intermixed_args(["c.yaml"]).nodes is None
