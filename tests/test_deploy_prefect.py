"""deploy/prefect.yaml for real: prefect server, mlflow server, a process worker runs the nightly
deployment; then `target register` emits the event and the monitor deployment's trigger runs the
monitor through the worker. One run of scripts/prefect_event_check.sh (a superset of
scripts/prefect_deploy_check.sh: the servers start once) serves both tests."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def event_check(demo_target):
    env = {**os.environ, "SPECDISTILL_MODEL_CACHE": os.environ["SPECDISTILL_MODEL_CACHE"]}
    env.pop("SPECDISTILL_HOME", None)  # the script makes its own state directory
    start = time.monotonic()
    result = subprocess.run(["scripts/prefect_event_check.sh", sys.executable], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=2400)
    print(f"prefect_event_check.sh: {time.monotonic() - start:.0f} s", file=sys.stderr)
    return result


@pytest.mark.e2e
def test_nightly_deployment_runs_through_a_process_worker(event_check):
    nightly = [line for line in event_check.stdout.splitlines() if line.startswith("deploy-check: flow run")]
    assert nightly and "ended COMPLETED" in nightly[0], event_check.stdout[-3000:] + event_check.stderr[-5000:]


@pytest.mark.e2e
def test_target_register_event_runs_the_monitor_deployment(event_check):
    assert event_check.returncode == 0, event_check.stdout[-3000:] + event_check.stderr[-5000:]
    closing = event_check.stdout.strip().splitlines()[-1]
    assert closing.startswith("event-check: monitor flow run ") and " COMPLETED, decision " in closing, closing
    assert "decision keep" in closing or "decision fallback" in closing
    assert "log store decision #" in closing and "MLflow run monitor-" in closing


def test_the_check_scripts_parse():
    for script in ("prefect_lib.sh", "prefect_deploy_check.sh", "prefect_event_check.sh"):
        subprocess.run(["bash", "-n", str(REPO / "scripts" / script)], check=True)


def test_the_monitor_configs_load():
    from specdistill.pipeline.monitor_recipe import load_monitor_config

    tiny = load_monitor_config(REPO / "deploy" / "monitor" / "tiny.yaml")
    assert tiny.nightly.sources[0].path == "humaneval" and not tiny.nightly.bench.generic_draft
    assert load_monitor_config(REPO / "deploy" / "monitor" / "monitor.yaml").red_line == tiny.red_line == 0.5
