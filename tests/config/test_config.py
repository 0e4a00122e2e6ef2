"""Config system: typed overrides, one-line errors naming keys, cross-field rules, round trip."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_dapo.config import (
    ConfigError,
    DapoConfig,
    config_from_dict,
    config_to_dict,
    derived,
    dump_yaml,
    load_config,
)
from megatron_dapo.config.shapes import BUILTIN_HF_CONFIGS, resolve_model_shape, shape_from_hf
from megatron_dapo.config.validate import validate_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs" / "qwen3"
TINY = CONFIGS / "tiny_qwen3_cpu.yaml"
TINY_MOE = CONFIGS / "tiny_qwen3_moe_cpu.yaml"
ALL_CONFIGS = sorted(CONFIGS.glob("*.yaml"))


def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg


# ------------------------------------------------------------------------------------------ defaults


def test_defaults_are_dapo():
    cfg = DapoConfig()
    a, o = cfg.algo, cfg.optimizer
    assert (a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c) == (0.2, 0.28, 10.0)  # c: DAPO recipe scripts
    assert a.loss_agg_mode == "token-mean"
    assert (a.filter_groups.enable, a.filter_groups.metric, a.filter_groups.max_num_gen_batches) == (True, "acc", 10)
    assert (a.overlong_buffer.enable, a.overlong_buffer.len, a.overlong_buffer.penalty_factor) == (True, 4096, 1.0)
    assert (a.train_batch_size, a.ppo_mini_batch_size, a.staleness, a.kl_coef) == (512, 32, 3, 0.0)
    assert (o.lr, o.lr_warmup_steps, o.weight_decay, o.clip_grad) == (1e-6, 10, 0.1, 1.0)
    assert cfg.rollout.n_resp_per_prompt == 8
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (2048, 20480)


def _cost_model_overrides(path: Path, tmp_path: Path) -> list[str]:
    """The advanced configs route by a cost model that the user fits (`profile-engine`) and the launcher
    passes in; stand in a real cost model file for them."""
    if not path.name.startswith("advanced_"):
        return []
    from megatron_dapo.config.cost_model import QWEN_7B_1GPU

    QWEN_7B_1GPU.save(tmp_path / "cost_model.json")
    return [f"rollout.routing.cost_model={tmp_path / 'cost_model.json'}"]


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path, tmp_path):
    overrides = _cost_model_overrides(path, tmp_path)
    if overrides:  # without its cost model an advanced config names exactly what is missing
        with pytest.raises(ConfigError) as err:
            load_config(path)
        assert "needs rollout.routing.cost_model" in _one_line(err)
    cfg = load_config(path, overrides)
    assert validate_config(cfg) == []  # every shipped config resolves a model shape (no skipped checks)


# ----------------------------------------------------------------------------------------- overrides


def test_overrides_are_typed():
    cfg = load_config(
        TINY,
        [
            "algo.clip_ratio_high=0.3",
            "optimizer.lr=2e-6",  # YAML 1.1 reads `2e-6` as a string; a float field takes it as a number
            "algo.clip_ratio_c=3",  # int into Optional[float]
            "parallel.vpp=null",
            "algo.filter_groups.enable=false",
            "rollout.servers=[http://127.0.0.1:30000,http://127.0.0.1:30001]",
            "rollout.sampling.stop_token_ids=[1, 2]",
            "logging.run_dir=007",  # a str field keeps the text as written
            "rollout.api_key=secret",
            "reward.kwargs={answer_key: final}",
            "algo.overlong_buffer={len: 16}",  # a mapping updates the section field by field
        ],
        validate=False,
    )
    assert cfg.algo.clip_ratio_high == 0.3 and isinstance(cfg.algo.clip_ratio_high, float)
    assert cfg.optimizer.lr == 2e-6
    assert cfg.algo.clip_ratio_c == 3.0 and isinstance(cfg.algo.clip_ratio_c, float)
    assert cfg.parallel.vpp is None
    assert cfg.algo.filter_groups.enable is False
    assert cfg.rollout.servers == ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]
    assert cfg.rollout.sampling.stop_token_ids == [1, 2]
    assert cfg.logging.run_dir == "007"
    assert cfg.rollout.api_key == "secret"
    assert cfg.reward.kwargs == {"answer_key": "final"}
    assert (cfg.algo.overlong_buffer.len, cfg.algo.overlong_buffer.enable) == (16, True)


def test_yaml_file_values_override_defaults_and_keep_the_rest():
    raw = yaml.safe_load(TINY.read_text())
    cfg = load_config(TINY)
    assert cfg.parallel.tp == raw["parallel"]["tp"] == 2
    assert cfg.rollout.engine == "embedded"
    assert cfg.algo.clip_ratio_high == 0.28  # not in the file: the DAPO default
    assert cfg.optimizer.lr == 1e-4


@pytest.mark.parametrize(
    "override, expected",
    [
        ("algo.clip_ratio_hgh=0.3", "unknown key 'algo.clip_ratio_hgh' (did you mean 'algo.clip_ratio_high'?)"),
        ("algo.filter_groups.metrc=acc", "'algo.filter_groups.metrc' (did you mean 'algo.filter_groups.metric'?)"),
        ("trainer.lr=1e-5", "unknown key 'trainer.lr' (did you mean 'optimizer.lr'?)"),
        ("paralel.tp=2", "unknown key 'paralel' (did you mean 'parallel'?)"),
    ],
)
def test_unknown_key_names_path_and_suggestion(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [override])
    assert expected in _one_line(err)


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(TINY.read_text().replace("  n_resp_per_prompt: 4", "  n_resp_per_promt: 4"))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "'rollout.n_resp_per_promt' (did you mean 'rollout.n_resp_per_prompt'?)" in _one_line(err)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("algo.clip_ratio_high=abc", "algo.clip_ratio_high: expected float, got str 'abc'"),
        ("parallel.tp=2.5", "parallel.tp: expected int, got float 2.5"),
        ("rollout.sync.policy=eager", "rollout.sync.policy: expected one of 'all_at_once' | 'greedy' | 'status_based'"),
        ("parallel.tp=true", "parallel.tp: expected int, got bool True"),
        ("parallel.sequence_parallel=1", "parallel.sequence_parallel: expected bool, got int 1"),
        ("rollout.servers=http://a:1", "rollout.servers: expected list[str], got str"),
        ("rollout.sampling.stop_token_ids=[1, x]", "rollout.sampling.stop_token_ids[1]: expected int, got str 'x'"),
        ("parallel.vpp=two", "parallel.vpp: expected int | null, got str 'two'"),
        (
            "rollout.engine=sglng",
            "rollout.engine: expected one of 'sglang' | 'embedded', got str 'sglng' (did you mean 'sglang'?)",
        ),
        ("algo.filter_groups=3", "algo.filter_groups: expected mapping, got int 3"),
        ("algo.staleness.x=1", "'algo.staleness' is a value, not a section"),
        ("algo.staleness", "is not of the form key.sub=value"),
    ],
)
def test_wrong_type_names_path_got_expected(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [override])
    assert expected in _one_line(err)


def test_bad_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  hf_path: [unclosed\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert str(bad) in _one_line(err) and "invalid YAML" in str(err.value)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    top = tmp_path / "list.yaml"
    top.write_text("- a\n- b\n")
    with pytest.raises(ConfigError) as err:
        load_config(top)
    assert _one_line(err) == f"{top}: top level must be a mapping of sections, got list ['a', 'b']"


# ------------------------------------------------------------------------------------ cross-field rules


def test_tp3_with_4_heads_names_parallel_tp():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["parallel.tp=3", "trainer.gpus_per_node=3"])
    msg = _one_line(err)
    assert msg.startswith("parallel.tp=3 does not divide num_attention_heads=4")


@pytest.mark.parametrize(
    "overrides, expected",
    [
        # 4 KV heads... the tiny model has 2: tp=4 divides the 4 query heads but not the 2 query groups.
        (["parallel.tp=4", "trainer.gpus_per_node=4"], "parallel.tp=4 does not divide num_key_value_heads=2"),
        (["parallel.pp=3", "trainer.gpus_per_node=6"], "parallel.pp=3 does not divide num_hidden_layers=4"),
        (
            ["parallel.pp=2", "parallel.vpp=4", "trainer.gpus_per_node=4"],
            "parallel.pp * parallel.vpp=8 does not divide num_hidden_layers=4",
        ),
        (["parallel.vpp=2"], "parallel.vpp=2 needs parallel.pp >= 2"),
        (
            ["parallel.tp=1", "parallel.cp=2", "parallel.cp_comm_type=p2p"],
            "parallel.cp_comm_type=p2p needs model.transformer_impl=transformer_engine",
        ),
        (
            ["trainer.gpus_per_node=3"],
            "parallel.tp * parallel.pp * parallel.cp = 2*1*1 = 2 does not divide the trainer world size 3",
        ),
        (["parallel.dp=2"], "parallel.tp * parallel.pp * parallel.cp * parallel.dp = 2*2 = 4 != trainer world size 2"),
        (
            ["trainer.world_size=4", "trainer.gpus_per_node=4", "parallel.dp=1"],
            "!= trainer world size 4 (trainer.world_size)",
        ),
        (["trainer.world_size=4"], "trainer.world_size=4 plus 0 SGLang GPUs"),
        (["parallel.ep=2"], "parallel.ep=2 but the model is dense"),
        (["algo.clip_ratio_low=1.2"], "algo.clip_ratio_low=1.2 must be in [0, 1)"),
        (["algo.clip_ratio_c=0.5"], "algo.clip_ratio_c=0.5 must be > 1"),
        (["algo.ppo_mini_batch_size=3"], "algo.ppo_mini_batch_size=3 does not divide algo.train_batch_size=8"),
        (["rollout.n_resp_per_prompt=1"], "algo.filter_groups.enable needs rollout.n_resp_per_prompt >= 2"),
        (["algo.staleness=-1"], "algo.staleness=-1 must be >= 0"),
        (["algo.staleness_buffer_groups=16"], "algo.staleness_buffer_groups=16 must equal algo.train_batch_size=8"),
        (["algo.staleness_buffer_groups=4"], "algo.staleness_buffer_groups=4 must equal algo.train_batch_size=8"),
        (["algo.overlong_buffer.len=32"], "algo.overlong_buffer.len=32 must be in (0, data.max_response_length=32)"),
        (["algo.max_tokens_per_micro_batch=50"], "algo.max_tokens_per_micro_batch=50 is below one full sequence"),
        (["rollout.sampling.temperature=0"], "rollout.sampling.temperature=0.0 must be > 0"),
        (["rollout.sync.check_interval_ms=0"], "rollout.sync.check_interval_ms=0.0 must be > 0"),
        (
            ["rollout.sync.sources=per_stage", "rollout.sync.policy=greedy"],
            "rollout.sync.sources=per_stage needs rollout.sync.policy=all_at_once (got greedy",
        ),
        (
            ["rollout.sync.sources=per_stage", "trainer.backend=fsdp2", "parallel.tp=1"],
            "rollout.sync.sources=per_stage applies to trainer.backend=megatron",
        ),
        (["rollout.sync.sources=stage"], "rollout.sync.sources"),
        (
            ["rollout.sync.transport=ipc", "rollout.sync.policy=greedy"],
            "rollout.sync.transport=ipc needs rollout.sync.policy=all_at_once (got greedy",
        ),
        (
            ["rollout.sync.transport=ipc", "rollout.sync.sources=per_stage"],
            "rollout.sync.transport=ipc sends every tensor from trainer rank 0",
        ),
        (
            ["rollout.sync.transport=ipc", "trainer.nnodes=2"],
            "needs every server on trainer rank 0's host (IPC handles do not cross hosts), but trainer.nnodes=2",
        ),
        (["rollout.sync.transport=shm"], "rollout.sync.transport"),
        (["reward.num_workers=-1"], "reward.num_workers=-1 must be >= 0"),
        (["rollout.sampling.max_new_tokens=64"], "rollout.sampling.max_new_tokens=64 must be in [1, data.max_respon"),
        (["rollout.server_tp=2"], "rollout.server_tp=2: the embedded engine has no tensor parallelism"),
        (
            ["rollout.embedded_batching=continuous", "rollout.servers=[http://127.0.0.1:3000]"],
            "rollout.embedded_batching=continuous applies only to embedded servers the driver launches",
        ),
        (
            ["rollout.embedded_batching=continuous", "rollout.engine=sglang", "trainer.world_size=2"],
            "rollout.embedded_batching=continuous applies only to embedded servers the driver launches",
        ),
        (["rollout.embedded_batching=dynamic"], "rollout.embedded_batching"),
        (["rollout.servers=[localhost:3000]"], "rollout.servers[0]='localhost:3000' must be an http://"),
        (["optimizer.min_lr=1.0"], "optimizer.min_lr=1.0 must be in [0, optimizer.lr=0.0001]"),
        (["trainer.backend=fsdp2"], "trainer.backend=fsdp2 shards over data parallel only; set parallel.tp=2 to 1"),
        (["model.hf_path="], "model.hf_path is required"),
        (
            ["trainer.launcher=torchrun", "rollout.engine=sglang", "trainer.world_size=2"],
            "trainer.launcher=torchrun starts no SGLang servers: list them in rollout.servers",
        ),
    ],
)
def test_cross_field_rules_name_the_keys(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    assert expected in _one_line(err)


def test_staleness_buffer_groups_is_the_step_batch():
    """PSRL's staleness_buffer_entries: one buffer is one training step's batch (null = train_batch_size)."""
    assert load_config(TINY, []).algo.staleness_buffer_groups is None
    assert load_config(TINY, ["algo.staleness_buffer_groups=8"]).algo.staleness_buffer_groups == 8


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["parallel.ep=3", "trainer.gpus_per_node=3"], "parallel.ep=3 does not divide num_experts=4"),
        (["parallel.ep=4"], "parallel.ep * parallel.etp = 4*1 must divide tp * cp * dp = 2"),
        (
            ["parallel.tp=2", "parallel.ep=1"],
            "parallel.sequence_parallel must be true for an MoE model with parallel.tp=2",
        ),
    ],
)
def test_moe_rules(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(TINY_MOE, overrides)
    assert expected in _one_line(err)


def test_several_broken_rules_are_reported_together_on_one_line():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["algo.staleness=-1", "optimizer.lr=-1"])
    msg = _one_line(err)
    assert "optimizer.lr=-1.0 must be > 0" in msg and "algo.staleness=-1" in msg


def test_trainer_world_size_excludes_launched_sglang_gpus():
    # 2 nodes x 8 GPUs, 4 SGLang servers of TP 2 launched by the driver -> 16 - 8 = 8 trainer ranks.
    cfg = config_from_dict(
        {
            "model": {"hf_path": "Qwen/Qwen3-8B"},
            "parallel": {"tp": 2, "pp": 2},
            "rollout": {"engine": "sglang", "num_servers": 4, "server_tp": 2},
            "trainer": {"nnodes": 2, "gpus_per_node": 8},
        }
    )
    assert validate_config(cfg) == []
    assert derived.launched_rollout_gpus(cfg) == 8
    assert derived.trainer_world_size(cfg) == 8
    assert derived.data_parallel_size(cfg) == 8 // (2 * 2) == 2
    # External servers take no trainer GPUs.
    cfg.rollout.servers = ["http://10.0.0.1:30000"]
    assert derived.trainer_world_size(cfg) == 16


def test_sync_timeout_and_min_healthy_servers_are_checked_and_resolved():
    cfg = config_from_dict({"model": {"hf_path": "Qwen/Qwen3-8B"}, "rollout": {"num_servers": 2}})
    # unset: a quarter of the request timeout, at most 300 s (below it, so that a paused healthy server's
    # requests outlive the wait for a stalled one: docs/operations.md)
    assert cfg.rollout.request_timeout_s == 3600.0 and derived.sync_timeout_s(cfg) == 300.0
    cfg.rollout.request_timeout_s = 20.0
    assert derived.sync_timeout_s(cfg) == 5.0
    cfg.rollout.sync.timeout_s = 30.0
    assert derived.sync_timeout_s(cfg) == 30.0
    # set at or above the request timeout under all_at_once: refused, naming both keys
    with pytest.raises(ConfigError, match=r"rollout.sync.timeout_s=30.0 must be below rollout.request_timeout_s=20.0"):
        validate_config(cfg)
    cfg.rollout.sync.policy = "greedy"  # a per-server sync pauses no other server: allowed
    assert validate_config(cfg) == []
    cfg.rollout.sync.policy, cfg.rollout.request_timeout_s = "all_at_once", 3600.0
    cfg.rollout.sync.timeout_s, cfg.rollout.min_healthy_servers = 0.0, 3
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert "rollout.sync.timeout_s=0.0 must be > 0" in _one_line(err)
    assert "rollout.min_healthy_servers=3 must be between 1 and the 2 server(s)" in _one_line(err)
    cfg.rollout.sync.timeout_s, cfg.rollout.min_healthy_servers = None, 2
    assert validate_config(cfg) == []


# --------------------------------------------------------------------------------------- model shapes


def test_shape_from_config_json_wins_and_must_agree_with_inline(tmp_path):
    from megatron_dapo.models.tiny import tiny_hf_config

    model_dir = tmp_path / "tiny"
    # writes config.json only; save_pretrained of a model records architectures, a bare config does not
    tiny_hf_config("qwen3", architectures=["Qwen3ForCausalLM"]).save_pretrained(model_dir)
    cfg = load_config(TINY, [f"model.hf_path={model_dir}"])
    resolved = resolve_model_shape(cfg.model)
    assert resolved.source == f"{model_dir}/config.json"
    # Without the inline copy, config.json alone drives the head check.
    with pytest.raises(ConfigError, match=r"parallel.tp=3 does not divide num_attention_heads=4 \(.*config.json\)"):
        load_config(TINY, [f"model.hf_path={model_dir}", "model.hf_config=null", "parallel.tp=3"])
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [f"model.hf_path={model_dir}", "model.hf_config.num_attention_heads=8"])
    assert "model.hf_config.num_attention_heads=8 disagrees with" in _one_line(err)
    with pytest.raises(ConfigError, match="model.hf_config.architectures=.'Qwen3MoeForCausalLM'. disagrees"):
        load_config(TINY, [f"model.hf_path={model_dir}", "model.hf_config.architectures=[Qwen3MoeForCausalLM]"])


def test_missing_model_dir_skips_shape_checks_with_a_note(tmp_path):
    cfg = load_config(TINY, [f"model.hf_path={tmp_path}/not_yet", "model.hf_config=null", "parallel.tp=2"])
    notes = validate_config(cfg)
    assert len(notes) == 1 and "checks against the model shape" in notes[0] and "not_yet" in notes[0]


@pytest.mark.parametrize("path, family", [(TINY, "qwen3"), (TINY_MOE, "qwen3_moe")])
def test_tiny_inline_shapes_match_the_tiny_models(path, family):
    from megatron_dapo.models.tiny import tiny_hf_config

    cfg = load_config(path)
    on_disk = json.loads(tiny_hf_config(family).to_json_string())
    assert shape_from_hf(cfg.model.hf_config) == shape_from_hf(on_disk)


def test_moe_shape_reads_both_expert_spellings():
    hub = dict(BUILTIN_HF_CONFIGS["Qwen3-30B-A3B"])
    tf5 = dict(hub)
    tf5["num_local_experts"] = tf5.pop("num_experts")
    a, b = shape_from_hf(hub), shape_from_hf(tf5)
    assert a == b and a.num_experts == 128 and a.moe_layers == tuple(range(48))


# ---------------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=lambda p: p.name)
def test_show_then_load_round_trips(path, tmp_path):
    cfg = load_config(path, ["algo.clip_ratio_high=0.3", *_cost_model_overrides(path, tmp_path)])
    out = tmp_path / "resolved.yaml"
    text = dump_yaml(cfg, out)
    assert out.read_text() == text and not list(tmp_path.glob(".*.tmp"))
    again = load_config(out)
    assert again == cfg
    assert config_to_dict(again) == config_to_dict(cfg)


def test_cli_show_and_errors():
    env_python = sys.executable
    ok = subprocess.run(
        [env_python, "-m", "megatron_dapo.cli", "config", "show", str(TINY), "algo.clip_ratio_high=0.3"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert ok.returncode == 0, ok.stderr
    shown = yaml.safe_load(ok.stdout)
    assert shown["algo"]["clip_ratio_high"] == 0.3
    assert shown == config_to_dict(load_config(TINY, ["algo.clip_ratio_high=0.3"]))

    from megatron_dapo.config.cli import main

    for override in ("algo.clip_ratio_hgh=0.3", "parallel.tp=abc", "parallel.tp=3"):
        assert main(["validate", str(TINY), override]) == 2


def test_cli_error_is_one_line_on_stderr(capsys):
    from megatron_dapo.config.cli import main

    assert main(["show", str(TINY), "parallel.tp=3"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "parallel.tp=3" in captured.err
    assert main(["validate", str(TINY)]) == 0
    assert capsys.readouterr().out.strip().endswith(": ok")


# ---------------------------------------------------------------------------------- hostile input


def _float_fields(cls=DapoConfig, prefix=""):
    import typing

    from megatron_dapo.config.load import _hints

    out = []
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            out += _float_fields(tp, f"{prefix}{f.name}.")
        elif tp is float or float in typing.get_args(tp):
            out.append(f"{prefix}{f.name}")
    return out


FLOAT_FIELDS = _float_fields()


def test_every_float_field_refuses_non_finite_values():
    assert "reward.timeout_s" in FLOAT_FIELDS and "optimizer.lr" in FLOAT_FIELDS and len(FLOAT_FIELDS) > 15
    for key in FLOAT_FIELDS:
        for value in (".nan", ".inf", "-.inf", "1e400"):
            with pytest.raises(ConfigError) as err:
                load_config(TINY, [f"{key}={value}"])
            assert f"{key}: expected" in _one_line(err), (key, value)


def test_non_finite_and_huge_values_in_a_file_name_the_file_and_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(TINY.read_text() + "\nreward:\n  timeout_s: .nan\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert _one_line(err).startswith(f"{path}: reward.timeout_s: expected a finite float, got float nan")
    path.write_text(TINY.read_text().replace("trainer:\n", f"trainer:\n  seed: {2**70}\n", 1))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"{path}: trainer.seed: int {2**70} is out of range" in _one_line(err)


@pytest.mark.parametrize(
    "override, expected",
    [
        (f"trainer.seed={2**70}", f"trainer.seed: int {2**70} is out of range (a 64-bit integer)"),
        ("parallel.tp=1.0e+30", "parallel.tp: int 1000000000000000019884624838656 is out of range"),
        (f"trainer.seed={2**40}", f"trainer.seed={2**40} must be in [0, 2**32)"),
        ("data.seed=-1", "data.seed=-1 must be in [0, 2**32)"),
    ],
)
def test_out_of_range_ints_name_the_key(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [override])
    assert expected in _one_line(err)


def test_duplicate_keys_are_an_error_naming_key_and_line(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("trainer:\n  seed: 1\n  total_steps: 2\n  seed: 7\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, validate=False)
    assert _one_line(err) == f"{path}:4:3: invalid YAML: duplicate key 'seed' (first at line 2)"
    path.write_text("trainer: {seed: 1}\ntrainer: {seed: 2}\n")
    with pytest.raises(ConfigError, match="duplicate key 'trainer'"):
        load_config(path, validate=False)
    # merge keys may be overridden by explicit keys: that is no duplicate
    path.write_text("base: &b {a: 1, b: 2}\nreward:\n  kwargs: {<<: *b, a: 3}\n")
    with pytest.raises(ConfigError, match="unknown key 'base'"):
        load_config(path, validate=False)


def _bomb(levels: int = 9) -> str:
    lines = ['  l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]")
    return "reward:\n  kwargs:\n" + "\n".join("  " + ln for ln in lines) + "\n"


def test_alias_bomb_and_recursive_alias_are_refused_anchors_allowed(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(TINY.read_text() + "\n" + _bomb())  # 9**9 = 387M strings once expanded
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"{path}: more than 100000 values once aliases are expanded" in _one_line(err)
    path.write_text(TINY.read_text() + "\nreward:\n  kwargs: &a {x: *a}\n")
    with pytest.raises(ConfigError, match="nested deeper than 64 levels"):  # a recursive alias
        load_config(path)
    with pytest.raises(ConfigError, match="override 'reward.kwargs.x': more than 100000 values"):
        load_config(
            TINY,
            [
                "reward.kwargs.x="
                + "{a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a], "
                "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b], d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c], "
                "e: [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]}"
            ],
        )
    path.write_text(TINY.read_text() + "\nreward:\n  kwargs: {a: &x [1, 2], b: *x}\n")
    assert load_config(path).reward.kwargs == {"a": [1, 2], "b": [1, 2]}


def test_alias_bomb_does_not_hang_config_show(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(TINY.read_text() + "\n" + _bomb())
    r = subprocess.run(
        [sys.executable, "-m", "megatron_dapo.cli", "config", "show", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1 and "alias" in r.stderr


@pytest.mark.parametrize(
    "content, expected",
    [
        (b"reward:\n  kwargs: " + b"[" * 100 + b"]" * 100 + b"\n", "nested deeper than 64 levels"),
        (b"reward:\n  kwargs: " + b"[" * 50_000 + b"]" * 50_000 + b"\n", "invalid YAML: nested deeper than the parser"),
        (b"trainer:\n  seed: 1\n# caf\xe9\n", "c.yaml:3: not UTF-8 text (byte 24: invalid continuation byte)"),
        (b"trainer: !!python/object/apply:os.system [echo hi]\n", "invalid YAML: could not determine a constructor"),
    ],
)
def test_hostile_files_are_one_line_errors_naming_the_file(tmp_path, content, expected):
    path = tmp_path / "c.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        load_config(path, validate=False)
    assert _one_line(err).startswith(str(path)) and expected in str(err.value)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["rollout.redundancy.extra_samples=-1"], "rollout.redundancy.extra_samples=-1 must be >= 0"),
        (["rollout.redundancy.extra_prompts=-2"], "rollout.redundancy.extra_prompts=-2 must be >= 0"),
        (["rollout.retry.threshold=0"], "rollout.retry.threshold=0 must be >= 1"),
        (["rollout.retry.enabled=true", "algo.staleness=0"], "rollout.retry.enabled needs algo.staleness >= 1"),
        (["rollout.migration.threshold=0.5"], "rollout.migration.threshold=0.5 must be >= 1"),
        (["rollout.migration.stop_threshold=-1"], "rollout.migration.stop_threshold=-1.0 must be >= 0"),
        (["rollout.migration.min_starved_ms=-1"], "rollout.migration.min_starved_ms=-1.0 must be >= 0"),
        (
            ["rollout.migration.enabled=true", "rollout.partial_rollout=false"],
            "rollout.migration.enabled needs rollout.partial_rollout",
        ),
        (
            ["rollout.migration.enabled=true", "rollout.num_servers=1"],
            "rollout.migration.enabled needs at least 2 rollout servers, got 1",
        ),
        (["rollout.migration.indicator=tokens"], "rollout.migration.indicator"),
    ],
)
def test_rollout_coordination_switches_are_checked(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    assert expected in _one_line(err)


def test_rollout_coordination_switches_load():
    cfg = load_config(
        TINY,
        [
            "rollout.migration.enabled=true",
            "rollout.migration.indicator=throughput",
            "rollout.retry.enabled=true",
            "rollout.retry.threshold=2",
            "rollout.redundancy.extra_samples=2",
            "rollout.redundancy.extra_prompts=1",
        ],
    )
    r = cfg.rollout
    assert (r.migration.enabled, r.migration.indicator, r.retry.threshold) == (True, "throughput", 2)
    assert (r.redundancy.extra_samples, r.redundancy.extra_prompts) == (2, 1)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ([], "rank0"),
        (["parallel.pp=2", "trainer.gpus_per_node=4"], "per_stage"),
        (["parallel.pp=2", "trainer.gpus_per_node=4", "rollout.sync.policy=greedy"], "rank0"),
        (["parallel.pp=2", "trainer.gpus_per_node=4", "rollout.sync.sources=rank0"], "rank0"),
        (["rollout.sync.sources=per_stage"], "per_stage"),
        (["parallel.pp=2", "trainer.gpus_per_node=4", "rollout.sync.transport=ipc"], "rank0"),
    ],
)
def test_sync_sources_auto_is_per_stage_with_stages_and_all_at_once(overrides, expected):
    assert derived.sync_sources(load_config(TINY, overrides)) == expected


# ---------------------------------------------------------------- policy losses, advantages, rollout correction
def test_rollout_is_key_names_its_replacement(tmp_path):
    """algo.rollout_is (replaced by algo.rollout_correction) fails with the translation, from a file and
    from an override alike."""
    path = tmp_path / "old.yaml"
    path.write_text("algo:\n  rollout_is:\n    enable: true\n    cap: 2.0\n")
    with pytest.raises(ConfigError, match=r"algo.rollout_is was replaced by algo.rollout_correction.*mode=token_tis"):
        load_config(path)
    with pytest.raises(
        ConfigError, match="key 'algo.rollout_is': algo.rollout_is was replaced by algo.rollout_correction"
    ):
        load_config(TINY, ["algo.rollout_is.cap=3.0"])


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["algo.policy_loss=gspo"], "algo.policy_loss=gspo needs algo.loss_agg_mode=seq-mean-token-mean"),
        (["algo.policy_loss=ppo"], "algo.policy_loss='ppo': expected one of"),
        (["algo.policy_loss=no_such_module_xyz:loss"], "algo.policy_loss 'no_such_module_xyz:loss' cannot be imported"),
        (["algo.adv_estimator=gae"], "algo.adv_estimator='gae': expected one of"),
        (["algo.adv_estimator=math:no_such_function"], "algo.adv_estimator 'math:no_such_function' cannot be imported"),
        (["algo.gspo.clip_ratio_low=1.5"], "algo.gspo.clip_ratio_low=1.5"),
        (["algo.cispo.clip_ratio_low=-0.1"], "algo.cispo.clip_ratio_low=-0.1"),
        (["algo.rollout_correction.upper=0.5"], "algo.rollout_correction.upper=0.5 must be >= 1 for mode=token_tis"),
        (["algo.rollout_correction.lower=0.5"], "algo.rollout_correction.lower=0.5 is used only by modes"),
        (
            [
                "algo.rollout_correction.mode=icepop",
                "algo.rollout_correction.lower=6",
                "algo.rollout_correction.upper=5",
            ],
            r"algo.rollout_correction.lower=6.0 must be in \[0, upper=5.0\)",
        ),
        (["algo.rollout_correction.mode=icepop"], "algo.rollout_correction.mode=icepop needs"),
        (
            ["algo.rollout_correction.geo_reject.enable=true", "algo.rollout_correction.geo_reject.lower=1.1"],
            "algo.rollout_correction.geo_reject: need 0 < lower < 1 < upper",
        ),
        (
            ["algo.rollout_correction.bypass=true", "algo.rollout_correction.mode=none", "algo.staleness=2"],
            "algo.rollout_correction.bypass=true with algo.staleness=2 and no correction",
        ),
    ],
)
def test_policy_loss_and_correction_refusals(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides)


@pytest.mark.parametrize(
    "overrides",
    [
        ["algo.policy_loss=gspo", "algo.loss_agg_mode=seq-mean-token-mean"],
        ["algo.policy_loss=cispo", "algo.cispo.clip_ratio_high=4.0"],
        ["algo.adv_estimator=rloo"],
        ["algo.adv_estimator=reinforce_plus_plus"],
        ["algo.rollout_correction.mode=icepop", "algo.rollout_correction.lower=0.5", "algo.rollout_correction.upper=5"],
        ["algo.rollout_correction.mode=token_mis"],
        ["algo.rollout_correction.mode=seq_mis", "algo.rollout_correction.lower=0.5"],
        ["algo.rollout_correction.geo_reject.enable=true"],
        ["algo.rollout_correction.bypass=true", "algo.staleness=0", "algo.rollout_correction.mode=none"],
        ["algo.rollout_correction.bypass=true"],  # staleness 3 with token_tis on
        [
            "algo.policy_loss=megatron_dapo.algo.loss:dapo_policy_loss",
            "algo.adv_estimator=tests.config.test_config:_adv",
        ],
    ],
)
def test_new_algorithm_keys_load(overrides):
    cfg = load_config(TINY, overrides)
    for item in overrides:
        key, _, value = item.partition("=")
        obj = cfg
        for part in key.split("."):
            obj = getattr(obj, part)
        assert str(obj).lower() == value or (not isinstance(obj, (bool, str)) and float(obj) == float(value)), (
            key,
            obj,
            value,
        )


def _adv(rewards, group_ids, token_counts):
    """A custom advantage estimator for test_new_algorithm_keys_load (module:function hook)."""
    return rewards - rewards.mean()
