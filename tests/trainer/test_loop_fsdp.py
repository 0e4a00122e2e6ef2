"""The DAPO loop end to end with trainer.backend=fsdp2: two FSDP2 trainer ranks (torchrun, gloo) on
a tiny Qwen2 model with tied embeddings (as Qwen2.5-3B), one embedded rollout server over loopback.

Two steps with a checkpoint after each: losses finite, one optimizer step per mini-batch, the
server's weights equal the trainer's after every sync (probe logprobs, fp32) and change at each
sync, DCP checkpoints written. (The DCP round trip itself is checked in tests/workers/fsdp_checks.py;
the loop's resume logic is backend-independent and tested in tests/trainer/test_loop.py.)
"""

import json
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_torchrun

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "qwen3" / "tiny_qwen3_cpu.yaml"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from transformers import AutoTokenizer

    from megatron_dapo.data.arithmetic import ArithmeticTask, write_task
    from megatron_dapo.data.char_tokenizer import build_char_tokenizer
    from megatron_dapo.models.tiny import save_tiny_hf_model
    from megatron_dapo.rollout.launcher import launch_embedded_servers

    root = tmp_path_factory.mktemp("fsdp_loop")
    model = root / "model"
    build_char_tokenizer(model)
    tok = AutoTokenizer.from_pretrained(model)
    save_tiny_hf_model(
        "qwen2",
        model,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    train, _ = write_task(root / "data", ArithmeticTask(max_operand=4, ops="+"), num_test=5)
    servers = launch_embedded_servers(str(model), 1, root / "server_logs", timeout_s=240)
    try:
        yield {"root": root, "model": model, "train": train, "urls": [s.url for s in servers]}
    finally:
        for s in servers:
            s.stop()


def _run(env, name, *overrides, stop_after="-"):
    run_dir = env["root"] / name
    args = [
        f"model.hf_path={env['model']}",
        "model.hf_config=null",
        "trainer.backend=fsdp2",
        "parallel.tp=1",
        f"data.train_files=[{env['train']}]",
        "data.val_files=[]",
        "data.max_response_length=8",
        "algo.overlong_buffer.len=2",
        "algo.train_batch_size=4",
        "algo.ppo_mini_batch_size=2",
        "rollout.n_resp_per_prompt=4",
        "rollout.num_servers=1",
        "reward.name=tests.workers.loop_rewards:parity_reward",
        "optimizer.lr=1e-3",
        "optimizer.lr_warmup_steps=0",
        "trainer.total_steps=2",
        "algo.staleness=1",
        "checkpoint.save_every=1",
        "checkpoint.keep_last=0",
        "trainer.val_every=0",
        "logging.progress_bar=false",
        f"logging.run_dir={run_dir}",
        f"rollout.servers={json.dumps(env['urls'])}",
        "rollout.sync.verify=true",
        *overrides,
    ]
    run_torchrun("loop_run.py", 2, str(CONFIG), str(run_dir / "out"), stop_after, *args, timeout=240)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, rows


def test_fsdp2_loop_trains_syncs_and_checkpoints(env):
    run_dir, rows = _run(env, "a")
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert torch.isfinite(torch.tensor([r["actor/pg_loss"], r["actor/grad_norm"]])).all()
        assert r["actor/optimizer_steps"] == 2 and r["actor/skipped_steps"] == 0
        assert r["sync/verify_max_abs_diff"] < 1e-4  # the server holds exactly the trainer's new weights
        assert r["groups/kept"] == 4
    assert abs(rows[0]["sync/probe_logprob_mean"] - rows[1]["sync/probe_logprob_mean"]) > 1e-5
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_000001"
    for step in range(2):
        assert (ckpts / f"step_{step:06d}" / "model" / ".metadata").exists()  # a DCP checkpoint
    from megatron_dapo.trainer.checkpoint import find_resume_checkpoint

    # resumable: the manifest matches and DCP's pickles hold only what the allow-lists accept
    assert find_resume_checkpoint(ckpts) == ckpts / "step_000001"
