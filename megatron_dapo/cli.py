"""`megatron-dapo` command line.

Each sub-command lives in megatron_dapo.apps (or, for `config`, `convert`, `simulate` and `serve`, in the
package it drives) and is imported only when invoked, so `megatron-dapo config show` never pays for
importing megatron-core.
A sub-command entry point is a function `main(argv: list[str]) -> int | None`.
"""

from __future__ import annotations

import importlib
import sys

# name -> ("module:function", one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "config": ("megatron_dapo.config.cli:main", "show / validate a resolved config"),
    "convert": ("megatron_dapo.bridge.cli:main", "HF <-> Megatron checkpoint conversion"),
    "train": ("megatron_dapo.apps.train:main", "run DAPO training from a YAML config"),
    "eval": ("megatron_dapo.apps.eval:main", "held-out accuracy (mean@n, best@n, maj@n) of a checkpoint"),
    "demo": ("megatron_dapo.apps.demo:main", "the tiny end-to-end DAPO run on CPU"),
    "smoke": ("megatron_dapo.apps.smoke:main", "a tiny megatron-core training run (TP=2, gloo)"),
    "plan": ("megatron_dapo.apps.plan:main", "process layout and memory estimate for a cluster"),
    "plot": ("megatron_dapo.apps.plot:main", "write PNG curves of a run's TensorBoard scalars"),
    "simulate": ("megatron_dapo.sim.cli:main", "predict cluster throughput: the real coordinator, simulated engines"),
    "serve": ("megatron_dapo.embedded_server.server:main", "the embedded SGLang-compatible server"),
    "profile-engine": (
        "megatron_dapo.apps.profile_engine:main",
        "measure a rollout server and fit its decode-step cost model",
    ),
}


def _usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: megatron-dapo COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"megatron-dapo: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    target, _ = COMMANDS[name]
    module_name, func_name = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    rc = func(rest)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
