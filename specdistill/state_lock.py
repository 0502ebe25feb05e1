"""One run at a time per state directory: the nightly, the monitor, a distillation or a target update
writing into it take `state_lock`; a second process is refused and told which process holds it.

Without it two `pipeline run`s on one `SPECDISTILL_HOME` raced each other's database migrations and
stages. Reentrant within a process: the monitor runs the nightly inside itself."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from specdistill.paths import UnsafeFileError, ensure, home, is_within, open_private, read_json

STATE_LOCK = "state.lock"  # in the state directory, 0600: held (flock) by the process running on it, which it names


class StateBusyError(RuntimeError):
    """The state directory is in use by another process (the message names it)."""


_held: dict[Path, list] = {}  # state directory -> [its open lock file, depth]: this process holds it
_held_guard = threading.Lock()


def _holder(path: Path) -> str:
    try:
        info = read_json(path, "state lock", max_bytes=4096)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["since"])))
        return f"process {int(info['pid'])} on {info['host']} ({info['what']}, since {since})"
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return "another process"


@contextlib.contextmanager
def state_lock(what: str) -> Iterator[None]:
    """Hold the state directory for a run (`what`: the command, as the refusal of a second one names it).
    A second process is refused at once, told which process holds it; this process may take it again
    (the monitor runs the nightly inside itself). Released when the run ends, or by the kernel when its
    process dies, even by SIGKILL."""
    root = home()
    with _held_guard:
        entry = _held.get(root)
        if entry is None:
            path = ensure(root) / STATE_LOCK
            try:
                f = open_private(path, "a+")  # held past this block: closed on release; never through a link
            except UnsafeFileError as exc:
                raise UnsafeFileError(f"cannot take the state lock: {exc}") from None
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                raise StateBusyError(f"the state directory {root} is in use by {_holder(path)}: wait for it to finish, "
                                     "or point SPECDISTILL_HOME at another directory") from None
            f.seek(0)
            f.truncate()
            f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "what": what, "since": time.time()}))
            f.flush()
            entry = _held[root] = [f, 0]
        entry[1] += 1
    try:
        yield
    finally:
        with _held_guard:
            entry[1] -= 1
            if entry[1] == 0:
                del _held[root]
                fcntl.flock(entry[0], fcntl.LOCK_UN)
                entry[0].close()


def state_lock_for(path: str | os.PathLike, what: str) -> contextlib.AbstractContextManager:
    """`state_lock(what)` when `path` is inside the state directory, else nothing to hold."""
    inside = is_within(Path(path).absolute().resolve(), home())
    return state_lock(what) if inside else contextlib.nullcontext()
