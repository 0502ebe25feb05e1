"""The `specdistill` console script: each subcommand maps onto one library function.

Every command that reports numbers takes `--json` and then prints exactly one JSON object on stdout
(progress bars and logs go to stderr). One module per command group, each declaring its parsers
next to its handlers; common.py holds what they share.
"""

from __future__ import annotations

import argparse
import sys

import specdistill  # noqa: F401  (sets the offline environment before anything else imports)
from specdistill.cli import data, decode, distill, flows, models, ops
from specdistill.env import mask_secrets

GROUPS = (models, data, decode, distill, flows, ops)  # in the order `specdistill --help` lists them


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdistill", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        print(f"specdistill: error: {mask_secrets(str(exc))}", file=sys.stderr)
        return 2
