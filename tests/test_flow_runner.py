"""Stopping a flow run by signal (flows/runner.py): within seconds, one line, no run left Running, and a
rerun resumes from the finished stages. A real flow in a subprocess on Prefect's temporary server."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SERVER_START_S = 240  # Prefect's temporary server takes a while on a busy 2-core machine
STOP_WITHIN_S = 20  # the runs are marked, the server stopped (its own grace: 5 s), the process gone

# a monitor-shaped flow: an outer flow, a nested flow, a cached first stage, then a long stage
FLOW = textwrap.dedent('''
    import sys, time
    from pathlib import Path

    import specdistill  # the offline environment, as the command line sets it
    from prefect import flow, task

    from flows.runner import FlowStopped, run_flow, stopped_message
    from tasks.common import content_key

    work = Path(sys.argv[1])

    @task(cache_key_fn=content_key, persist_result=True)
    def first_stage(n: int) -> int:
        with open(work / "first-stage-runs", "a") as f:
            f.write("x")
        return n + 1

    @task
    def long_stage(seconds: float) -> str:
        (work / "long-stage-started").write_text("yes")
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(0.05)
        return "done"

    @flow(name="inner-flow")
    def inner(seconds: float) -> str:
        first_stage(1)
        return long_stage(seconds)

    @flow(name="outer-flow")
    def outer(seconds: float) -> str:
        return inner(seconds)

    try:
        print(run_flow(outer, seconds=float(sys.argv[2])))
    except FlowStopped as stop:
        print(stopped_message(stop, "the tiny flow"), file=sys.stderr)
        sys.exit(stop.exit_code)
''')


def _start(script: Path, work: Path, seconds: float, prefect_home: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}
    env.update(PYTHONPATH=str(REPO), PREFECT_HOME=str(prefect_home), PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180")
    # its own session: the signal goes to its whole process group, as a terminal's or a service manager's does
    return subprocess.Popen([sys.executable, str(script), str(work), str(seconds)], env=env, cwd=work,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _states(db: Path, table: str) -> list[tuple[str, str]]:
    with sqlite3.connect(db) as conn:
        return conn.execute(f"SELECT name, state_type FROM {table} ORDER BY created").fetchall()


@pytest.mark.e2e
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_flow_in_seconds_marks_its_runs_and_a_rerun_resumes(tmp_path, signum):
    script = tmp_path / "tiny_flow.py"
    script.write_text(FLOW)
    prefect_home = tmp_path / "prefect"
    proc = _start(script, tmp_path, 600, prefect_home)
    try:
        deadline = time.monotonic() + SERVER_START_S
        while not (tmp_path / "long-stage-started").exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the flow never reached its long stage"
            time.sleep(0.2)
        server = _children(proc.pid)
        assert server, "Prefect's temporary server should be a child process"
        sent = time.monotonic()
        os.killpg(proc.pid, signum)  # the whole group: the temporary server must outlive it
        _, err = proc.communicate(timeout=STOP_WITHIN_S + 30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert took < STOP_WITHIN_S, f"took {took:.1f} s to stop"
    assert proc.returncode == 128 + signum
    name = signal.Signals(signum).name
    assert f"specdistill: the tiny flow stopped by {name}: its flow runs are marked Crashed" in err
    assert "ConnectError" not in err and "Traceback" not in err, err[-3000:]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in server), "the temporary server outlived the command"
    db = prefect_home / "prefect.db"
    flows = _states(db, "flow_run")
    assert sorted(state for _, state in flows) == ["CRASHED", "CRASHED"], flows
    tasks = _states(db, "task_run")
    assert "RUNNING" not in {state for _, state in tasks}, tasks
    assert [state for n, state in tasks if n.startswith("long_stage")] == ["CRASHED"], tasks
    if signum != signal.SIGTERM:
        return

    rerun = _start(script, tmp_path, 0, prefect_home)
    out, err = rerun.communicate(timeout=SERVER_START_S + 60)
    assert rerun.returncode == 0 and out.strip() == "done", err[-3000:]
    assert (tmp_path / "first-stage-runs").read_text() == "x"  # the finished stage was not run again


SECRET_FLOW = textwrap.dedent('''
    import sys

    import specdistill  # the offline environment, as the command line sets it
    from prefect import flow, task

    from flows.runner import run_flow
    from specdistill.env import stash_secrets
    from specdistill.pipeline.nightly_recipe import NightlyConfig, load_nightly_config
    from tasks.common import content_key

    @task(cache_key_fn=content_key, persist_result=True)
    def stage(config: NightlyConfig) -> str:
        print(f"stage on {config.target_name}")  # log_prints: the run's logs are stored too
        return config.target_name

    @flow(name="inner-flow", log_prints=True)
    def inner(config_path=None, overrides=None) -> str:
        return stage(load_nightly_config(config_path, overrides))

    @flow(name="outer-flow", log_prints=True)
    def outer(config_path=None, overrides=None) -> str:
        config = load_nightly_config(config_path, overrides)
        assert "hunter22" in config.log_db  # the run itself has the credential
        return inner(overrides=stash_secrets([f"log_db={config.log_db}", "target_name=nested"]))  # as the monitor does

    print(run_flow(outer, config_path=None, overrides=[sys.argv[1], "target_name=outer"]))
''')


@pytest.mark.e2e
def test_no_credential_of_an_override_is_stored_by_prefect(tmp_path):
    """A `log_db=postgresql://u:PASS@...` override was stored in clear in Prefect's flow-run parameters."""
    script = tmp_path / "secret_flow.py"
    script.write_text(SECRET_FLOW)
    prefect_home = tmp_path / "prefect"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}
    env.update(PYTHONPATH=str(REPO), PREFECT_HOME=str(prefect_home), PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180")
    done = subprocess.run([sys.executable, str(script), "log_db=postgresql+psycopg://u:hunter22@db/logs?sslpassword=hunter33"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=SERVER_START_S + 120)
    assert done.returncode == 0 and done.stdout.strip().endswith("nested"), done.stderr[-3000:]
    with sqlite3.connect(prefect_home / "prefect.db") as conn:
        parameters = [json.loads(p) for (p,) in conn.execute("SELECT parameters FROM flow_run")]
    assert len(parameters) == 2 and all("${SPECDISTILL_SECRET_" in json.dumps(p) for p in parameters), parameters
    stored = b"".join(p.read_bytes() for p in prefect_home.rglob("*") if p.is_file())
    assert b"hunter22" not in stored and b"hunter33" not in stored
