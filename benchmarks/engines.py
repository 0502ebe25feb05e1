"""The demo target in three engines, side by side in one run: this PyTorch harness in fp32 and in
bf16, and llama.cpp (`llama-server`, the target's own Q4_1 GGUF). For each engine: target-only
tokens/s, and for a trained draft and for n-gram lookup their speedup and acceptance α.

    python benchmarks/engines.py --draft DIR --prompts eval_generated.jsonl [--limit 20]
        [--max-new-tokens 48] [--gamma 4] [--threads 2]

Every (engine, mode) pair runs each prompt once, in an order that rotates from prompt to prompt, so
no engine or mode always runs first and all see the same machine state; tokens/s is summed tokens
over summed wall-clock seconds (prompt processing included), speedup is a mode's tokens/s over its
own engine's target-only tokens/s, and the per-prompt median of that ratio is shown beside it.
α: the harness's own counts; llama.cpp's Δaccepted / Δdraft tokens of its /metrics counters.
In llama.cpp the draft runs as a GGUF f16 with the full vocabulary head (llama.cpp refuses a reduced one).

--prompts: the nightly's `eval_generated.jsonl` ({"prompt": [messages]}) or any prompt file
`specdistill bench` reads; the first user turn of each is asked.

Measured 2026-11-30 08:38-09:20 UTC on the 2-core CPU while four other CPU-bound jobs ran (load
average 7-8 throughout), the demo nightly's trained layer draft (layers 0,1,2,29; 8k draft vocabulary
in the harness, full head in llama.cpp), 10 held-out prompts of that nightly, 32 new tokens, K=4:

    engine             target-only tok/s draft speedup (per-prompt median)  draft α ngram speedup (per-prompt median)  ngram α
    harness fp32                     2.0         0.33x               0.62x    0.139         0.66x               0.92x    0.302
    harness bf16                     0.9         0.94x               0.89x    0.161         1.61x               1.09x    0.194
    llama.cpp Q4_1                   2.9         0.50x               0.49x    0.122         0.61x               1.07x    0.000

Under that load every absolute tokens/s is 10-60x below the same engines on an idle machine (21 tok/s
fp32, ~180 tok/s llama.cpp), so only ratios within one engine mean anything, and with 10 prompts they
are noisy (the fp32 draft's 0.33x vs its 0.62x per-prompt median). llama.cpp's n-gram (3-gram lookup,
32 tokens) accepted nothing here.

llama.cpp alone, `specdistill bench --engine llamacpp --prompts` (the same 10 prompts' first turns,
48 new tokens, --repeats 3), 09:36-09:39 UTC when the load had dropped (load average 0.8 -> 2.4):
draft-simple α 0.138, τ 1.54, 0.31x, 10/10 outputs identical to target-only; ngram-simple (3-gram
lookup, K=4) α 0.603, τ 3.30, 1.69x, 10/10 identical.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import torch

from specdistill.data.prompt_files import read_prompt_file
from specdistill.data.prompts import encode_chat
from specdistill.engines.build import build_llama_server
from specdistill.engines.client import chat, metrics_url
from specdistill.engines.llamacpp import draft_gguf, gguf_dtype, target_gguf
from specdistill.engines.prom import scrape
from specdistill.engines.server import LlamaServer, ServerConfig, ServerMode
from specdistill.modeling.models import load_model
from specdistill.speculative import drafter_from_spec
from specdistill.speculative.engine import SpecStats, generate


def read_prompts(path: Path, limit: int) -> list[str]:
    """First user turns, from the nightly's generated JSONL or from any prompt file."""
    first = path.open().readline()
    if first.strip().startswith("{") and '"prompt": [' in first:
        texts = []
        for line in path.open():
            messages = json.loads(line)["prompt"]
            texts.append(next(m["content"] for m in messages if m["role"] == "user"))
    else:
        texts = [r.turns[0] for r in read_prompt_file(path, "first")]
    return texts[:limit]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="demo")
    ap.add_argument("--draft", required=True, help="a layer-extracted draft directory (HF checkpoint)")
    ap.add_argument("--prompts", required=True, type=Path)
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write the raw numbers here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    texts = read_prompts(args.prompts, args.limit)
    engine = build_llama_server()
    gguf = target_gguf(args.target)
    draft_file = draft_gguf(args.draft, gguf)

    harness = {}
    for dtype in ("float32", "bfloat16"):
        loaded = load_model(args.target, dtype=dtype)
        harness[dtype] = (loaded.model, {"target-only": None, "draft": drafter_from_spec(loaded.model, f"draft:{args.draft}"),
                                         "ngram": drafter_from_spec(loaded.model, "ngram")})
        tokenizer = loaded.tokenizer
    ids = [encode_chat(tokenizer, [{"role": "user", "content": t}]) for t in texts]

    llama_modes = {"target-only": ServerMode(), "draft": ServerMode("draft-simple", draft_file, args.gamma),
                   "ngram": ServerMode("ngram-simple", None, args.gamma)}
    engines = {"harness fp32": "float32", "harness bf16": "bfloat16", f"llama.cpp {gguf_dtype(gguf)}": "llamacpp"}
    runs = [(e, m) for e in engines for m in ("target-only", "draft", "ngram")]
    times = {run: [] for run in runs}  # (tokens, seconds) per prompt
    stats = {run: SpecStats() for run in runs if run[1] != "target-only" and engines[run[0]] != "llamacpp"}
    with ExitStack() as stack:
        urls = {m: stack.enter_context(LlamaServer(engine.server, ServerConfig(model=gguf, mode=mode, threads=args.threads))).url
                for m, mode in llama_modes.items()}

        def one(run, i: int, max_new_tokens: int = args.max_new_tokens):
            name, mode = run
            if engines[name] == "llamacpp":
                done = chat(urls[mode], [{"role": "user", "content": texts[i]}], max_tokens=max_new_tokens)
                return done.generated_tokens, done.seconds, None
            model, drafters = harness[engines[name]]
            result = generate(model, ids[i], max_new_tokens=max_new_tokens, drafter=drafters[mode], gamma=args.gamma)
            return result.stats.generated_tokens, result.stats.seconds, result.stats

        for run in runs:  # warm-up: first-call allocations
            one(run, 0, 8)
        start = time.monotonic()
        before = {m: scrape(metrics_url(urls[m])) for m in ("draft", "ngram")}
        for i in range(len(texts)):
            shift = i % len(runs)
            for run in runs[shift:] + runs[:shift]:
                n, s, st = one(run, i)
                times[run].append((n, s))
                if st is not None and run in stats:
                    stats[run] = stats[run].merge(st)
            print(f"prompt {i + 1}/{len(texts)} ({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)
        after = {m: scrape(metrics_url(urls[m])) for m in ("draft", "ngram")}

    def tps(run) -> float:
        return sum(n for n, _ in times[run]) / sum(s for _, s in times[run])

    def alpha(run) -> float:
        if engines[run[0]] == "llamacpp":
            d_tok = after[run[1]].draft_tokens - before[run[1]].draft_tokens
            return (after[run[1]].accepted - before[run[1]].accepted) / d_tok if d_tok else 0.0
        return stats[run].acceptance_rate

    rows = []
    print(f"\n{len(texts)} prompts, greedy, {args.max_new_tokens} new tokens, γ/K={args.gamma}, {args.threads} threads, "
          f"load average {os.getloadavg()[0]:.2f} at the end")
    print(f"{'engine':<18} {'target-only tok/s':>17} {'draft speedup':>13} {'(per-prompt median)':>19} {'draft α':>8} "
          f"{'ngram speedup':>13} {'(per-prompt median)':>19} {'ngram α':>8}")
    for name in engines:
        base = tps((name, "target-only"))
        row = {"engine": name, "target_only_tokens_per_s": base}
        cells = []
        for mode in ("draft", "ngram"):
            run = (name, mode)
            ratios = [(n / s) / (bn / bs) for (n, s), (bn, bs) in zip(times[run], times[(name, "target-only")])]
            row.update({f"{mode}_speedup": tps(run) / base, f"{mode}_speedup_median": statistics.median(ratios),
                        f"{mode}_alpha": alpha(run)})
            cells.append(f"{tps(run) / base:>12.2f}x {statistics.median(ratios):>18.2f}x {alpha(run):>8.3f}")
        rows.append(row)
        print(f"{name:<18} {base:>17.1f} " + " ".join(cells))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
