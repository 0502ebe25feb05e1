# Shared by scripts/prefect_deploy_check.sh and scripts/prefect_event_check.sh (sourced, not run):
# a real `prefect server` and `mlflow server` on loopback, deploy/prefect.yaml deployed to a process
# work pool, and one run of the nightly deployment through a process worker with the tiny budget.
#
# The caller sets PY (the python whose bin/ holds prefect and mlflow) and TAG (the log prefix).
# Everything (Prefect home, MLflow store, specdistill state) lives in $WORK, removed at exit.

BIN="$(dirname "$PY")"
REPO="$(pwd)"
WORK="$(mktemp -d "/tmp/specdistill-$TAG.XXXXXX")"
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

say() { echo "$TAG: $*" >&2; }
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_http() {  # URL, what, log
    for _ in $(seq 1 180); do
        if "$PY" -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1], timeout=2)" "$1" 2>/dev/null; then return 0; fi
        sleep 1
    done
    say "$2 did not come up; its log:"; tail -50 "$3" >&2; exit 1
}

export PREFECT_HOME="$WORK/prefect" PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
export MLFLOW_DISABLE_TELEMETRY=true HF_HUB_OFFLINE=1
export SPECDISTILL_HOME="$WORK/state" SPECDISTILL_REPO="$REPO"
# the demo target's dequantized cache is shared with the test suite (it takes a minute to build)
export SPECDISTILL_MODEL_CACHE="${SPECDISTILL_MODEL_CACHE:-$REPO/.specdistill/models}"
# One compute thread per flow process unless told otherwise: the runs here are small decode loops,
# and on a shared CPU two spinning OpenMP threads per one-token step stall far more than they gain
# (measured: a 4-prompt monitor replay 3.5 min with 2 threads under load).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

start_servers() {
    PREFECT_PORT="$(free_port)"
    "$BIN/prefect" server start --host 127.0.0.1 --port "$PREFECT_PORT" >"$WORK/prefect-server.log" 2>&1 &
    PIDS+=($!)
    MLFLOW_PORT="$(free_port)"
    "$BIN/mlflow" server --host 127.0.0.1 --port "$MLFLOW_PORT" --workers 1 \
        --backend-store-uri "sqlite:///$WORK/mlflow.db" --default-artifact-root "$WORK/mlartifacts" \
        >"$WORK/mlflow-server.log" 2>&1 &
    PIDS+=($!)
    export PREFECT_API_URL="http://127.0.0.1:$PREFECT_PORT/api" MLFLOW_TRACKING_URI="http://127.0.0.1:$MLFLOW_PORT"
    wait_http "$PREFECT_API_URL/health" "prefect server" "$WORK/prefect-server.log"
    wait_http "$MLFLOW_TRACKING_URI/health" "mlflow server" "$WORK/mlflow-server.log"
    say "prefect server on :$PREFECT_PORT, mlflow server on :$MLFLOW_PORT"
}

deploy_all() {
    "$BIN/prefect" work-pool create specdistill-process --type process >/dev/null
    "$BIN/prefect" --no-prompt deploy --all --prefect-file deploy/prefect.yaml >"$WORK/deploy.log" 2>&1 \
        || { cat "$WORK/deploy.log" >&2; exit 1; }
}

# One run of the nightly deployment with the tiny budget, on a small slice of real traffic (HumanEval
# only: seconds to ingest; it has no human-written answers, so no generic baseline); then check the
# flow run ended Completed and a model version exists in the registry. Prints
# "deploy-check: flow run ID ended COMPLETED; model versions: [...]" on stdout.
run_nightly_once() {
    local run_id
    run_id="$("$PY" - <<'EOF'
from prefect.deployments import run_deployment
run = run_deployment(
    "nightly-distill/nightly", timeout=0,
    parameters={"config_path": "deploy/nightly/tiny.yaml", "window_days": None,
                "overrides": ["sources=[{path: humaneval, format: humaneval, slice: code}]",
                              "window.train_prompts=6", "window.eval_prompts=2",
                              "gate.overrides.min_prompts=2",  # its two prompts may decide: a champion for the monitor
                              "bench.generic_draft=false",
                              "serving.choose_gamma=false"]},  # no γ search: this checks the deployment, not the bench
)
print(run.id)
EOF
)"
    say "flow run $run_id scheduled; starting a process worker"
    timeout 1200 "$BIN/prefect" worker start --pool specdistill-process --run-once >"$WORK/worker-nightly.log" 2>&1 \
        || { tail -80 "$WORK/worker-nightly.log" >&2; exit 1; }

    "$PY" - "$run_id" <<'EOF'
import asyncio, sys
from prefect.client.orchestration import get_client
from mlflow import MlflowClient

async def state(run_id):
    async with get_client() as client:
        run = await client.read_flow_run(run_id)
        return run.state.type.value, run.state.message

kind, message = asyncio.run(state(sys.argv[1]))
versions = MlflowClient().search_model_versions("name='draft-SmolLM2-135M-Instruct'")
print(f"deploy-check: flow run {sys.argv[1]} ended {kind}; model versions: {[v.version for v in versions]}", flush=True)
if kind != "COMPLETED":
    sys.exit(f"deploy-check: the nightly deployment run ended {kind}: {message}")
if not versions:
    sys.exit("deploy-check: no model version was registered")
EOF
}
