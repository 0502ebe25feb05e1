"""deploy/prefect.yaml for real: prefect server, mlflow server, a process worker runs the nightly deployment."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]


def test_nightly_deployment_runs_through_a_process_worker(demo_target):
    env = {**os.environ, "SPECDISTILL_MODEL_CACHE": os.environ["SPECDISTILL_MODEL_CACHE"]}
    env.pop("SPECDISTILL_HOME", None)  # the script makes its own state directory
    result = subprocess.run(["scripts/prefect_deploy_check.sh", sys.executable], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "ended COMPLETED" in result.stdout
