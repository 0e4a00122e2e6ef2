"""Launchers: each --dry-run prints the intended commands, and the printed train command loads.

The printed `megatron-dapo train` / torchrun command lines are parsed back with shlex and their
--config and overrides are loaded with load_config, so a launcher that passes a misspelt key, a
wrong type or an invalid layout fails here.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_dapo.config import load_config

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch"
SCRIPTS = [
    "qwen3_8b_megatron.sh",
    "qwen3_30b_megatron.sh",
    "qwen2.5_3b_fsdp.sh",
    "slurm_ray.sbatch",
    "torchrun_external_sglang.sh",
    "advanced_qwen2.5_7b_fsdp.sh",
    "advanced_qwen3_8b_megatron.sh",
    "advanced_qwen3_30b_megatron.sh",
]


def _dry_run(script: str, *args: str, **env: str) -> list[list[str]]:
    full_env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MODEL_PATH", "RAY_ADDRESS", "SGLANG_SERVERS", "SLURM_JOB_NODELIST", "NNODES", "COST_MODEL")
    }
    full_env.update(env)
    proc = subprocess.run(
        ["bash", str(LAUNCH / script), *args], capture_output=True, text=True, timeout=30, env=full_env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line[2:] for line in proc.stdout.splitlines() if line.startswith("+ ")]
    assert lines, proc.stdout
    return [shlex.split(line.removesuffix(" &")) for line in lines]


def _train_config(cmd: list[str]):
    """load_config of the --config and overrides of a printed train command."""
    i = cmd.index("train")
    rest = cmd[i + 1 :]
    assert rest[0] == "--config"
    return load_config(rest[1], rest[2:])


@pytest.mark.parametrize(
    "script, config, nodes, backend",
    [
        ("qwen3_8b_megatron.sh", "qwen3_8b.yaml", 4, "megatron"),
        ("qwen3_30b_megatron.sh", "qwen3_30b_a3b.yaml", 4, "megatron"),
        ("qwen2.5_3b_fsdp.sh", "qwen2.5_3b_fsdp.yaml", 1, "fsdp2"),
    ],
)
def test_model_launchers(script, config, nodes, backend):
    plan, train = _dry_run(script, "--dry-run")
    cfg_path = str(ROOT / "configs" / "qwen3" / config)
    assert plan[:3] == ["megatron-dapo", "plan", cfg_path]
    assert plan[3:9] == ["--nodes", str(nodes), "--gpus-per-node", "8", "--gpu-mem-gib", "80"]
    assert train[:4] == ["megatron-dapo", "train", "--config", cfg_path]
    assert "algo.staleness=3" in train  # default staleness
    cfg = _train_config(train)
    assert cfg.algo.staleness == 3 and cfg.trainer.backend == backend and cfg.trainer.nnodes == nodes
    assert plan[9:] == train[4:]  # plan checks exactly what train will run

    # First argument = staleness; extra overrides and environment pass through.
    _, train = _dry_run(script, "0", "--dry-run", "trainer.total_steps=7", MODEL_PATH="/models/x", NNODES="8")
    cfg = _train_config(train)
    assert (cfg.algo.staleness, cfg.trainer.total_steps, cfg.model.hf_path, cfg.trainer.nnodes) == (
        0,
        7,
        "/models/x",
        8,
    )


ADVANCED = [
    ("advanced_qwen2.5_7b_fsdp.sh", "advanced_qwen2.5_7b_fsdp.yaml", 2, "fsdp2", 2),
    ("advanced_qwen3_8b_megatron.sh", "advanced_qwen3_8b.yaml", 4, "megatron", 2),
    ("advanced_qwen3_30b_megatron.sh", "advanced_qwen3_30b_a3b.yaml", 4, "megatron", 3),
]


@pytest.fixture
def cost_model_file(tmp_path):
    from megatron_dapo.config.cost_model import QWEN_7B_1GPU

    path = tmp_path / "cost_model.json"
    QWEN_7B_1GPU.save(path)
    return path


@pytest.mark.parametrize("script, config, nodes, backend, staleness", ADVANCED)
def test_advanced_launchers(script, config, nodes, backend, staleness, cost_model_file, capsys):
    plan, train = _dry_run(script, "--dry-run", "--cost-model", str(cost_model_file))
    cfg_path = str(ROOT / "configs" / "qwen3" / config)
    assert plan[:3] == ["megatron-dapo", "plan", cfg_path]
    assert plan[3:9] == ["--nodes", str(nodes), "--gpus-per-node", "8", "--gpu-mem-gib", "80"]
    assert train[:4] == ["megatron-dapo", "train", "--config", cfg_path]
    assert plan[9:] == train[4:]  # plan checks exactly what train will run

    # The advanced switches as the config loader reads them (PSRL's advanced recipe, with the gain
    # threshold and the sync KV threshold the simulator favours: RESULTS.md).
    cfg = _train_config(train)
    r = cfg.rollout
    assert (cfg.algo.staleness, cfg.trainer.backend, cfg.trainer.nnodes) == (staleness, backend, nodes)
    assert (r.routing.method, r.routing.delta_throughput_threshold, r.routing.server_order) == (
        "throughput_optimal",
        0.0,
        "reserve_capability",
    )
    assert r.routing.cost_model == str(cost_model_file)
    assert (r.queue.policy, r.concurrency, r.partial_rollout) == ("priority", 512, True)
    # the produced-rate ablation's choice (RESULTS.md, "greedy sync"): never below plain async beyond the seeds
    assert (r.sync.policy, r.sync.pause_mode) == ("greedy", "in_place")
    assert (
        r.migration.enabled,
        r.migration.indicator,
        r.migration.threshold,
        r.migration.stop_indicator,
        r.migration.stop_threshold,
    ) == (True, "throughput", 5.0, "request_num", 10)
    assert (r.retry.enabled, r.retry.threshold) == (True, 4)
    assert (r.redundancy.extra_samples, r.redundancy.extra_prompts, r.loads.interval_ms) == (0, 32, 200)

    # The printed plan command runs: the layout and memory of the advanced config fit 80 GiB GPUs.
    from megatron_dapo.apps.plan import main as plan_main

    assert plan_main(plan[2:]) == 0
    assert "fits: yes" in capsys.readouterr().out

    # Cost model from the environment, relative path made absolute; staleness and overrides pass through.
    rel = os.path.relpath(cost_model_file, ROOT)
    _, train = _dry_run(script, "1", "--dry-run", "trainer.total_steps=7", COST_MODEL=rel, NNODES="8")
    cfg = _train_config(train)
    assert (cfg.algo.staleness, cfg.trainer.total_steps, cfg.trainer.nnodes) == (1, 7, 8)
    assert cfg.rollout.routing.cost_model == str(cost_model_file)


@pytest.mark.parametrize(
    "args, env, message",
    [
        ((), {}, "no cost model: pass --cost-model FILE or set COST_MODEL"),
        (("--cost-model", "/nonexistent/cm.json"), {}, "cost model file '/nonexistent/cm.json' does not exist"),
        ((), {"COST_MODEL": "/nonexistent/cm.json"}, "cost model file '/nonexistent/cm.json' does not exist"),
        (("--cost-model",), {}, "--cost-model needs a FILE"),
    ],
)
def test_advanced_launcher_needs_a_cost_model(args, env, message):
    full_env = {k: v for k, v in os.environ.items() if k != "COST_MODEL"}
    proc = subprocess.run(
        ["bash", str(LAUNCH / "advanced_qwen3_8b_megatron.sh"), "--dry-run", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={**full_env, **env},
    )
    assert proc.returncode == 2 and message in proc.stderr and "+ " not in proc.stdout


def test_model_launcher_rejects_bad_staleness():
    proc = subprocess.run(
        ["bash", str(LAUNCH / "qwen3_8b_megatron.sh"), "three", "--dry-run"], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2 and "STALENESS must be a non-negative integer, got 'three'" in proc.stderr


def test_slurm_ray_dry_run():
    cmds = _dry_run(
        "slurm_ray.sbatch",
        "--dry-run",
        "configs/qwen3/qwen3_30b_a3b.yaml",
        "algo.staleness=1",
        NODELIST="gpu01 gpu02 gpu03 gpu04",
        HEAD_IP="10.0.0.1",
    )
    head, *workers, train = cmds
    assert head[:6] == ["srun", "--overlap", "--nodes=1", "--ntasks=1", "-w", "gpu01"]
    assert head[6:10] == ["ray", "start", "--head", "--node-ip-address=10.0.0.1"]
    assert [w[5] for w in workers] == ["gpu02", "gpu03", "gpu04"]
    assert all("--address=10.0.0.1:6379" in w for w in workers)
    assert [a for w in workers for a in w if a.startswith("--node-ip-address")] == []  # each finds its own
    assert [w[-2] for w in workers] == [f"--labels=megatron-dapo/node={k}" for k in (1, 2, 3)]
    cfg = _train_config(train)
    assert (cfg.trainer.nnodes, cfg.trainer.gpus_per_node, cfg.trainer.ray_address) == (4, 8, "10.0.0.1:6379")
    assert cfg.algo.staleness == 1


def test_slurm_ray_on_loopback_keeps_ray_there_and_labels_each_node():
    head, worker, train = _dry_run(
        "slurm_ray.sbatch",
        "--dry-run",
        "configs/qwen3/tiny_qwen3_cpu.yaml",
        NODELIST="n1 n2",
        HEAD_IP="127.0.0.1",
        RAY_PORT="6390",
        PYTHON="python3",
    )
    # Ray's CLI through megatron_dapo.apps.ray_node (loopback kept), each node labelled with its index
    assert head[6:10] == ["python3", "-m", "megatron_dapo.apps.ray_node", "start"]
    assert "--node-ip-address=127.0.0.1" in head and "--labels=megatron-dapo/node=0" in head
    assert worker[5] == "n2" and worker[6:10] == ["python3", "-m", "megatron_dapo.apps.ray_node", "start"]
    assert {"--address=127.0.0.1:6390", "--node-ip-address=127.0.0.1", "--labels=megatron-dapo/node=1"} <= set(worker)
    assert _train_config(train).trainer.ray_address == "127.0.0.1:6390"


def test_torchrun_external_sglang_dry_run():
    validate, torchrun = _dry_run(
        "torchrun_external_sglang.sh",
        "--dry-run",
        "configs/qwen3/qwen3_8b.yaml",
        NNODES="2",
        NODE_RANK="1",
        NPROC_PER_NODE="8",
        MASTER_ADDR="10.0.0.1",
        SGLANG_SERVERS="http://10.0.0.9:30000,http://10.0.0.10:30000",
    )
    assert validate[:3] == ["megatron-dapo", "config", "validate"]
    assert torchrun[:7] == [
        "torchrun",
        "--nnodes=2",
        "--node-rank=1",
        "--nproc-per-node=8",
        "--master-addr=10.0.0.1",
        "--master-port=29500",
        "-m",
    ]
    assert torchrun[7] == "megatron_dapo.cli"
    cfg = _train_config(torchrun)
    assert cfg.trainer.launcher == "torchrun" and cfg.rollout.servers == [
        "http://10.0.0.9:30000",
        "http://10.0.0.10:30000",
    ]
    assert cfg.trainer.world_size == 16
    assert cfg.trainer.bind_host == "10.0.0.1"  # rank 0's node hosts the weight-update group for remote servers
    assert validate[3:] == torchrun[10:]


def test_torchrun_without_servers_fails_validation():
    (_, torchrun) = _dry_run("torchrun_external_sglang.sh", "--dry-run", "configs/qwen3/qwen3_8b.yaml")
    from megatron_dapo.config import ConfigError

    with pytest.raises(ConfigError, match="trainer.launcher=torchrun starts no SGLang servers"):
        _train_config(torchrun)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_shellcheck_clean():
    proc = subprocess.run(
        ["shellcheck", "-x", *SCRIPTS, "_common.sh"], cwd=LAUNCH, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout


def test_torchrun_restarts_resume_and_a_differing_budget_is_refused(monkeypatch):
    """Under torchrun the elastic agent restarts the ranks: `elastic_restart` says which restart this is (a
    restart resumes from the latest checkpoint), and a trainer.max_restarts other than torchrun's
    --max-restarts is refused naming both (None takes torchrun's)."""
    from megatron_dapo.apps.launch import LaunchError, elastic_restart

    cfg = load_config(str(ROOT / "configs/qwen3/tiny_qwen3_cpu.yaml"), [])
    assert cfg.trainer.max_restarts is None
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert elastic_restart(cfg) == 1
    cfg.trainer.max_restarts = 2
    assert elastic_restart(cfg) == 1
    cfg.trainer.max_restarts = 1
    with pytest.raises(
        LaunchError, match=r"trainer.max_restarts=1, but torchrun restarts the ranks 2 times.*--max-restarts=1"
    ):
        elastic_restart(cfg)
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert elastic_restart(cfg) == 0  # not under torchrun's agent


def test_setup_errors_are_not_restarted_training_failures_are():
    from megatron_dapo.apps.launch import LaunchError, restartable
    from megatron_dapo.config import ConfigError
    from megatron_dapo.errors import CheckpointError, CoordinatorLost
    from megatron_dapo.trainer.loop import RunSetupError

    for error in (RunSetupError("no data"), ConfigError("bad key"), CheckpointError("torn"), LaunchError("no room")):
        assert not restartable(error)
    for error in (RuntimeError("gloo: connection closed by peer"), CoordinatorLost("gone"), ValueError("nan")):
        assert restartable(error)


@pytest.mark.parametrize("placement", ["split", "colocated"])
def test_ray_bundles_by_placement(placement):
    """Split: a bundle per trainer rank, then one per server. Colocated: a bundle per trainer rank only, holding
    the rank and its server's share (half of the GPU each); server i in the bundle of rank i * server_tp."""
    from megatron_dapo.apps.launch import _RayLayout
    from megatron_dapo.config.schema import DapoConfig

    cfg = DapoConfig()
    cfg.trainer.placement, cfg.rollout.server_tp = placement, 2
    if placement == "colocated":  # 8 trainer GPUs, 4 servers of TP 2 on them
        layout = _RayLayout(cfg, 8, 4, True, {"CPU": 1, "GPU": 0.5}, {"CPU": 1, "GPU": 0.5})
        assert layout.bundles() == [{"CPU": 2, "GPU": 1.0}] * 8
        assert [layout.server_bundle_index(i) for i in range(4)] == [0, 2, 4, 6]
    else:  # 4 trainer GPUs, 2 servers of TP 2 beside them
        layout = _RayLayout(cfg, 4, 2, True, {"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 2})
        assert layout.bundles() == [{"CPU": 1, "GPU": 1}] * 4 + [{"CPU": 1, "GPU": 2}] * 2
        assert [layout.server_bundle_index(i) for i in range(2)] == [4, 5]
