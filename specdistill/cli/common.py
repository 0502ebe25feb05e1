"""What every command group shares: declaring a subcommand (with `--json`), printing its result,
and the `--threads` and `--db` options."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from specdistill import bounds
from specdistill.data.record import to_dict
from specdistill.env import mask_secrets

Handler = Callable[[argparse.Namespace], int]


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1, checked while parsing (before any model loads)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def count_in(high: int, low: int = 1) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high] (a count that sizes memory or work: `specdistill.bounds`)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {low} to {high}, got {value}")
        return value
    parse.__name__ = "count"  # argparse names a type in its messages
    return parse


seed = count_in(2**32 - 1, low=0)  # what every generator (torch, numpy, random) takes


def thread_count(text: str) -> int:
    """An argparse type: torch threads this machine can run (`bounds.check_threads`: tens of thousands abort OpenMP)."""
    try:
        return bounds.check_threads(positive_int(text), "")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).strip()) from None


def number_in(low: float, high: float = float("inf"), *, low_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in [low, high] ((low, high] with `low_open`)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value != value or value in (float("inf"), float("-inf")) or value > high or value < low \
                or (low_open and value == low):
            bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"must be in {bounds}, got {text}")
        return value
    return parse


port_number = positive_int  # the upper bound is checked with the host (ops.metrics.check_listen_address)
Subcommands = argparse._SubParsersAction  # what add_subparsers() returns


def command(parent: Subcommands, name: str, handler: Handler, help: str, example: str,
            description: str | None = None) -> argparse.ArgumentParser:
    """A subcommand that runs `handler(args) -> exit code`; `example` (the words after `specdistill`)
    is shown under its --help, and tests/test_cli.py checks that it parses."""
    # argparse %-formats a help string (not a description): a literal % ("below 50%") is written %%
    p = parent.add_parser(name, help=help.replace("%", "%%"), description=description or help,
                          epilog=f"example: specdistill {example}")
    # SUPPRESS rather than False: a nested subcommand's default never undoes a --json given before
    # it (`specdistill demo --json key=value`). Read it through emit().
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print exactly one JSON object on stdout")
    p.set_defaults(func=handler)
    return p


def group(parent: Subcommands, name: str, help: str) -> Subcommands:
    """A command made of subcommands (`specdistill NAME SUBCOMMAND ...`)."""
    return parent.add_parser(name, help=help.replace("%", "%%"), description=help).add_subparsers(dest=f"{name}_command", required=True)


def _finite(value):
    """`value` with every NaN or infinity as None: JSON has no NaN (`"loss": NaN` is not JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


# what a terminal acts on instead of showing: C0 controls but newline and tab (ESC starts a sequence that
# can rewrite the screen or the title), DEL, C1 controls, and the bidirectional overrides that reorder text
_UNSHOWN = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` as it may reach a terminal: every string read from a file or given by a user (a served name, a
    file name, a reason, a quarantined record) goes through here, its control characters written as escapes
    (`\x1b`, `\u202e`). JSON output needs none: json.dumps escapes them."""
    return _UNSHOWN.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}",
                        str(text))


def emit(args: argparse.Namespace, payload: dict, text: str) -> None:
    """The command's result: `payload` as one JSON object with --json (stage outputs by their `to_dict`; a
    number that is not finite as null), else `text` with its control characters escaped (`printable`)."""
    if getattr(args, "json", False):
        print_result(json.dumps(_finite(to_dict(payload)), default=str, allow_nan=False))
    else:
        print(printable(text))


_RESULT_STDOUT: list[tuple[int, object]] = []  # while a --json command runs: the real stdout (its fd, its stream)


@contextlib.contextmanager
def stdout_for_the_result(wants_json: bool) -> Iterator[None]:
    """With --json, stdout carries the one JSON object and nothing else: what a library or a child process
    writes there while the command runs (MLflow's run links, a server's log, a stray print) goes to stderr,
    at the file descriptor, so a script's `json.loads(stdout)` holds for a monitor run that retrained too."""
    if not wants_json:
        yield
        return
    sys.stdout.flush()
    saved = (os.dup(1), sys.stdout)
    _RESULT_STDOUT.append(saved)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        _RESULT_STDOUT.remove(saved)
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.close(saved[0])
        sys.stdout = saved[1]


def print_result(line: str) -> None:
    """One line on the real stdout, also while `stdout_for_the_result` sends everything else to stderr."""
    if not _RESULT_STDOUT:
        print(line, flush=True)
        return
    fd, stream = _RESULT_STDOUT[-1]
    sys.stderr.flush()
    os.dup2(fd, 1)
    try:
        print(line, file=stream, flush=True)
    finally:
        os.dup2(2, 1)


# --------------------------------------------------------------------------------------------
# errors: one sentence on stderr, and with --json one JSON object on stdout too


class Parser(argparse.ArgumentParser):
    """argparse's parser, remembering its usage error (argparse prints it and exits 2) for --json."""

    last_error: str | None = None

    def error(self, message: str):
        Parser.last_error = f"{self.prog}: error: {message}"
        super().error(message)


def fail(wants_json: bool, message: str, code: int = 2, *, line: str | None = None) -> int:
    """Report a command's failure: the sentence on stderr (`line`, else `specdistill: error: MESSAGE`), and
    with --json `{"error", "exit_code"}` on stdout: a script reading stdout always gets one object."""
    message = mask_secrets(message)
    print(printable(mask_secrets(line) if line else f"specdistill: error: {message}"), file=sys.stderr)
    if wants_json:
        print_result(json.dumps({"error": message, "exit_code": code}))
    return code


def describe_error(exc: BaseException) -> str | None:
    """The sentence for an error a user can act on (None: a bug, whose traceback is kept). A library refusal
    says it already (ValueError, RuntimeError); an OS error, a database driver's and MLflow's are put in words."""
    if isinstance(exc, (ValueError, RuntimeError, FileNotFoundError)):
        return str(exc)
    if isinstance(exc, OSError):
        return describe_os_error(exc)
    module = type(exc).__module__
    if module.startswith("sqlalchemy"):  # a database the library did not open itself (MLflow's)
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        return f"database error: {reason}" + _state_read_only(" (the state directory {})")
    if module.startswith("mlflow"):
        return "MLflow: " + (str(getattr(exc, "message", None) or exc).strip().splitlines() or ["error"])[0]
    return None


def _state_read_only(template: str) -> str:
    from specdistill import paths  # lazy: CLI start-up

    why = paths.read_only_reason(paths.home())
    return template.format(why) if why else ""


def describe_os_error(exc: OSError) -> str:
    """`PATH: what failed`, and when the path is in a read-only state directory, that it is."""
    from specdistill import paths  # lazy: CLI start-up

    where = exc.filename if exc.filename is not None else ""
    reason = paths.os_error_reason(exc)
    if where and paths.is_within(Path(str(where)).absolute(), paths.home()) and paths.read_only_reason(paths.home()):
        reason += f": the state directory {paths.home()} is read-only; give SPECDISTILL_HOME a writable directory"
    return f"{where}: {reason}" if where else reason


OUT_HELP = "a new directory (an existing one is refused unless it is this command's previous output and --force)"


def add_out(p: argparse.ArgumentParser, flag: str | None = None, help: str = OUT_HELP) -> None:
    """OUT (positional, or `flag`) and --force, which replaces only a previous output of the same command."""
    if flag:
        p.add_argument(flag, dest="out", default=None, help=help)
    else:
        p.add_argument("out", metavar="OUT", help=help)
    p.add_argument("--force", action="store_true",
                   help="replace OUT when it is a previous output of this command (never anything else)")


def add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=thread_count, default=None,
                   help=f"torch CPU threads (1 avoids stalls on a busy machine; at most {bounds.THREADS_PER_CPU} per CPU)")


def set_threads(args: argparse.Namespace) -> None:
    if args.threads:
        import torch  # lazy: CLI start-up

        torch.set_num_threads(args.threads)


def add_db(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", default=None,
                   help="log store URL (default $SPECDISTILL_LOG_DB, else sqlite under $SPECDISTILL_HOME/logs.db)")


def log_store(args: argparse.Namespace, *, create: bool = False):
    """The log store named by --db, as a context manager (`with log_store(args) as store:`). Only
    writers (`create=True`) create a missing SQLite file; a reader names it and stops."""
    from specdistill.data.logstore import LogStore  # lazy: CLI start-up

    return LogStore(args.db, create=create)
