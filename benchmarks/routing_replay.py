"""Rollout routing replay (R3) on the tiny MoE CPU config: replay on vs off, the same seeds and data.

Trains `--steps` steps of configs/qwen3/tiny_qwen3_moe_cpu.yaml twice (algo.routing_replay=rollout, then
none; a random tiny Qwen3-MoE with a character tokenizer on a small addition task, one embedded server,
staleness 1) and prints per step the train/rollout logprob difference
(actor/train_rollout_logprob_abs_diff: mean |old - rollout logprob| over loss tokens) of both runs and
their ratio, with the routing agreement and the bytes replay moves (rollout/routing_bytes: the samples'
compact ids; actor/routing_replay_bytes: the int64 ids handed to the routers, all passes).

    python benchmarks/routing_replay.py [--steps 3] [--workdir /tmp/routing_replay]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "qwen3" / "tiny_qwen3_moe_cpu.yaml"


def prepare(workdir: Path) -> tuple[Path, Path]:
    from transformers import AutoTokenizer

    from megatron_dapo.data.arithmetic import ArithmeticTask, write_task
    from megatron_dapo.data.char_tokenizer import build_char_tokenizer
    from megatron_dapo.models.tiny import save_tiny_hf_model

    model = workdir / "model"
    if not model.exists():
        build_char_tokenizer(model)
        tok = AutoTokenizer.from_pretrained(model)
        ids = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
        save_tiny_hf_model("qwen3_moe", model, **ids)
    train, _ = write_task(workdir / "data", ArithmeticTask(max_operand=4, ops="+"), num_test=5)
    return model, train


def run_overrides(model: Path, train: Path, run_dir: Path, steps: int, *extra: str) -> list[str]:
    """The tiny MoE config on `model` and `train`: short responses, one server, no validation (also the
    end-to-end test's run, tests/coordinator/test_routing_replay_data.py)."""
    return [
        f"model.hf_path={model}",
        "model.hf_config=null",
        f"data.train_files=[{train}]",
        "data.val_files=[]",
        "data.max_response_length=8",
        "algo.overlong_buffer.len=2",
        "algo.filter_groups.enable=false",  # a random model answers nothing right
        f"trainer.total_steps={steps}",
        "trainer.val_every=0",
        "rollout.num_servers=1",
        "logging.progress_bar=false",
        f"logging.run_dir={run_dir}",
        *extra,
    ]


def run(mode: str, model: Path, train: Path, workdir: Path, steps: int) -> tuple[list[dict], float]:
    run_dir = workdir / f"run_{mode}"
    overrides = run_overrides(model, train, run_dir, steps, "checkpoint.save_every=0", f"algo.routing_replay={mode}")
    start = time.time()
    cmd = [sys.executable, "-m", "megatron_dapo.cli", "train", "--config", str(CONFIG), *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"{mode} run failed:\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, time.time() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/routing_replay"))
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    model, train = prepare(args.workdir)
    on, t_on = run("rollout", model, train, args.workdir, args.steps)
    off, t_off = run("none", model, train, args.workdir, args.steps)
    diff = "actor/train_rollout_logprob_abs_diff"
    print(f"wall: replay {t_on:.0f} s, no replay {t_off:.0f} s")
    print(
        "| step | logprob diff, replay | logprob diff, own routing | ratio | routing agreement | "
        "rollout/routing_bytes | actor/routing_replay_bytes |"
    )
    print("|---|---|---|---|---|---|---|")
    for a, b in zip(on, off):
        ratio = a[diff] / b[diff] if b[diff] else float("nan")
        print(
            f"| {a['step']} | {a[diff]:.3g} | {b[diff]:.3g} | {ratio:.2f} | {a['actor/routing_agreement']:.4f} | "
            f"{a['rollout/routing_bytes']:.0f} | {a['actor/routing_replay_bytes']:.0f} |"
        )


if __name__ == "__main__":
    main()
