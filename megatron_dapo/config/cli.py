"""`megatron-dapo config show|validate CONFIG [key=value ...]`."""

from __future__ import annotations

import argparse
import sys

from megatron_dapo.config.errors import ConfigError
from megatron_dapo.config.load import dump_yaml, load_config
from megatron_dapo.config.validate import validate_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-dapo config", description=__doc__)
    sub = parser.add_subparsers(dest="action", required=True)
    for name, help_ in (
        ("show", "print the resolved config (file + overrides + defaults) as YAML"),
        ("validate", "check the config; print notes about skipped checks"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("config", help="YAML config file")
        p.add_argument("overrides", nargs="*", metavar="key.sub=value")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    try:
        cfg = load_config(args.config, args.overrides, validate=False)
        notes = validate_config(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if args.action == "show":
        sys.stdout.write(dump_yaml(cfg))
    else:
        print(f"{args.config}: ok")
    return 0
