"""How many torch threads should the demo target decode with, on a quiet machine and beside busy cores?

    python benchmarks/threads.py [--tokens 32] [--rounds 3] [--busy 0,1,2] [--dtype auto]

Each variant runs in a fresh process (OpenMP reads its wait policy once, at load), in rounds whose
order rotates; `--busy N` starts N pure-Python busy loops for the whole run, standing in for the
other jobs of a shared machine. Greedy, target-only, the harness, tokens/s over the timed
generation (a warm-up generation first).

Measured 2026-12-01 on the 2-core AMD EPYC with AVX-512 BF16 (bf16, the demo target, 32 tokens), by
the same steps run by hand (3 rounds each): quiet, 2 threads 22.5-30.1 tokens/s, 1 thread 21.2-24.4;
with one core busy, 2 threads 5.8-6.3, 1 thread 19.3-22.5; with both busy, 2 threads 3.7-4.8, 1 thread
13.1-14.8. Quiet, OMP_WAIT_POLICY=PASSIVE at 2 threads: 12.0-16.2 against 24.4-27.1 by default. Two
OpenMP threads on a machine with a core taken wait at every barrier for the thread that has no core;
the passive policy avoids that and costs the quiet machine 45%. That is why the nightly benchmark
probes the thread count (`bench.threads: auto`, `speculative.threads`) instead of fixing it.

The script itself, 2026-12-01 23:24 UTC, same machine (`--tokens 32 --rounds 2 --busy 0,1`), tokens/s,
median (range):

    | busy cores | 2 threads | 1 thread | 2 threads, OMP passive |
    |---:|---:|---:|---:|
    | 0 | 35.3 (34.6-35.9) | 28.9 (28.4-29.5) | 20.9 (20.8-20.9) |
    | 1 | 9.5 (7.4-11.7) | 25.6 (25.5-25.8) | 21.9 (21.2-22.5) |
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from common import busy_loops

STEP = r"""
import sys, time, torch
import specdistill  # offline environment
from specdistill.modeling.models import load_model
from specdistill.speculative.decode import generate
torch.set_num_threads(int(sys.argv[1]))
t = load_model("demo", dtype=sys.argv[3])
ids = t.tokenizer("Explain how a hash map works in simple terms.")["input_ids"]
generate(t.model, ids, max_new_tokens=4, stop_token_ids=())
start = time.perf_counter()
generate(t.model, ids, max_new_tokens=int(sys.argv[2]), stop_token_ids=())
print(int(sys.argv[2]) / (time.perf_counter() - start))
"""

VARIANTS = {"2 threads": (2, {}), "1 thread": (1, {}), "2 threads, OMP passive": (2, {"OMP_WAIT_POLICY": "PASSIVE"})}


def run(threads: int, env: dict, tokens: int, dtype: str) -> float:
    out = subprocess.run([sys.executable, "-c", STEP, str(threads), str(tokens), dtype], capture_output=True, text=True,
                         env={**os.environ, **env}, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy", default="0,1", help="busy cores to run beside (comma-separated counts)")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)
    print(f"| busy cores | {' | '.join(VARIANTS)} |\n|---:|" + "---:|" * len(VARIANTS))
    for busy in [int(b) for b in args.busy.split(",") if b]:
        rates = {name: [] for name in VARIANTS}
        names = list(VARIANTS)
        with busy_loops(busy):
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    threads, env = VARIANTS[name]
                    rates[name].append(run(threads, env, args.tokens, args.dtype))
        cells = [f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for v in rates.values()]
        print(f"| {busy} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
