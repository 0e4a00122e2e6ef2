"""launch/torchrun_external_sglang.sh across two torchrun agents (NNODES=2, NODE_RANK 0 and 1, one rank each,
their rendezvous store on 127.0.0.1), training the tiny config for 2 steps with two rollout servers started
beforehand and given as external URLs (docs/cluster.md, "torchrun with servers you started yourself"; here
embedded servers, `rollout.engine=embedded` after the script's `rollout.engine=sglang`).

Each agent's ranks are read from the environment of its own child processes (RANK, GROUP_RANK): trainer rank 0
under agent 0, rank 1 under agent 1, the TP=2 group spanning the two agents.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_dapo.runtime.net import free_port
from tests.dist_utils import kill_tree
from tests.launch.sockets import listening_off_loopback

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _ranks_under(agent: subprocess.Popen) -> dict[int, tuple[str, str]]:
    """pid -> (GROUP_RANK, RANK) of the trainer processes below one torchrun agent."""
    found = {}
    try:
        children = psutil.Process(agent.pid).children(recursive=True)
    except psutil.Error:
        return found
    for p in children:
        try:
            env, cmd = p.environ(), " ".join(p.cmdline())
        except (psutil.Error, OSError):
            continue
        if "RANK" in env and "megatron_dapo.cli" in cmd and "torch.distributed.run" not in cmd:
            found[p.pid] = (env.get("GROUP_RANK"), env["RANK"])
    return found


def test_torchrun_two_agents_train_with_external_servers(tmp_path):
    from transformers import AutoTokenizer

    from megatron_dapo.data.arithmetic import ArithmeticTask, write_task
    from megatron_dapo.data.char_tokenizer import build_char_tokenizer
    from megatron_dapo.models.tiny import save_tiny_hf_model
    from megatron_dapo.rollout.launcher import launch_embedded_servers

    model = build_char_tokenizer(tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(model)
    save_tiny_hf_model("qwen3", model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    train, _ = write_task(tmp_path / "data", ArithmeticTask(max_operand=4, ops="+"), num_test=5)
    run_dir = tmp_path / "run"
    servers = launch_embedded_servers(str(model), 2, tmp_path / "servers")
    agents: list[subprocess.Popen] = []
    try:
        env = {
            **os.environ,
            "PATH": f"{BIN}:{os.environ['PATH']}",
            "PYTHONPATH": str(ROOT),
            "MEGATRON_DAPO": str(BIN / "megatron-dapo"),
            "OMP_NUM_THREADS": "1",
            "NNODES": "2",
            "NPROC_PER_NODE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port("127.0.0.1")),
            "SGLANG_SERVERS": ",".join(s.url for s in servers),
        }
        overrides = [
            "rollout.engine=embedded",  # the script says sglang; a later key=value wins
            f"model.hf_path={model}",
            f"data.train_files=[{train}]",
            "data.val_files=[]",
            "trainer.total_steps=2",
            "trainer.val_every=0",
            "data.max_response_length=8",
            "algo.overlong_buffer.len=2",
            "algo.train_batch_size=2",
            "algo.ppo_mini_batch_size=2",
            "reward.name=tests.workers.loop_rewards:parity_reward",
            "checkpoint.save_every=1",
            "logging.progress_bar=false",
            f"logging.run_dir={run_dir}",
        ]
        for node_rank in (0, 1):
            agents.append(
                subprocess.Popen(
                    ["bash", "launch/torchrun_external_sglang.sh", "configs/qwen3/tiny_qwen3_cpu.yaml", *overrides],
                    cwd=ROOT,
                    env={**env, "NODE_RANK": str(node_rank)},
                    stdout=open(tmp_path / f"agent_{node_rank}.log", "w"),  # noqa: SIM115 - closed with the process
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            )
        seen: list[set] = [set(), set()]
        off_loopback: set[str] = set()
        deadline = time.monotonic() + 420
        while any(a.poll() is None for a in agents) and time.monotonic() < deadline:
            for i, a in enumerate(agents):
                ranks = _ranks_under(a)
                seen[i] |= set(ranks.values())
                # the ranks (gloo, the coordinator rank 0 starts) listen on loopback only; torchrun's own store
                # does not (torch offers no bind address for it: docs/cluster.md)
                off_loopback |= {s.split(" ", 1)[1] for s in listening_off_loopback(ranks)}
            time.sleep(0.5)
        logs = [(tmp_path / f"agent_{i}.log").read_text(errors="replace") for i in (0, 1)]
        assert all(a.poll() == 0 for a in agents), (
            f"rc {[a.poll() for a in agents]}\n{logs[0][-5000:]}\n{logs[1][-3000:]}"
        )
    finally:
        for a in agents:
            if a.poll() is None:
                kill_tree(a)
        for s in servers:
            s.stop()
    # trainer rank 0 under agent 0 (node rank 0), rank 1 under agent 1: the ranks split over the two agents
    assert seen == [{("0", "0")}, {("1", "1")}], seen
    assert off_loopback == set()
    assert "trained 2 steps" in logs[0], logs[0][-5000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["sync/verify_max_abs_diff"] < 1e-4 for r in rows)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000001"
