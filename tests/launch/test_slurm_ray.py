"""launch/slurm_ray.sbatch for real: a two-node Slurm cluster on loopback (tests/launch/slurm_cluster.py),
`sbatch --nodes=2 launch/slurm_ray.sbatch configs/qwen3/tiny_qwen3_cpu.yaml ...` with HEAD_IP=127.0.0.1.

The job starts a Ray head on n1 and a Ray worker on n2 (two raylets on this machine, node labels
megatron-dapo/node=0 / 1) and runs `megatron-dapo train` on them: trainer rank 0 and server 0 on n1, rank 1 and
server 1 on n2, as `megatron-dapo plan --nodes 2 --gpus-per-node 1` places them. Each process's node is read
from its own environment (SLURMD_NODENAME, inherited from the Slurm task that started its raylet), not from
the driver's word. Three jobs:
- a run of 2 steps: exit 0, its log, metrics and checkpoint where docs/cluster.md says, nothing left running;
- `scancel` while every trainer rank and server runs: every process of the job, on both nodes, gone within a bound;
- every process of the job on n2 SIGKILLed (by pid) after step 0: the job stops with the named error of
  docs/operations.md within a bound, and nothing of it is left on n1.
Everything listens on loopback: checked with the job's processes running.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from megatron_dapo.runtime.net import free_port
from tests.launch import slurm_cluster
from tests.launch.sockets import listening_off_loopback

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = slurm_cluster.unavailable()
    if why:
        pytest.skip(why)
    cluster = slurm_cluster.SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except Exception:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny Qwen3 model and the arithmetic training data: (model dir, train file)."""
    from transformers import AutoTokenizer

    from megatron_dapo.data.arithmetic import ArithmeticTask, write_task
    from megatron_dapo.data.char_tokenizer import build_char_tokenizer
    from megatron_dapo.models.tiny import save_tiny_hf_model

    tmp = tmp_path_factory.mktemp("tiny")
    model = build_char_tokenizer(tmp / "model")
    tok = AutoTokenizer.from_pretrained(model)
    save_tiny_hf_model("qwen3", model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    train, _ = write_task(tmp / "data", ArithmeticTask(max_operand=4, ops="+"), num_test=5)
    return model, train


@pytest.fixture
def ray_tmp():
    """Ray's session files (and its "current cluster" pointer) in a directory of this job, removed after it: a
    short path (unix socket names are limited to 107 bytes)."""
    path = tempfile.mkdtemp(prefix="mdr", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _submit(slurm, tiny, out: Path, steps: int, ray_tmp: str, *overrides: str) -> str:
    """sbatch the Slurm + Ray launcher on 2 nodes, with more key=value `overrides`; the job id."""
    model, train = tiny
    env = {
        **slurm.env,
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "PYTHON": sys.executable,
        "MEGATRON_DAPO": str(BIN / "megatron-dapo"),
        "HEAD_IP": "127.0.0.1",
        "RAY_PORT": str(free_port("127.0.0.1")),
        "GPUS_PER_NODE": "1",  # CPU: one trainer process per node
        "RAY_TMPDIR": ray_tmp,
        "RAY_DEDUP_LOGS": "0",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        "sbatch",
        "--parsable",
        "--nodes=2",
        # what this 2-CPU, GPU-less cluster offers instead of the script's #SBATCH GPUs / 64 CPUs
        "--gpus-per-node=0",
        "--cpus-per-task=1",
        f"--output={out}/%x-%j.out",
        "launch/slurm_ray.sbatch",
        "configs/qwen3/tiny_qwen3_cpu.yaml",
        f"model.hf_path={model}",
        f"data.train_files=[{train}]",
        "data.val_files=[]",
        f"trainer.total_steps={steps}",
        "trainer.val_every=0",
        "data.max_response_length=8",
        "algo.overlong_buffer.len=2",
        "algo.train_batch_size=2",
        "algo.ppo_mini_batch_size=2",
        "reward.name=tests.workers.loop_rewards:parity_reward",
        "checkpoint.save_every=1",
        "logging.progress_bar=false",
        f"logging.run_dir={out}/run",
        *overrides,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip().split(";")[0]


def _job(slurm, job: str) -> dict[str, str]:
    text = slurm.run("scontrol", "show", "job", job, check=False).stdout
    return dict(re.findall(r"(\w+)=(\S+)", text))


def _wait(what: str, cond, timeout: float, log: Path | None = None, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(interval)
    tail = log.read_text(errors="replace")[-6000:] if log is not None and log.exists() else ""
    raise AssertionError(f"{what} not within {timeout} s\n{tail}")


def _job_processes(job: str) -> dict[int, dict]:
    """The processes of a Slurm job on this machine (both nodes), by their environment: pid -> facts."""
    found = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            env = p.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("SLURM_JOB_ID") == job:
            found[p.info["pid"]] = {"node": env.get("SLURMD_NODENAME"), "cmd": p.info["cmdline"] or []}
    return found


def _roles(procs: dict[int, dict], model: Path) -> dict[str, str]:
    """The node of each trainer rank process and server process: {"trainer:PID": node, "server SEED": node}."""
    roles = {}
    for pid, p in procs.items():
        cmd = p["cmd"]
        if cmd and cmd[0].startswith("ray::_TrainerActor"):
            roles[f"trainer:{pid}"] = p["node"]
        elif {"serve", "--model", str(model), "--seed"} <= set(cmd):
            roles[f"server {cmd[cmd.index('--seed') + 1]}"] = p["node"]
    return roles


def _running_on_both(job: str, model: Path):
    roles = _roles(_job_processes(job), model)
    trainers = sorted(n for k, n in roles.items() if k.startswith("trainer:"))
    if trainers == ["n1", "n2"] and roles.get("server 0") and roles.get("server 1"):
        return roles
    return None


def _metrics_rows(out: Path) -> list[dict]:
    path = out / "run" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _gone(pids) -> bool:
    return not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_sbatch_trains_on_two_ray_nodes(slurm, tiny, tmp_path, ray_tmp):
    job = _submit(slurm, tiny, tmp_path, 2, ray_tmp)
    log = tmp_path / f"megatron-dapo-{job}.out"  # #SBATCH --output=logs/%x-%j.out, here under tmp_path
    roles = _wait("trainer ranks and servers on both nodes", lambda: _running_on_both(job, tiny[0]), 240, log)
    assert roles["server 0"] == "n1" and roles["server 1"] == "n2", roles  # the plan: server s on node s % 2
    # every process of the job listens on loopback only (Ray's GCS, raylets, workers, agents; servers; gloo)
    pids = list(_job_processes(job))
    assert listening_off_loopback(pids) == []
    assert listening_off_loopback([p.pid for p in slurm.procs.values()]) == []  # munged, slurmctld, slurmd
    _wait("the job's end", lambda: _job(slurm, job).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"), 300, log)
    text = log.read_text(errors="replace")
    assert _job(slurm, job)["JobState"] == "COMPLETED", text[-6000:]
    assert "trained 2 steps" in text, text[-6000:]
    # the driver placed rank r on the node labelled r, and Ray ran it there (two different Ray node ids)
    lines = re.findall(r"trainer rank (\d) placed on Ray node (\w+) \(megatron-dapo/node=(\d)\)", text)
    assert [(r, label) for r, _, label in lines] == [("0", "0"), ("1", "1")], text[-6000:]
    assert len({node for _, node, _ in lines}) == 2
    assert re.search(r"rollout server 0 placed on Ray node \w+ \(megatron-dapo/node=0\)", text)
    assert re.search(r"rollout server 1 placed on Ray node \w+ \(megatron-dapo/node=1\)", text)
    rows = _metrics_rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["sync/verify_max_abs_diff"] < 1e-4 for r in rows)
    latest = (tmp_path / "run" / "checkpoints" / "latest").read_text().strip()
    assert latest == "step_000001" and (tmp_path / "run" / "checkpoints" / latest).is_dir()
    assert sorted(p.name for p in (tmp_path / "run" / "logs").glob("server_*.log")) == ["server_0.log", "server_1.log"]
    _wait("every process of the job gone", lambda: _gone(pids) and not _job_processes(job), 60)
    # Ray's "current cluster" pointer to the stopped head is removed (a later ray.init() would try to join it)
    assert not (Path(ray_tmp) / "ray" / "ray_current_cluster").exists()


def test_scancel_stops_every_process_on_both_nodes(slurm, tiny, tmp_path, ray_tmp):
    job = _submit(slurm, tiny, tmp_path, 50, ray_tmp)
    log = tmp_path / f"megatron-dapo-{job}.out"
    # mid-run: every trainer rank and server running, on both nodes
    _wait("trainer ranks and servers on both nodes", lambda: _running_on_both(job, tiny[0]), 240, log)
    procs = _job_processes(job)
    assert {p["node"] for p in procs.values()} == {"n1", "n2"}
    slurm.run("scancel", job)
    _wait("every process of the job gone", lambda: _gone(procs) and not _job_processes(job), 90, log)
    _wait("the job cancelled", lambda: _job(slurm, job).get("JobState") == "CANCELLED", 60, log)
    assert len(_metrics_rows(tmp_path)) < 50


def test_losing_node_2_stops_the_run_with_a_named_error(slurm, tiny, tmp_path, ray_tmp):
    # no restart: a restart would wait (bounded) for room on the lost node (docs/operations.md)
    job = _submit(slurm, tiny, tmp_path, 50, ray_tmp, "trainer.max_restarts=0")
    log = tmp_path / f"megatron-dapo-{job}.out"
    _wait("step 0", lambda: _metrics_rows(tmp_path), 300, log)
    procs = _job_processes(job)
    on_n2 = [pid for pid, p in procs.items() if p["node"] == "n2"]
    assert any(p["cmd"][0].startswith("ray::_TrainerActor") for pid, p in procs.items() if pid in on_n2)
    killed_at = time.monotonic()
    for pid in on_n2:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    state = _wait(
        "the job's end after node 2 was lost",
        lambda: _job(slurm, job).get("JobState") if _job(slurm, job).get("JobState") != "RUNNING" else None,
        240,
        log,
    )
    took = time.monotonic() - killed_at
    text = log.read_text(errors="replace")
    assert state == "FAILED", text[-6000:]
    # docs/operations.md: the driver names the lost rank and its node, within a bound (seconds here: Ray sees
    # the actor's connection drop; its node's heartbeat timeout would take 30 s more)
    lost = r"megatron-dapo train: trainer rank 1 lost \(Ray node \w+, megatron-dapo/node=1\): Actor\w+Error"
    assert re.search(lost, text), text[-8000:]
    assert took < 180, took
    _wait("every process of the job gone", lambda: _gone(procs) and not _job_processes(job), 90, log)
