"""How the command line runs a flow in its own process, and how SIGTERM or SIGINT stops it.

Without a Prefect server (`PREFECT_API_URL` unset) Prefect starts a temporary one as a child
process. A signal sent to the whole process group (a terminal's Ctrl-C, `kill -TERM -PGID`, a
service manager stopping the unit) used to kill that server with the command: the flow runs could
not be marked, stayed "Running", and the command spent minutes retrying the dead server. Here:

- the temporary server runs in a process group of its own, so it outlives the signal long enough
  for the runs to be marked Crashed; it is stopped when the command exits, and the kernel stops it
  if the command is killed outright (parent-death signal, Linux);
- the first SIGTERM or SIGINT stops the flow where it is (Prefect marks every run in flight
  Crashed: nested flows and the running task), then the command prints one line and exits 143 or
  130; a second signal kills it at once.

Nothing is half-written by a stop: every stage writes atomically, and a rerun resumes from the
stages whose results are cached (`tasks.common`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from specdistill.pipeline.nightly_recipe import flow_overrides, masked_flow_logs
from specdistill.state_lock import state_lock

T = TypeVar("T")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
PR_SET_PDEATHSIG = 1  # prctl(2)


class FlowStopped(BaseException):
    """A flow run stopped by a signal. A BaseException, so that no `except Exception` in a stage
    swallows it: Prefect marks the runs Crashed and the command exits."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _die_with_parent() -> None:
    """In the server's child process: stop when the command dies, even by SIGKILL (Linux only). The engines'
    servers have their own (specdistill.engines.llamacpp.server.die_with_parent): flows/ reach the library
    only through specdistill.pipeline."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _temporary_server_in_own_group() -> None:
    """Start Prefect's temporary server now, from the main thread (the parent-death signal follows
    the thread that started it), as a process group of its own; Prefect then uses this one."""
    if os.environ.get("PREFECT_API_URL"):
        return
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():  # a real server (a profile)
        return
    server = SubprocessASGIServer()  # the one instance Prefect itself uses for the temporary server
    if server.running:
        return
    start_uvicorn = server._run_uvicorn_command
    popen = subprocess.Popen

    def in_own_group() -> subprocess.Popen:
        own = functools.partial(popen, start_new_session=True, preexec_fn=_die_with_parent)
        with _patched(subprocess, "Popen", own):
            return start_uvicorn()

    server._run_uvicorn_command = in_own_group
    try:
        server.start()
    finally:
        del server._run_uvicorn_command  # the class's own again


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGINT raise `FlowStopped` in the main thread (once; a second signal kills)."""
    saved = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    stopping: list[int] = []

    def stop(signum: int, _frame) -> None:
        if stopping:  # the second signal: no more waiting for the runs to be marked
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        stopping.append(signum)
        raise FlowStopped(signum)

    for s in STOP_SIGNALS:
        signal.signal(s, stop)
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def run_flow(flow: Callable[..., T], **parameters: Any) -> T:
    """Run `flow(**parameters)` in this process, stoppable by SIGTERM/SIGINT (see the module docstring),
    holding the state directory (`state_lock`: a second run is refused before Prefect's server starts).
    Raises `FlowStopped` after the runs in flight are marked, `FlowFailed` for a flow that failed with a sentence.
    A credential in the `overrides` reaches the flow as `${SPECDISTILL_SECRET_n}` (Prefect stores a run's
    parameters), its value in the environment."""
    from prefect.exceptions import FailedRun  # Prefect only once a flow runs

    if parameters.get("overrides"):
        parameters["overrides"] = flow_overrides(parameters["overrides"])
    what = getattr(flow, "name", None) or flow.__name__
    with state_lock(what), stop_on_signals(), masked_flow_logs():  # a signal while the server starts stops it too
        if type(flow).__module__.startswith("prefect"):
            _temporary_server_in_own_group()
        try:
            return flow(**parameters)
        except FailedRun as failed:  # a flow that returned its Failed state: its message is the one sentence
            raise FlowFailed(str(failed)) from None


class FlowFailed(RuntimeError):
    """A flow that ended Failed on purpose with one sentence (the nightly that had no time to train): the command
    prints it and exits 2, as for any refusal (`cli.common.describe_error`), with no traceback."""


def stopped_message(stop: FlowStopped, what: str) -> str:
    return (f"specdistill: {what} stopped by {stop}: its flow runs are marked Crashed and nothing is half-written; "
            "run the same command again to resume from the finished stages")
