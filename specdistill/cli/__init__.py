"""The `specdistill` console script: each subcommand maps onto one library function.

Every command that reports numbers takes `--json` and then prints exactly one JSON object on stdout
(progress bars and logs go to stderr). One module per command group, each declaring its parsers
next to its handlers; common.py holds what they share.
"""

from __future__ import annotations

import argparse
import json
import sys

import specdistill  # noqa: F401  (sets the offline environment before anything else imports)
from specdistill.cli import data, decode, distill, flows, models, ops
from specdistill.cli.common import Parser, describe_error, fail, stdout_for_the_result

GROUPS = (models, data, decode, distill, flows, ops)  # in the order `specdistill --help` lists them


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="specdistill", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.register(sub)
    return parser


INTERRUPTED_EXIT = 130  # 128 + SIGINT, as a shell reports it


def interrupted(words: list[str]) -> str:
    """What Ctrl-C left: the sentence names the command to run again (its words, shell-quoted)."""
    import shlex  # lazy: only an interrupt needs it

    again = shlex.join(["specdistill", *words])
    return (f"interrupted: nothing is half-written (what was finished is kept, committed or written whole); "
            f"to resume, run the same command again: {again}")


def main(argv: list[str] | None = None) -> int:
    """Run one command: its exit code. An error a user can act on is one sentence on stderr (and with
    --json one `{"error", "exit_code"}` object on stdout), never a traceback."""
    words = sys.argv[1:] if argv is None else list(argv)
    Parser.last_error = None
    try:
        args = build_parser().parse_args(words)
    except SystemExit as exc:  # argparse printed its usage error (2), or --help (0)
        if exc.code not in (0, None) and "--json" in words and Parser.last_error:
            print(json.dumps({"error": Parser.last_error, "exit_code": exc.code}))
        raise
    wants_json = getattr(args, "json", False)
    with stdout_for_the_result(wants_json):
        try:
            return args.func(args)
        except KeyboardInterrupt:  # Ctrl-C: every command writes atomically or in committed batches
            return fail(wants_json, interrupted(words), INTERRUPTED_EXIT, line=f"specdistill: {interrupted(words)}")
        except Exception as exc:
            message = describe_error(exc)
            if message is None:
                raise
            return fail(wants_json, message)
