#!/usr/bin/env bash
# The nightly deployment as operators run it, on this machine: a real `prefect server`, a real
# `mlflow server`, deploy/prefect.yaml deployed to a process work pool, one run of the nightly
# deployment through a process worker with the tiny budget; then check that the flow run ended
# Completed and that a model version exists in the registry.
#
#   scripts/prefect_deploy_check.sh [PYTHON]       (run from the repository root)
#
# Everything (Prefect home, MLflow store, specdistill state) lives in a temporary directory that is
# removed at the end; servers listen on 127.0.0.1 only. scripts/prefect_event_check.sh does all of
# this and then the event-triggered monitor run (the test suite runs that one).
set -euo pipefail

PY="${1:-.venv/bin/python}"
TAG=deploy-check
source "$(dirname "$0")/prefect_lib.sh"
start_servers
deploy_all
run_nightly_once
