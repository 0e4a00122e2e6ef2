"""`megatron-dapo train` on its default path: Ray places two embedded servers and a TP=2 trainer
(placement group on a local loopback cluster), rank 0 runs the rollout coordinator as a named actor,
four steps run, everything is torn down. One of the two servers is SIGKILLed after step 0: the driver's
supervisor relaunches it (rollout.relaunch), the trainer's weight sync re-admits it, and it ends at the
final weight version with the trainer's logprobs (issue 26's done-when, on the Ray path)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _train_command(tmp_path: Path, *overrides: str) -> tuple[list[str], Path, Path]:
    """`megatron-dapo train` of the tiny config on a fresh tiny model and arithmetic data under `tmp_path`,
    2 prompts a step, with `overrides` after the common ones: (command, model dir, run dir)."""
    from transformers import AutoTokenizer

    from megatron_dapo.data.arithmetic import ArithmeticTask, write_task
    from megatron_dapo.data.char_tokenizer import build_char_tokenizer
    from megatron_dapo.models.tiny import save_tiny_hf_model

    model = build_char_tokenizer(tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(model)
    save_tiny_hf_model("qwen3", model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    train, _ = write_task(tmp_path / "data", ArithmeticTask(max_operand=4, ops="+"), num_test=5)
    run_dir = tmp_path / "run"
    cmd = [
        *(sys.executable, "-m", "megatron_dapo.cli", "train"),
        *("--config", str(ROOT / "configs/qwen3/tiny_qwen3_cpu.yaml")),
        f"model.hf_path={model}",
        f"data.train_files=[{train}]",
        "data.val_files=[]",
        "trainer.val_every=0",
        "data.max_response_length=8",
        "algo.overlong_buffer.len=2",
        "algo.train_batch_size=2",
        "algo.ppo_mini_batch_size=2",
        "logging.progress_bar=false",
        f"logging.run_dir={run_dir}",
        *overrides,
    ]
    return cmd, model, run_dir


def test_train_command_with_ray(tmp_path):
    cmd, model, run_dir = _train_command(
        tmp_path,
        # 4 steps: step 3's batch is generated (its rewards held) only after the kill, whatever the timing
        "trainer.total_steps=4",
        "reward.name=tests.workers.loop_rewards:held_parity_reward",
        "reward.timeout_s=600",  # a held reward call is no failure
    )
    hold = tmp_path / "hold"
    hold.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0"}
    env["LOOP_REWARD_HOLD"] = str(hold)
    stop = threading.Event()
    seen: list[tuple[int, str]] = []  # server 1's (pid, URL): the one killed, the relaunched one
    fault = threading.Thread(target=_kill_server_1_after_step_0, args=(run_dir, model, hold, stop, seen), daemon=True)
    fault.start()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env, cwd=ROOT)
    finally:
        stop.set()
        fault.join(10)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "trained 4 steps" in out
    assert "rollout coordinator: Ray actor megatron_dapo_coordinator_" in out  # rank 0 started it as a named actor
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3], out[-6000:]
    assert all(r["groups/kept"] == 2 and r["sync/verify_max_abs_diff"] < 1e-4 for r in rows)
    assert sorted(p.name for p in (run_dir / "logs").glob("server_*.log")) == ["server_0.log", "server_1.log"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000003"
    # server 1 was killed, relaunched by the driver on its port, re-admitted by the weight sync, and ends at the
    # final version with the trainer's probe logprobs (the last row's verify covers every server in service)
    assert len(seen) == 2 and seen[0][0] != seen[1][0] and (hold / "released").exists(), (seen, out[-6000:])
    url = seen[0][1]
    assert f"rollout server {url} relaunched and healthy" in out, out[-6000:]
    assert f"rollout server {url} re-admitted at weight version" in out, out[-6000:]
    assert rows[-1]["server/1/down"] == 0.0 and rows[-1]["server/0/down"] == 0.0
    assert rows[-1]["server/1/version"] == rows[-1]["server/0/version"] == 4.0
    # the servers Ray started are gone with the run
    ps = subprocess.run(["pgrep", "-f", f"serve --model {model}"], capture_output=True, text=True)
    assert ps.stdout.strip() == "", f"rollout servers left running: {ps.stdout}"


def _server_1(model: Path, not_pid: int | None = None):
    """The running server process Ray launched second (`--seed 1`), other than `not_pid`: (pid, its URL)."""
    import psutil

    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if not ({"serve", str(model), "--seed", "--host", "--port"} <= set(cmd)) or p.info["pid"] == not_pid:
            continue
        try:
            if cmd[cmd.index("--seed") + 1] == "1" and p.status() != psutil.STATUS_ZOMBIE:
                return p.info["pid"], f"http://{cmd[cmd.index('--host') + 1]}:{cmd[cmd.index('--port') + 1]}"
        except psutil.Error:  # exited meanwhile
            continue
    return None, None


def _healthy(url: str) -> bool:
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _kill_server_1_after_step_0(run_dir: Path, model: Path, hold: Path, stop: threading.Event, seen: list):
    """Once step 0's metrics row is written: hold the rewards, SIGKILL server 1's process group, and release the
    rewards once the driver has relaunched it (a new process, healthy at the same URL)."""
    metrics = run_dir / "metrics.jsonl"
    while not stop.is_set() and not (metrics.exists() and metrics.read_text().strip()):
        time.sleep(0.05)
    pid, url = _server_1(model)
    if stop.is_set() or pid is None:
        return
    (hold / "killed").touch()
    os.killpg(pid, signal.SIGKILL)
    seen.append((pid, url))
    while not stop.is_set():
        new, new_url = _server_1(model, not_pid=pid)
        if new is not None and new_url == url and _healthy(url):
            seen.append((new, url))
            (hold / "released").touch()
            return
        time.sleep(0.2)


def test_a_killed_trainer_rank_is_restarted_by_the_ray_driver(tmp_path):
    """`megatron-dapo train` on Ray with a trainer rank's process SIGKILLed after checkpoint 0 (the rewards
    held meanwhile, so the run cannot end first): the driver kills the other rank (waiting for the dead one in
    a collective), aborts the servers' requests, starts both ranks again from the latest checkpoint with the
    servers kept, and the run ends after its 3 steps with one metrics row per step."""
    import psutil

    cmd, model, run_dir = _train_command(
        tmp_path,
        "trainer.total_steps=3",
        "trainer.max_restarts=1",
        "checkpoint.save_every=1",
        "reward.name=tests.workers.loop_rewards:held_parity_reward",
        "reward.timeout_s=600",
    )
    hold = tmp_path / "hold"
    hold.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "LOOP_REWARD_HOLD": str(hold)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    killed = []

    def kill_a_rank_after_checkpoint_0():
        latest = run_dir / "checkpoints" / "latest"
        deadline = time.monotonic() + 300
        while not (latest.exists() and latest.read_text().strip() == "step_000000"):
            if proc.poll() is not None or time.monotonic() > deadline:
                return
            time.sleep(0.05)
        (hold / "killed").touch()
        ranks = [
            p for p in psutil.process_iter(["cmdline"]) if "ray::_TrainerActor" in " ".join(p.info["cmdline"] or [])
        ]
        if ranks:
            ranks[0].kill()
            killed.append(ranks[0].pid)
        (hold / "released").touch()

    fault = threading.Thread(target=kill_a_rank_after_checkpoint_0, daemon=True)
    fault.start()
    try:
        out, _ = proc.communicate(timeout=480)
    finally:
        proc.kill()
        fault.join(10)
    assert proc.returncode == 0, out[-6000:]
    assert killed, out[-6000:]
    assert "a trainer rank failed" in out and "restart 1 of 1 from the latest checkpoint" in out, out[-6000:]
    assert "resumed from" in out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2], out[-6000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000002"
    ps = subprocess.run(["pgrep", "-f", f"serve --model {model}"], capture_output=True, text=True)
    assert ps.stdout.strip() == "", f"rollout servers left running: {ps.stdout}"


def test_train_command_colocated_with_ray(tmp_path):
    """`megatron-dapo train` with trainer.placement=colocated on Ray: one bundle per trainer rank holding the rank
    and its server (no bundle of the servers' own), three synchronous steps through the step cycle, each
    server's access log showing the cycle's memory calls in order, the transitions in the step metrics."""
    from tests.trainer.test_loop_colocated import MEMORY_CALLS, _calls

    cmd, model, run_dir = _train_command(
        tmp_path,
        "trainer.total_steps=3",
        "trainer.placement=colocated",
        "algo.staleness=0",
        "rollout.sync.pause_mode=abort",
        "rollout.extra_args=[--log-level,info]",  # the servers' access log
        "reward.name=tests.workers.loop_rewards:parity_reward",
        "checkpoint.save_every=0",
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "trained 3 steps" in out
    assert "colocated: servers release weights and KV cache in" in out  # rank 0 logs each transition
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2], out[-6000:]
    for r in rows:
        assert set(r["sample_versions"]) == {r["step"]} and r["sync/verify_max_abs_diff"] < 1e-4
        assert r["colocate/offloaded_bytes"] > 0 and r["colocate/server_call_failures"] == 0
    for i in (0, 1):
        calls = _calls((run_dir / "logs" / f"server_{i}.log").read_text())
        memory = [c for c in calls if c in MEMORY_CALLS]
        assert memory == ["/release_memory_occupation", *["/resume_memory_occupation"] * 2] * 4, (i, memory)
    ps = subprocess.run(["pgrep", "-f", f"serve --model {model}"], capture_output=True, text=True)
    assert ps.stdout.strip() == "", f"rollout servers left running: {ps.stdout}"
