"""How long does `monitor run` take to its decision on a copy of a state, quiet and beside busy cores?

    python benchmarks/monitor_load.py --state .specdistill [--busy 0,2] [--nice 10] [--timeout-min 30]

Each run copies the state directory afresh (the monitor writes its decision and the serving config),
starts `--busy N` pure-Python busy loops at the monitor's own niceness (a process that keeps N cores
busy, as a test suite or a serving engine would), and runs `specdistill monitor run --json retrain=false`:
the decision and the fallback, not the incremental run after them. It prints the wall minutes of the
command (Prefect's start-up included), the report's stage minutes, how the replay and the fallback bench
ended (settled at 95%, or their time ran out) and the threads they ran at.

A state whose target was updated (`specdistill demo target-update`, `specdistill target register
PATH --no-event`) falls back and so times the whole decision; an unchanged one decides keep after the
replay. Paths the state records under its own directory (targets.json) are moved to the copy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import busy_loops, copy_state


def run(state: Path, busy: int, nice: int, timeout_min: float, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="monitor-load-") as tmp:
        home = copy_state(state, Path(tmp) / "state")
        with busy_loops(busy, nice):
            start = time.perf_counter()
            out = subprocess.run(["nice", "-n", str(nice), sys.executable, "-m", "specdistill.cli", "monitor", "run", "--json",
                                  "retrain=false", *overrides], capture_output=True, text=True, timeout=timeout_min * 60,
                                 env={**os.environ, "SPECDISTILL_HOME": str(home)})
            wall = time.perf_counter() - start
        if out.returncode != 0:
            raise SystemExit(f"monitor run failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
        outcome = json.loads(out.stdout)
    fallback, sample = outcome.get("fallback") or {}, outcome.get("sample") or {}
    return {"busy": busy, "wall_minutes": round(wall / 60, 2), "decision": outcome["decision"],
            "stage_minutes": {k: round(v / 60, 2) for k, v in outcome.get("stage_seconds", {}).items()},
            "replay": sample.get("stopped"), "replay_threads": sample.get("threads"),
            "fallback": fallback.get("mode"), "fallback_bench": fallback.get("stopped"), "fallback_threads": fallback.get("threads"),
            "measured_on": outcome.get("measured_on")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--state", type=Path, required=True, help="a state directory (SPECDISTILL_HOME), copied for each run")
    ap.add_argument("--busy", default="0,2", help="busy loops beside the monitor, one run per value")
    ap.add_argument("--nice", type=int, default=10, help="the niceness of the monitor and of the busy loops alike")
    ap.add_argument("--timeout-min", type=float, default=30.0)
    ap.add_argument("overrides", nargs="*", help="monitor config key=value overrides")
    args = ap.parse_args(argv)
    for busy in (int(b) for b in args.busy.split(",")):
        print(json.dumps(run(args.state, busy, args.nice, args.timeout_min, args.overrides)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
