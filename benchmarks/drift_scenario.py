"""After a target update, does `monitor run` detect it, fall back, retrain and serve again, and in how many minutes?

    python benchmarks/drift_scenario.py --state DIR [--work /tmp/drift_scenario] [--again] [--load]

The drift scenario as a user runs it: after a night with a champion, the target is updated and registered,
and `monitor run` detects it, falls back, retrains the draft against the new target and serves again.

DIR is a state directory after `make demo` (`.specdistill/`, with a `champion`); it is copied to --work and
never written. In the copy, as a user would:

    specdistill demo target-update --json        # top layers tuned on code, domain tokens added
    specdistill target register OUT --no-event --json
    specdistill monitor run --json               # detect, replay, fall back, incremental distillation
    specdistill monitor run --json               # (--again) the next check: the retrained champion on the new target

--load runs a busy process beside the monitor (two Python loops, one per core) for its whole run, as a serving
engine or a test suite beside it would. Prints the table: the champion's first-position acceptance before
(its registration) and after the update, the decision and its minutes, the fallback's speed, the retrained
draft's numbers against the new target, the gate, the promotion and what serving.json names at the end, with
each command's wall-clock minutes; writes results.json in --work.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import busy_loops, copy_state, log

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "specdistill.cli"]


def run(args: list[str], home: Path, cwd: Path) -> tuple[dict, float]:
    """One CLI command with --json in the copied state: (its JSON object, minutes)."""
    env = {**os.environ, "SPECDISTILL_HOME": str(home), "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start = time.time()
    log("$ specdistill " + " ".join(args))
    proc = subprocess.run([*CLI, *args, "--json"], cwd=cwd, env=env, capture_output=True, text=True)
    minutes = (time.time() - start) / 60
    (cwd / f"{args[0]}-{args[1] if len(args) > 1 else ''}-{int(start)}.log").write_text(proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"`specdistill {' '.join(args)}` exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout), minutes


def first_position(result: dict | None) -> float | None:
    per = (result or {}).get("per_position_acceptance") or []
    return per[0] if per else None


def summary(outcome: dict, minutes: float) -> dict:
    sample = outcome.get("sample") or {}
    fallback = outcome.get("fallback") or {}
    inc = outcome.get("incremental") or {}
    challenger = (inc.get("results") or {}).get("challenger")
    champion_tags = (outcome.get("champion") or {}).get("tags") or {}
    verdict = inc.get("verdict") or {}
    return {
        "minutes": minutes,
        "decision": outcome.get("decision"),
        "champion_version": (outcome.get("champion") or {}).get("version"),
        "champion_first_position_registered": champion_tags.get("first_position_acceptance"),
        "champion_first_position_now": sample.get("first_position_acceptance"),
        "fallback": fallback.get("mode"), "fallback_speedup": fallback.get("speedup"),
        "retrained_first_position": first_position(challenger),
        "retrained_per_position": (challenger or {}).get("per_position_acceptance"),
        "retrained_tau": (challenger or {}).get("accepted_length"),
        "retrained_speedup": (challenger or {}).get("speedup"),
        "gate": "PASS" if verdict.get("passed") else ("FAIL" if verdict else None),
        "promoted": bool(inc.get("promoted")), "served_after": (inc.get("serving") or {}).get("mode"),
        "warm_start": (inc.get("warm_start") or {}).get("version"),
        "report_tail": (outcome.get("report") or "")[-1500:],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state", type=Path, required=True, help="a demo state directory (.specdistill) with a champion")
    parser.add_argument("--work", type=Path, default=Path("/tmp/drift_scenario"))
    parser.add_argument("--again", action="store_true", help="a second monitor run after the first")
    parser.add_argument("--load", action="store_true", help="two busy loops beside each monitor run")
    parser.add_argument("--updated", action="store_true",
                        help="--state had its target updated and registered already: start at the monitor run")
    args = parser.parse_args(argv)
    home = args.work / ".specdistill"
    if home.exists():
        shutil.rmtree(home)
    args.work.mkdir(parents=True, exist_ok=True)
    copy_state(args.state, home)
    steps, update, registered = {}, {}, {}
    if not args.updated:
        update, steps["target update"] = run(["demo", "target-update"], home, args.work)
        registered, steps["target register"] = run(["target", "register", update["out"], "--no-event"], home, args.work)
    monitors = []
    for _ in range(2 if args.again else 1):
        with busy_loops(2 if args.load else 0):
            outcome, minutes = run(["monitor", "run"], home, args.work)
        monitors.append(summary(outcome, minutes))
    results = {"update": update, "registered": registered, "steps": steps, "monitor": monitors, "load": args.load}
    (args.work / "results.json").write_text(json.dumps(results, indent=2, default=str))

    from specdistill.hardware import cpu_info  # lazy: torch stays out of this process while the CLI runs beside it

    print(f"machine: {cpu_info().describe()}; busy loops beside the monitor: {'2' if args.load else 'none'}\n")
    print("| step | minutes | decision | champion first-position (registered → now) | fallback | retrained first-position "
          "| by position | τ | speedup | gate | promoted | served after |")
    print("|---|---:|---|---|---|---:|---|---:|---:|---|---|---|")
    for name, m in steps.items():
        print(f"| {name} | {m:.1f} |  |  |  |  |  |  |  |  |  |  |")
    for i, m in enumerate(monitors, 1):
        fb = f"{m['fallback']} {m['fallback_speedup']:.2f}x" if m["fallback"] else "–"
        per = " / ".join(f"{a:.2f}" for a in m["retrained_per_position"] or []) or "–"
        fp = "–" if m["retrained_first_position"] is None else f"{m['retrained_first_position']:.3f}"
        tau = "–" if m["retrained_tau"] is None else f"{m['retrained_tau']:.2f}"
        sp = "–" if m["retrained_speedup"] is None else f"{m['retrained_speedup']:.2f}x"
        print(f"| monitor run {i} | {m['minutes']:.1f} | {m['decision']} | v{m['champion_version']} "
              f"{m['champion_first_position_registered']} → {m['champion_first_position_now']} | {fb} | {fp} | {per} | {tau} "
              f"| {sp} | {m['gate'] or '–'} | {m['promoted']} | {m['served_after'] or '–'} |")
    for i, m in enumerate(monitors, 1):
        print(f"\nmonitor run {i}, the end of its report:\n\n{m['report_tail']}")


if __name__ == "__main__":
    main()
