"""What do nights add to each other through the real nightly flow: the pool, the warm start, depth, the gate?

    python benchmarks/demo_nights.py [--nights 4] [--home DIR] [key=value ...]

Each night is a whole `specdistill demo` in the same state directory (SPECDISTILL_HOME, default this
checkout's `.specdistill`): its own window of the shipped traffic (`window.seed`), the answer pool of every
night so far, and a warm start from the champion or, with none, from the newest head registered for this
target version. A night that finished is not run again (its result is kept in HOME/demo_nights/), so a
killed run resumes at the night it stopped in. Extra key=value overrides go to every night.

Prints per night: the answers trained on (from how many nights), where training started, the head's
first-position acceptance, τ and speedup on that night's own held-out prompts (each night's differ, so
compare with care), the gate, and what was served; then the head by draft position: the depth it was trained
to (a night after the first trains one unroll step more, `train.incremental_steps`), its acceptance at each
position as benched, and its own held-out curve.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from specdistill.modeling.eagle3_files import META_FILE

REPO = Path(__file__).resolve().parents[1]


def run_night(night: int, home: Path, overrides: list[str]) -> dict:
    """One `specdistill demo window.seed=night`, its result as `--json` prints it (cached in HOME)."""
    done = home / "demo_nights" / f"night-{night}.json"
    if done.is_file():
        return json.loads(done.read_text())
    cli = Path(sys.executable).with_name("specdistill")
    cmd = [str(cli), "demo", "--json", f"window.seed={night}", *overrides]
    print(f"night {night + 1}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    start = time.time()
    out = subprocess.run(cmd, cwd=REPO, env={**os.environ, "SPECDISTILL_HOME": str(home)}, stdout=subprocess.PIPE,
                         text=True, check=True).stdout
    result = json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("{")))
    result["wall_minutes"] = (time.time() - start) / 60
    done.parent.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps(result))
    return result


def row(night: int, r: dict) -> dict:
    head = r["results"]["challenger"]
    nights = (r.get("pool") or {}).get("nights") or {}
    warm = r.get("warm_start")
    per = head["per_position_acceptance"] or []
    directory = head.get("spec", "").partition(":")[2]  # KIND:DIR, whichever kind names the head
    head_dir = Path(directory) if directory else None
    found = head_dir is not None and head_dir.is_dir()
    meta = json.loads((head_dir / META_FILE).read_text()) if found else {}
    curve = json.loads((head_dir.parent / "result.json").read_text())["curve"] if found else []
    return {"night": night + 1, "window": r["window"],
            "answers": sum(n["answers"] for n in nights.values()), "tokens": sum(n["tokens"] for n in nights.values()),
            "pool_nights": len(nights), "started_from": f"v{warm['version']}" if warm else "target",
            "first_position": (head["per_position_acceptance"] or [None])[0], "tau": head["accepted_length"],
            "speedup": head["speedup"], "gate": "PASS" if r["verdict"]["passed"] else "FAIL",
            "version": r["registered"]["version"], "served": r["serving"].get("name") or "off",
            "served_speedup": r["serving"].get("speedup"), "minutes": r.get("wall_minutes"),
            "depth": meta.get("unroll_steps"), "gamma": head["gamma"], "tree_width": head.get("tree_width", 1),
            "per_position": per, "given_before": given_before(per),
            "heldout_per_position": (curve[-1].get("acceptance_per_position") or []) if curve else []}


def given_before(per_position: list[float]) -> list[float | None]:
    """Position k's share of rounds over position k-1's: acceptance at k given 1..k-1 accepted."""
    return [None if not i else (a / per_position[i - 1] if per_position[i - 1] else None)
            for i, a in enumerate(per_position)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nights", type=int, default=4)
    p.add_argument("--home", default=os.environ.get("SPECDISTILL_HOME", str(REPO / ".specdistill")))
    p.add_argument("overrides", nargs="*", help="key=value for every night")
    args = p.parse_args(argv)
    home = Path(args.home).resolve()
    rows = [row(k, run_night(k, home, args.overrides)) for k in range(args.nights)]
    (home / "demo_nights" / "table.json").write_text(json.dumps(rows, indent=1))
    print("| night | trained on (answers, tokens, nights) | started from | head first-position | τ | speedup | gate "
          "| version | served | minutes |")
    print("|---:|---|---|---:|---:|---:|---|---:|---|---:|")
    for x in rows:
        first = "–" if x["first_position"] is None else f"{x['first_position']:.3f}"
        served = x["served"] + (f" {x['served_speedup']:.2f}x" if x["served"] != "off" and x["served_speedup"] else "")
        print(f"| {x['night']} | {x['answers']:,}, {x['tokens']:,}, {x['pool_nights']} | {x['started_from']} | {first} "
              f"| {x['tau']:.2f} | {x['speedup']:.2f}x | {x['gate']} | {x['version']} | {served} | {x['minutes'] or 0:.1f} |")
    print("\nthe head by draft position: benched at its γ (share of rounds; in brackets, given the positions before it "
          "accepted), and its own held-out curve (teacher-forced: each position given a correct prefix)\n")
    print("| night | depth trained | benched at | pos 1 | pos 2 | pos 3 | held-out curve |")
    print("|---:|---:|---|---:|---:|---:|---|")
    for x in rows:
        cells = [f"{a:.3f}" + (f" ({g:.2f})" if g is not None else "")
                 for a, g in zip(x["per_position"], x["given_before"])][:3]
        cells += ["–"] * (3 - len(cells))
        shape = f"γ={x['gamma']}" + (f" (tree {x['tree_width']})" if x["tree_width"] > 1 else "")
        held = ", ".join(f"{a:.2f}" for a in x["heldout_per_position"])
        print(f"| {x['night']} | {x['depth'] or '–'} | {shape} | {' | '.join(cells)} | {held} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
