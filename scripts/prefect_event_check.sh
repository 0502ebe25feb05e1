#!/usr/bin/env bash
# The unattended loop on this machine: a real `prefect server` and `mlflow server`, deploy/prefect.yaml
# deployed to a process work pool, the nightly deployment run once (the deploy check: it registers
# the champion the monitor decides on); then a new target version is made (`demo target-update`,
# one step: new domain tokens, so a new fingerprint) and registered with `specdistill target register`,
# which emits `specdistill.target.updated`; the monitor deployment's event trigger must create a flow
# run, a process worker runs it, and it must complete and record its decision (keep or fallback,
# with the numbers) in the log store and in MLflow (a `monitor-*` run).
#
#   scripts/prefect_event_check.sh [PYTHON]       (run from the repository root)
#
# The monitor deployment keeps its trigger and schedule from deploy/prefect.yaml; only its default
# parameters are set to the tiny budget (deploy/monitor/tiny.yaml), as the deploy check passes
# deploy/nightly/tiny.yaml to the nightly run. Bounded: each wait has a timeout. The last line on
# stdout is "event-check: monitor flow run ID STATE, decision KIND (...)".
set -euo pipefail

PY="${1:-.venv/bin/python}"
TAG=event-check
START=$SECONDS
source "$(dirname "$0")/prefect_lib.sh"
start_servers
deploy_all
run_nightly_once

# The monitor deployment on the tiny budget; its automation (the event trigger) must exist.
"$PY" - <<'EOF'
import asyncio
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import DeploymentUpdate

async def main():
    async with get_client() as client:
        deployment = await client.read_deployment_by_name("monitor/monitor")
        await client.update_deployment(deployment.id, DeploymentUpdate(
            parameters={**deployment.parameters, "config_path": "deploy/monitor/tiny.yaml"}))
        automations = [a for a in await client.read_automations()
                       if any(str(getattr(action, "deployment_id", "")) == str(deployment.id) for action in a.actions)]
        if not automations:
            raise SystemExit("event-check: deploying created no automation that runs the monitor deployment")
        print(f"event-check: automation {automations[0].name!r} runs monitor/monitor on "
              f"{automations[0].trigger.expect}", flush=True)

asyncio.run(main())
EOF

# A new target version, registered: `target register` emits specdistill.target.updated.
"$PY" -m specdistill.cli demo target-update --steps 1 --out "$WORK/target-v2" --threads 1 >"$WORK/target-update.log" 2>&1 \
    || { tail -30 "$WORK/target-update.log" >&2; exit 1; }
"$PY" -m specdistill.cli target register "$WORK/target-v2" --json >"$WORK/register.json" 2>"$WORK/register.log" \
    || { cat "$WORK/register.log" >&2; exit 1; }
FINGERPRINT="$("$PY" -c 'import json,sys; r = json.load(open(sys.argv[1])); print(r["fingerprint"]); sys.exit(0 if r["event_emitted"] else 1)' \
    "$WORK/register.json")" || { say "target register did not emit the event"; cat "$WORK/register.json" >&2; exit 1; }
say "registered target $FINGERPRINT; waiting for the automation's monitor flow run"

# The automation creates the flow run (a few seconds after the event); then a worker runs it.
RUN_ID="$("$PY" - "$FINGERPRINT" <<'EOF'
import asyncio, sys, time
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

async def main(fingerprint):
    async with get_client() as client:
        deployment = await client.read_deployment_by_name("monitor/monitor")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            runs = await client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])))
            mine = [r for r in runs if r.parameters.get("fingerprint") == fingerprint]
            if mine:
                run = mine[0]
                by = run.created_by.type if run.created_by else None
                if by != "AUTOMATION":
                    raise SystemExit(f"event-check: flow run {run.id} was created by {by}, not the automation")
                print(f"event-check: automation created monitor flow run {run.id} ({run.name}) "
                      f"with parameters {run.parameters}", file=sys.stderr)
                return run.id
            await asyncio.sleep(2)
        raise SystemExit("event-check: no monitor flow run for the new target within 120 s of the event")

print(asyncio.run(main(sys.argv[1])))
EOF
)"
timeout 900 "$BIN/prefect" worker start --pool specdistill-process --run-once >"$WORK/worker-monitor.log" 2>&1 \
    || { tail -80 "$WORK/worker-monitor.log" >&2; exit 1; }

# The run's state, the decision in the log store and the monitor run in MLflow, all for this target.
"$PY" - "$RUN_ID" "$FINGERPRINT" "$((SECONDS - START))" <<'EOF'
import asyncio, sys
from prefect.client.orchestration import get_client
from mlflow import MlflowClient
from specdistill.data.logstore import LogStore
from specdistill.pipeline.monitor_recipe import load_monitor_config

run_id, fingerprint, seconds = sys.argv[1:]

async def state():
    async with get_client() as client:
        run = await client.read_flow_run(run_id)
        return run.state.type.value, run.state.message

kind, message = asyncio.run(state())
if kind != "COMPLETED":
    sys.exit(f"event-check: monitor flow run {run_id} ended {kind}: {message}")
with LogStore() as store:
    # the monitor's own decision (a flow that ran to its end also records a pipeline_success row)
    decisions = [d for d in store.decisions(target_fingerprint=fingerprint) if d["kind"] != "pipeline_success"]
if not decisions:
    sys.exit(f"event-check: no decision for target {fingerprint} in the log store")
decision = decisions[0]
payload = decision["payload"]
sample = payload.get("sample") or {}
if decision["kind"] not in ("keep", "fallback", "retrain") or sample.get("acceptance_rate") is None:
    sys.exit(f"event-check: decision {decision['kind']!r} without an acceptance sample: {sample.get('reason')}")
client = MlflowClient()
experiment = client.get_experiment_by_name("specdistill/SmolLM2-135M-Instruct")
runs = client.search_runs([experiment.experiment_id],
                          f"tags.kind = 'monitor' and tags.target_fingerprint = '{fingerprint}'")
if not runs or runs[0].info.run_name != f"monitor-{decision['kind']}":
    sys.exit(f"event-check: no MLflow run monitor-{decision['kind']} for target {fingerprint}: {[r.info.run_name for r in runs]}")
threshold = load_monitor_config("deploy/monitor/tiny.yaml").red_line
numbers = (f"α {sample['acceptance_rate']:.3f} vs red line {threshold:g}, "
           f"τ {sample['mean_accepted_length']:.2f} on {sample['proposed']} draft tokens")
extra = ""
if decision["kind"] == "fallback":
    fallback = payload.get("fallback") or {}
    inc = payload.get("incremental") or {}
    extra = (f"; serving {fallback.get('mode')}; retrained version {(inc.get('registered') or {}).get('version')}, "
             f"promoted {bool(inc.get('promoted'))}")
print(f"event-check: monitor flow run {run_id} {kind}, decision {decision['kind']} ({numbers}{extra}) "
      f"for target {fingerprint[:12]}; log store decision #{decision['id']}, MLflow run {runs[0].info.run_name} "
      f"{runs[0].info.run_id}; {seconds} s", flush=True)
EOF
