"""`megatron-dapo train` on its default path: Ray places two embedded servers and a TP=2 trainer
(placement group on a local loopback cluster), rank 0 runs the rollout coordinator as a named actor,
one step runs, everything is torn down."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def test_train_command_with_ray(tmp_path):
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
        sys.executable,
        "-m",
        "megatron_dapo.cli",
        "train",
        "--config",
        str(ROOT / "configs/qwen3/tiny_qwen3_cpu.yaml"),
        f"model.hf_path={model}",
        f"data.train_files=[{train}]",
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
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "trained 1 steps" in out
    assert "rollout coordinator: Ray actor megatron_dapo_coordinator_" in out  # rank 0 started it as a named actor
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["groups/kept"] == 2 and rows[0]["sync/verify_max_abs_diff"] < 1e-4
    assert sorted(p.name for p in (run_dir / "logs").glob("server_*.log")) == ["server_0.log", "server_1.log"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000000"
    # the servers Ray started are gone with the run
    ps = subprocess.run(["pgrep", "-f", f"serve --model {model}"], capture_output=True, text=True)
    assert ps.stdout.strip() == "", f"rollout servers left running: {ps.stdout}"
