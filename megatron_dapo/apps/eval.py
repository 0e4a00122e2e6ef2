"""`megatron-dapo eval CONFIG --checkpoint DIR [key.sub=value ...]`: held-out accuracy of one checkpoint.

DIR is a training checkpoint (`<save_dir>/step_NNNNNN/`, or the save_dir itself: its `latest`), a
megatron-core checkpoint written by `megatron-dapo convert hf-to-megatron` / Megatron-LM, or an HF
model directory. Megatron checkpoints are converted to HF safetensors (a temporary directory under
`<logging.run_dir>/eval/`, removed afterwards) while the servers start. Servers are those of
`rollout.servers` (they keep the checkpoint's weights afterwards), or else `rollout.num_servers`
servers (`rollout.engine`) started on this machine from `model.hf_path` and stopped at the end; as
in a run, the weights reach them through the broadcast weight transport. Every prompt of `data.val_files` is
sampled as `trainer.val` says and judged by `reward.*`; a table goes to stdout and a JSON (settings,
prompt counts, metrics) to `--output` (default `<logging.run_dir>/eval/<checkpoint>.json`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.data.dataset import DatasetError, PromptDataset, write_rows
from megatron_dapo.runtime.net import free_port

log = logging.getLogger(__name__)


class EvalError(RuntimeError):
    pass


@dataclass(frozen=True)
class CheckpointSource:
    kind: str  # "training" | "megatron" | "hf"
    path: Path  # what is read: step_NNNNNN/model, the megatron checkpoint, or the HF directory
    label: str  # names the output file
    step: int | None = None


def resolve_checkpoint(path: str | Path) -> CheckpointSource:
    """What kind of checkpoint `path` is, and the directory that holds its weights."""
    from megatron_dapo.trainer import checkpoint as ckpt

    path = Path(path).resolve()
    if not path.is_dir():
        raise EvalError(f"--checkpoint {path} is not a directory")
    if (path / ckpt.LATEST).is_file():
        path = ckpt.latest_checkpoint(path)
    if (path / "trainer.json").is_file():
        step = ckpt.read_trainer_state(path).get("step")
        return CheckpointSource("training", path / "model", path.name, None if step is None else int(step))
    if (path / "latest_checkpointed_iteration.txt").is_file() or (path / "metadata.json").is_file():
        return CheckpointSource("megatron", path, path.name)
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return CheckpointSource("hf", path, path.name)
    raise EvalError(
        f"--checkpoint {path} is neither a training checkpoint (step_NNNNNN/ with trainer.json, or its "
        f"directory with `latest`), a megatron-core checkpoint (metadata.json or "
        f"latest_checkpointed_iteration.txt) nor an HF model directory (config.json + *.safetensors)"
    )


def hf_weights(source: CheckpointSource, cfg, work_dir: Path, layout: dict) -> Path:
    """An HF directory with the checkpoint's weights (converted into `work_dir` when needed)."""
    if source.kind == "hf":
        return source.path
    from megatron_dapo.bridge.checkpoint import HF_CONFIG_DIR
    from megatron_dapo.bridge.convert import ConversionError, megatron_to_hf

    # The checkpoint's own copy of the HF config when it has one (converter output), else the run's model.
    own = source.path / HF_CONFIG_DIR
    hf_config = own if (own / "config.json").is_file() else Path(cfg.model.hf_path)
    try:
        return megatron_to_hf(source.path, work_dir / "hf", hf_config_dir=hf_config, **layout)
    except ConversionError as e:
        raise EvalError(f"converting {source.path} to HF: {e}") from None


def _start_servers(cfg, model_dir: Path, log_dir: Path, stack: ExitStack) -> list[str]:
    from megatron_dapo.rollout import launcher

    rollout = cfg.rollout
    if rollout.engine == "embedded":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        options = launcher.embedded_options(cfg, device)
        servers = launcher.launch_embedded_servers(str(model_dir), rollout.num_servers, log_dir, **options)
        for s in servers:
            stack.callback(s.stop)
        return [s.url for s in servers]
    urls = []
    for i in range(rollout.num_servers):  # server i on GPUs [i * server_tp, (i + 1) * server_tp) of this node
        args = launcher.SGLangServerArgs.from_config(
            cfg, str(model_dir), free_port(rollout.host), random_seed=i, base_gpu_id=i * rollout.server_tp
        )
        proc = launcher.launch_sglang(args, log_dir / f"server_{i}.log")
        stack.callback(proc.stop)
        urls.append(proc.url)
    return urls


def _push_weights(cfg, urls: list[str], model_dir: Path, version: str) -> None:
    """Send the checkpoint's weights to the servers, as the trainer's weight sync does."""
    from megatron_dapo.bridge.fp8 import quantize_stream
    from megatron_dapo.bridge.hf_io import HFCheckpointReader
    from megatron_dapo.sync.broadcast import BroadcastTransport

    rollout = cfg.rollout
    reader = HFCheckpointReader(model_dir)
    tp = rollout.server_tp if rollout.engine == "sglang" else 1
    bridge = BroadcastTransport(
        urls,
        rollout.sync,
        api_key=rollout.api_key,
        server_tp_sizes=[tp] * len(urls),
        master_address=cfg.trainer.bind_host,
    )
    bridge.connect()
    try:
        named = ((name, reader.read(name)) for name in sorted(reader.names()))
        if rollout.weight_format == "fp8_block":  # what the servers run, as the trainer's sync sends it
            named = quantize_stream(named)
        bridge.sync(named, version=version)
    finally:
        bridge.close()


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def _serve_checkpoint(
    cfg, source: CheckpointSource, work: Path, layout: dict, log_dir: Path, stack: ExitStack
) -> list[str]:
    """Servers holding the checkpoint's weights; those started here are stopped when `stack` closes."""
    # They start from model.hf_path (its FP8 copy with fp8_block) while the checkpoint converts, then get its
    # weights as a run's do.
    from megatron_dapo.rollout.launcher import rollout_model_path

    with ThreadPoolExecutor(1) as pool:
        converted = pool.submit(hf_weights, source, cfg, work, layout)
        try:
            urls = list(cfg.rollout.servers) or _start_servers(cfg, Path(rollout_model_path(cfg)), log_dir, stack)
        finally:
            model_dir = converted.result()
    _push_weights(cfg, urls, model_dir, version=f"eval:{source.label}")
    return urls


def run_eval(
    cfg, checkpoint: str | Path, output: Path | None = None, samples: Path | None = None, layout: dict | None = None
) -> dict:
    """Evaluate one checkpoint; returns (and writes) the result dict."""
    if not cfg.data.val_files:
        raise EvalError("data.val_files is empty: nothing to evaluate")
    t0 = time.time()
    source = resolve_checkpoint(checkpoint)

    from transformers import AutoTokenizer

    from megatron_dapo.coordinator.build import reward_runner
    from megatron_dapo.coordinator.evaluate import ValSettings, evaluate
    from megatron_dapo.coordinator.val_metrics import by_source, format_table

    eval_dir = Path(cfg.logging.run_dir) / "eval"
    output = Path(output) if output else eval_dir / f"{source.label}.json"
    work = eval_dir / f".work-{source.label}-{os.getpid()}"
    with ExitStack() as stack:
        work.mkdir(parents=True, exist_ok=True)
        stack.callback(shutil.rmtree, work, True)
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
        dataset = PromptDataset(cfg.data.val_files, tokenizer, cfg.data.max_prompt_length)
        urls = _serve_checkpoint(cfg, source, work, layout or {}, eval_dir / "logs", stack)
        settings = ValSettings.from_config(cfg)
        rewards = reward_runner(cfg)
        stack.callback(rewards.close)  # its worker processes (reward.num_workers)
        report = evaluate(
            urls,
            dataset,
            rewards,
            settings,
            api_key=cfg.rollout.api_key,
            tokenizer=tokenizer,
            timeout_s=cfg.rollout.request_timeout_s,
        )
    prompts = dict(sorted(Counter(o.data_source for o in report.outcomes).items()))
    result = {
        "checkpoint": str(source.path),
        "kind": source.kind,
        "step": source.step,
        "val_files": list(cfg.data.val_files),
        "prompts": prompts,
        "dropped_too_long": dataset.num_dropped_too_long,  # prompts over data.max_prompt_length
        "settings": {
            "n": settings.n,
            "greedy": settings.greedy,
            "seed": settings.seed,
            **{k: v for k, v in asdict(settings.sampling).items() if k not in ("n", "sampling_seed")},
        },
        "metrics": report.metrics,
        "wall_s": round(time.time() - t0, 1),
    }
    _write_json(output, result)
    if samples is not None:
        write_rows(samples, report.samples)
    per_source = by_source(report.metrics)
    rows = {source: {"prompts": count, **per_source.get(source, {})} for source, count in prompts.items()}
    result["table"] = format_table("data source", rows)
    result["output"] = str(output)
    return result


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-dapo eval", description=__doc__.splitlines()[0])
    p.add_argument("config", help="the run's YAML config (data.val_files, trainer.val, rollout, reward)")
    p.add_argument(
        "--checkpoint",
        required=True,
        help="step_NNNNNN/ or its save_dir, a megatron-core checkpoint or an HF model directory",
    )
    p.add_argument("--output", default=None, help="result JSON (default <logging.run_dir>/eval/<checkpoint>.json)")
    p.add_argument("--samples", default=None, help="also write every judged answer to this jsonl file")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size to read a megatron checkpoint with")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size to read it with")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size to read it with (MoE)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. trainer.val.n=4")
    return p


def main(argv: list[str] | None = None) -> int:
    from megatron_dapo.trainer.checkpoint import CheckpointError

    args = _parser().parse_intermixed_args(argv)  # overrides may come before or after --checkpoint
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
        result = run_eval(cfg, args.checkpoint, args.output, args.samples, dict(tp=args.tp, pp=args.pp, ep=args.ep))
    except (ConfigError, EvalError, CheckpointError, DatasetError, FileNotFoundError) as e:
        print(f"megatron-dapo eval: error: {e}", file=sys.stderr)
        return 2
    s = result["settings"]
    step = f" (step {result['step']})" if result["step"] is not None else ""
    print(
        f"{result['checkpoint']}{step}: n={s['n']} at temperature {s['temperature']}, top_p {s['top_p']}, "
        f"max {s['max_new_tokens']} new tokens{', plus greedy' if s['greedy'] else ''}"
    )
    print(result["table"])
    print(f"wrote {result['output']} ({result['wall_s']:.0f}s)")
    return 0
