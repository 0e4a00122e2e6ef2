"""`megatron-dapo demo`: the whole DAPO loop on one CPU machine, in minutes.

1. builds a character-level tokenizer and a tiny random Qwen3-shaped model (4 layers, hidden 64);
2. writes a procedurally generated arithmetic task (a+b, a-b with operands 0..29) in the
   DAPO-Math-17k schema, with a disjoint held-out split;
3. a short supervised warm start on reference answers, so that some groups are informative. Three
   quarters of its answers are written in a second style ("So it is N.") that the DAPO rule does not
   accept (no `Answer:` line): the warm model mostly answers in the rejected style, and DAPO has to
   learn from the reward alone which one pays (and keeps the arithmetic it knows);
4. DAPO through the real stack: 2 embedded SGLang-compatible servers, a TP=2 megatron-core trainer
   on gloo, weight sync after every step, staleness 1, dynamic sampling, overlong shaping;
5. prints held-out accuracy (mean@n, best@n, maj@n, greedy; `trainer.val`) at each validation, writes
   TensorBoard logs and PNG curves to the run dir.
"""

from __future__ import annotations

import argparse
import logging
import random
import time
from pathlib import Path

from megatron_dapo.apps.launch import run_with_ray
from megatron_dapo.apps.plot import plot_run
from megatron_dapo.apps.warm_start import sft_examples, supervised_warm_start
from megatron_dapo.config import load_config
from megatron_dapo.data.arithmetic import ArithmeticTask, answer_of, response_of, write_task
from megatron_dapo.data.char_tokenizer import build_char_tokenizer, vocab_size
from megatron_dapo.data.dataset import read_rows
from megatron_dapo.models.tiny import save_tiny_hf_model

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "qwen3" / "tiny_qwen3_cpu.yaml"


def prepare(
    run_dir: Path,
    warm_steps: int,
    max_operand: int = 29,
    num_test: int = 100,
    seed: int = 0,
    rejected_fraction: float = 0.75,
) -> dict:
    """Tokenizer, tiny model (warm-started), train / held-out data under `run_dir`; returns their paths.

    `rejected_fraction` of the warm-start answers use the style the DAPO rule rejects."""
    from transformers import AutoTokenizer

    model_dir = run_dir / "model"
    data_dir = run_dir / "data"
    train, test = write_task(data_dir, ArithmeticTask(max_operand=max_operand, ops="+-", seed=seed), num_test)
    if not (model_dir / "config.json").exists():
        raw = run_dir / "model_init"
        build_char_tokenizer(raw)
        tok = AutoTokenizer.from_pretrained(raw)
        # generation stops at the chat turn's end (<|im_end|>), as for Qwen3's instruct models
        save_tiny_hf_model(
            "qwen3",
            raw,
            seed=seed,
            vocab_size=vocab_size(),
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            bos_token_id=None,
        )
        rows = read_rows(train)
        style = random.Random(seed)

        def reference(r):
            e = r["extra_info"]
            if style.random() < rejected_fraction:
                return f"So it is {answer_of(e['a'], e['op'], e['b'])}."
            return response_of(e["a"], e["op"], e["b"])

        examples = sft_examples(tok, rows, reference)
        t0 = time.time()
        losses = supervised_warm_start(raw, examples, warm_steps, seed=seed, out_dir=model_dir)
        print(f"warm start: {warm_steps} steps in {time.time() - t0:.0f}s, loss {losses[0]:.2f} -> {losses[-1]:.3f}")
    return {"model": model_dir, "train": train, "test": test}


def held_out_table(points: list[tuple[int, dict]], val) -> str:
    """Held-out accuracy at each validation step, per data source (mean@n, best@n, maj@n, greedy)."""
    from megatron_dapo.coordinator.val_metrics import by_source, format_table

    per_step = [(step, by_source(metrics)) for step, metrics in points]
    sources = list(dict.fromkeys(s for _, m in per_step for s in m))
    title = f"held-out accuracy: {val.n} samples per problem at temperature {val.temperature}, top_p {val.top_p}"
    tables = [
        format_table(f"[{source}] step", {str(step): m.get(source, {}) for step, m in per_step}) for source in sources
    ]
    return "\n".join([title, *tables])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megatron-dapo demo", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", default="runs/demo")
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--steps", type=int, default=30, help="DAPO steps")
    p.add_argument("--warm-steps", type=int, default=1000, help="supervised warm-start steps")
    p.add_argument(
        "--prepared-dir",
        default=None,
        help="take the tiny model, tokenizer and data from this directory, preparing them there only if "
        "absent (default: the run dir); several runs then share one warm start (benchmarks/rollout_corrections.py)",
    )
    p.add_argument("overrides", nargs="*", help="extra key.sub=value config overrides")
    args = p.parse_intermixed_args(argv)  # overrides before, between or after the flags
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    import torch

    # One thread per process: the demo runs several processes on a small machine, and torch's
    # spinning intra-op threads slow a shared CPU down many times over.
    torch.set_num_threads(1)
    t_start = time.time()
    run_dir = Path(args.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    prepared_dir = Path(args.prepared_dir).resolve() if args.prepared_dir else run_dir
    prepared_dir.mkdir(parents=True, exist_ok=True)
    paths = prepare(prepared_dir, args.warm_steps)
    overrides = [
        f"model.hf_path={paths['model']}",
        f"data.train_files=[{paths['train']}]",
        f"data.val_files=[{paths['test']}]",
        f"logging.run_dir={run_dir}",
        f"trainer.total_steps={args.steps}",
        f"trainer.val_every={max(1, args.steps // 3)}",  # held-out accuracy at 4 points
        "checkpoint.save_every=0",
        # 8 samples per prompt and one optimizer step per batch: a steadier signal on a tiny model
        "rollout.n_resp_per_prompt=8",
        "algo.ppo_mini_batch_size=8",
        "optimizer.lr=2e-4",
        "optimizer.lr_warmup_steps=0",
        *args.overrides,
    ]
    cfg = load_config(args.config, overrides)
    print(
        f"DAPO: {cfg.trainer.total_steps} steps x {cfg.algo.train_batch_size} prompts x "
        f"{cfg.rollout.n_resp_per_prompt} samples, TP={cfg.parallel.tp} trainer on gloo, "
        f"{cfg.rollout.num_servers} embedded servers, staleness {cfg.algo.staleness}"
    )
    result = run_with_ray(cfg)
    plots = plot_run(run_dir)
    wall = time.time() - t_start
    print()
    print(held_out_table(result.val["all"], cfg.trainer.val))
    print(
        f"wall time {wall:.0f}s; TensorBoard: tensorboard --logdir {run_dir / 'tensorboard'}; plots: {plots[0].parent}"
    )
    return 0
