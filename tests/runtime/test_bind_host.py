"""A default run listens on loopback only (trainer.bind_host and rollout.host default to 127.0.0.1).

Fast: the trainer's TCPStore helper and the weight-update group bind their store to the given address
alone (torch's own TCPStore binds the wildcard), and a wildcard / non-IP `trainer.bind_host` is refused
naming the key. Slow: `megatron-dapo train` on its two paths, the Ray default (a local Ray cluster,
server actors, trainer actors, the coordinator actor) and torchrun with external servers; the listening
sockets of every process under the run are sampled while it trains, and each must be on loopback.
"""

import datetime
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.runtime.net import LOOPBACK, free_port, interface_of, is_loopback

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "qwen3" / "tiny_qwen3_cpu.yaml"


def _own_listeners(port: int) -> list[str]:
    return [
        c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == "LISTEN" and c.laddr.port == port
    ]


def _external_ipv4() -> list[str]:
    """One address of this machine that is not loopback, if it has one (a bind_host for several machines)."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not is_loopback(a.address):
                return [a.address]
    return []


@pytest.mark.parametrize("host", [LOOPBACK, *_external_ipv4()])
def test_tcp_store_listens_on_its_host_alone(host):
    from megatron_dapo.runtime.distributed import tcp_store

    timeout = datetime.timedelta(seconds=30)
    master = tcp_store(host, 0, 1, True, timeout)  # world 1: the master does not wait for the client
    assert _own_listeners(master.port) == [host]
    client = tcp_store(host, master.port, 1, False, timeout)
    client.set("from_client", "1")
    assert master.get("from_client") == b"1"


def test_weight_update_group_store_listens_on_master_address():
    import torch

    from megatron_dapo.rollout import weight_group

    port = free_port()
    pg = weight_group.init_weight_update_group(LOOPBACK, port, 0, 1, "bind_test", "gloo", timeout_s=30)
    try:
        assert _own_listeners(port) == [LOOPBACK]
        t = torch.ones(3)
        weight_group.broadcast(t, pg)
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        weight_group.destroy_weight_update_group(pg)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "my-host"])
def test_bind_host_must_be_one_address(host):
    with pytest.raises(ConfigError, match=rf"trainer\.bind_host={host!r}|trainer\.bind_host={host} "):
        load_config(CONFIG, [f"trainer.bind_host={host}"])


def test_local_ray_refuses_an_address_this_machine_lacks():
    from megatron_dapo.apps.launch import LaunchError, _init_ray

    cfg = load_config(CONFIG, ["trainer.bind_host=203.0.113.7"])  # TEST-NET-3: on no interface here
    assert interface_of("203.0.113.7") is None
    with pytest.raises(LaunchError, match=r"trainer\.bind_host=203\.0\.113\.7 is not an address of this machine"):
        _init_ray(cfg)


def test_bind_host_default_is_loopback():
    assert load_config(CONFIG).trainer.bind_host == LOOPBACK
    assert load_config(CONFIG, ["trainer.bind_host=::1"]).trainer.bind_host == "::1"


# ---- whole runs ------------------------------------------------------------------------------------


def _label(p: psutil.Process) -> str:
    cmd = " ".join(p.cmdline())
    return f"{p.pid} {p.name()} {cmd[:160]}"


def _listeners_under(root: psutil.Process) -> dict[tuple[str, str, int], str]:
    """(ip, port) of every listening TCP socket of `root` and its descendants -> the process's label."""
    found = {}
    try:
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for p in procs:
        try:
            conns = p.net_connections("inet")
            label = _label(p)
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                found[(p.name(), c.laddr.ip, c.laddr.port)] = label
    return found


def _gloo_interfaces_under(root: psutil.Process) -> dict[int, str | None]:
    """GLOO_SOCKET_IFNAME in the environment of each Ray trainer rank under `root`."""
    found = {}
    try:
        procs = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for p in procs:
        try:
            if "_TrainerActor" in " ".join(p.cmdline()):
                found[p.pid] = p.environ().get("GLOO_SOCKET_IFNAME")
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
    return found


def _watch(proc: subprocess.Popen, timeout: float, sample=_listeners_under) -> dict:
    """Merge `sample(process tree)` until the run exits (at most `timeout` s; then it is killed)."""
    root = psutil.Process(proc.pid)
    seen = {}
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            for p in root.children(recursive=True) + [root]:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            proc.wait(30)
            raise AssertionError(f"run did not end within {timeout}s:\n{proc.stdout.read()[-6000:]}")
        seen.update(sample(root))
        time.sleep(0.2)
    return seen


def _not_loopback(seen: dict) -> list[str]:
    return [f"{ip}:{port} ({label})" for (_, ip, port), label in seen.items() if not is_loopback(ip)]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from transformers import AutoTokenizer

    from megatron_dapo.data.arithmetic import ArithmeticTask, write_task
    from megatron_dapo.data.char_tokenizer import build_char_tokenizer
    from megatron_dapo.models.tiny import save_tiny_hf_model

    root = tmp_path_factory.mktemp("bind")
    model = build_char_tokenizer(root / "model")
    tok = AutoTokenizer.from_pretrained(model)
    save_tiny_hf_model("qwen3", model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    train, _ = write_task(root / "data", ArithmeticTask(max_operand=4, ops="+"), num_test=5)
    return {"root": root, "model": model, "train": train}


def _train_args(task, run_dir: Path) -> list[str]:
    return [
        "train",
        "--config",
        str(CONFIG),
        f"model.hf_path={task['model']}",
        f"data.train_files=[{task['train']}]",
        "data.val_files=[]",
        "trainer.total_steps=1",
        "trainer.val_every=0",
        "data.max_response_length=8",
        "algo.overlong_buffer.len=2",
        "algo.train_batch_size=2",
        "algo.ppo_mini_batch_size=2",
        "reward.name=tests.workers.loop_rewards:parity_reward",
        "logging.progress_bar=false",
        f"logging.run_dir={run_dir}",
    ]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0"}


def _assert_trained(proc: subprocess.Popen, run_dir: Path) -> str:
    out = proc.stdout.read()
    assert proc.returncode == 0, out[-6000:]
    assert "trained 1 steps" in out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["sync/verify_max_abs_diff"] < 1e-4  # the weight-update group formed
    return out


@pytest.mark.slow
def test_ray_run_listens_on_loopback_only(task):
    run_dir = task["root"] / "ray_run"
    cmd = [sys.executable, "-m", "megatron_dapo.cli", *_train_args(task, run_dir)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=ROOT, start_new_session=True
    )
    seen = _watch(proc, timeout=300, sample=lambda root: {**_listeners_under(root), **_gloo_interfaces_under(root)})
    _assert_trained(proc, run_dir)
    # the ranks' gloo pairs are told loopback's interface (left alone they take the address the host
    # name resolves to, which is loopback on this machine but seldom elsewhere)
    gloo = {pid: name for pid, name in seen.items() if isinstance(pid, int)}
    assert len(gloo) >= 2 and set(gloo.values()) == {interface_of(LOOPBACK)}, gloo
    seen = {k: v for k, v in seen.items() if not isinstance(k, int)}
    names = {name for name, _, _ in seen}
    # the listeners of the defect were sampled: Ray's GCS and raylet, its runtime-env agent, the driver,
    # the actors (trainer ranks: core worker, stores), the embedded servers
    assert {"gcs_server", "raylet"} <= names, sorted(seen.values())
    labels = set(seen.values())
    for part in ("RuntimeEnvAgent", "_TrainerActor", "megatron_dapo.cli serve", "megatron_dapo.cli train"):
        assert any(part in label for label in labels), (part, sorted(labels))
    assert not _not_loopback(seen), _not_loopback(seen)


@pytest.mark.slow
def test_torchrun_run_listens_on_loopback_only(task):
    from megatron_dapo.rollout.launcher import launch_embedded_servers

    run_dir = task["root"] / "torchrun_run"
    servers = launch_embedded_servers(str(task["model"]), 2, task["root"] / "server_logs", timeout_s=240)
    try:
        urls = json.dumps([s.url for s in servers])
        master_port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            "--nnodes=1",
            f"--master-addr={LOOPBACK}",
            f"--master-port={master_port}",
            "-m",
            "megatron_dapo.cli",
            *_train_args(task, run_dir),
            "trainer.launcher=torchrun",
            f"rollout.servers={urls}",
        ]
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_env(),
            cwd=ROOT,
            start_new_session=True,
        )
        seen = _watch(proc, timeout=300)
        _assert_trained(proc, run_dir)
        for s in servers:  # the servers are the test's own processes: their sockets checked here
            seen.update(_listeners_under(psutil.Process(s.proc.pid)))
    finally:
        for s in servers:
            s.stop()
    # torchrun's own rendezvous store (in the launcher, on --master-port) listens where torch binds it,
    # on every interface; torch has no option for it (docs/security.md). Everything else: loopback.
    launcher_store = [k for k in seen if k[2] == master_port]
    assert launcher_store, sorted(seen.values())
    for k in launcher_store:
        del seen[k]
    labels = set(seen.values())
    assert any("megatron_dapo.cli train" in label for label in labels), sorted(labels)  # the ranks' stores
    assert sum("megatron_dapo.cli serve" in label for label in labels) == 2, sorted(labels)
    assert not _not_loopback(seen), _not_loopback(seen)
