"""`megatron-dapo train --config CONFIG [--resume] [key.sub=value ...]`.

With `trainer.launcher: ray` (default) this process is the driver: it places servers and
trainer ranks with Ray (starting a local cluster when `trainer.ray_address` is unset). Under
torchrun (or with `trainer.launcher=torchrun`) every rank trains and the servers are
`rollout.servers`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from megatron_dapo.apps.launch import LaunchError, run_with_ray, run_with_torchrun
from megatron_dapo.config import ConfigError, load_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-dapo train", description="DAPO training from a YAML config")
    p.add_argument("--config", required=True, help="YAML config (see configs/qwen3/)")
    p.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. trainer.total_steps=5")
    return p


def main(argv: list[str] | None = None) -> int:
    from megatron_dapo.trainer.loop import RunSetupError

    args = _parser().parse_intermixed_args(argv)  # overrides before, between or after the flags
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"megatron-dapo train: {e}", file=sys.stderr)
        return 2
    if args.resume:
        cfg.checkpoint.resume = True
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
    try:
        if cfg.trainer.launcher == "torchrun" or under_torchrun:
            result = run_with_torchrun(cfg, resume=cfg.checkpoint.resume)
        else:
            result = run_with_ray(cfg, resume=cfg.checkpoint.resume)
    except (LaunchError, ConfigError, RunSetupError) as e:  # bad data or checkpoint: named on every rank
        print(f"megatron-dapo train: {e}", file=sys.stderr)
        return 2
    if result is not None:
        print(f"trained {result.steps_done} steps (last step {result.last_step}); run dir: {cfg.logging.run_dir}")
        if result.val.get("last"):
            print(f"held-out accuracy at step {result.val['last'][0]}: {result.val['last'][1]}")
    return 0
