"""What every command group shares: declaring a subcommand (with `--json`), printing its result,
and the `--threads` and `--db` options."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

Handler = Callable[[argparse.Namespace], int]
Subcommands = argparse._SubParsersAction  # what add_subparsers() returns


def command(parent: Subcommands, name: str, handler: Handler, help: str, example: str,
            description: str | None = None) -> argparse.ArgumentParser:
    """A subcommand that runs `handler(args) -> exit code`; `example` (the words after `specdistill`)
    is shown under its --help, and tests/test_cli.py checks that it parses."""
    p = parent.add_parser(name, help=help, description=description or help, epilog=f"example: specdistill {example}")
    add_json(p)
    p.set_defaults(func=handler)
    return p


def group(parent: Subcommands, name: str, help: str) -> Subcommands:
    """A command made of subcommands (`specdistill NAME SUBCOMMAND ...`)."""
    return parent.add_parser(name, help=help, description=help).add_subparsers(dest=f"{name}_command", required=True)


def add_json(p: argparse.ArgumentParser) -> None:
    # SUPPRESS rather than False: a nested subcommand's default never undoes a --json given before
    # it (`specdistill demo --json key=value`). Read it through emit().
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print exactly one JSON object on stdout")


def emit(args: argparse.Namespace, payload: dict, text: str) -> None:
    """The command's result: `payload` as one JSON object with --json, else `text`."""
    if getattr(args, "json", False):
        print(json.dumps(payload, default=str))
    else:
        print(text)


def add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 avoids stalls on a busy machine)")


def set_threads(args: argparse.Namespace) -> None:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)


def add_db(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", default=None,
                   help="log store URL (default $SPECDISTILL_LOG_DB, else sqlite under $SPECDISTILL_HOME/logs.db)")


def log_store(args: argparse.Namespace):
    """The log store named by --db, as a context manager (`with log_store(args) as store:`)."""
    from specdistill.data.logstore import LogStore

    return LogStore(args.db)
