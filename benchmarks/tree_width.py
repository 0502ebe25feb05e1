"""Should an EAGLE-3 head draft a chain or a tree of first-position candidates? Beside n-gram.

    python benchmarks/tree_width.py --head RUN/distill/KEY/draft --prompts RUN/data/KEY/eval_generated.jsonl \\
        --widths 1,4,8 --gammas 1,2 --threads 2

The head's top-1 draft for the first position is where most rounds end, and in bf16 on a CPU a
target forward over a few more tokens costs about one decode step, so verifying the head's
runner-ups for that position in the same forward (`tree_width` W: the chain after the top candidate
plus W-1 siblings, each attending to its own branch) buys acceptance for almost nothing. This runs
the head at every (W, γ) asked for and n-gram lookup at its γ through `speculative.harness_bench.run_bench_many`
(one shared target-only run per prompt, rotating order, lossless check), greedy, on held-out prompts:
a nightly run's `eval_generated.jsonl` (its `prompt_ids`) or any `bench --prompts` file.

The head of a fresh `make demo` at c1578e1 (trained 3 minutes under bf16 autocast), its 10 held-out
prompts, 40 new tokens, bf16, 2 threads, 1 repeat, quiet machine (load 1.9), target-only 29.8 tokens/s:

| drafter | speedup | α (chain) | τ |
|---|---:|---:|---:|
| chain, γ=1 | 1.17x | 0.404 | 1.40 |
| chain, γ=2 | 1.30x | 0.300 | 1.59 |
| W=4, γ=1 | 1.41x | 0.432 | 1.68 |
| W=4, γ=2 | 1.42x | 0.298 | 1.83 |
| W=8, γ=1 | 1.31x | 0.432 | 1.75 |
| W=8, γ=2 | 1.31x | 0.316 | 1.92 |
| n-gram, γ=6 | 1.41x | 0.180 | 2.00 |

Every row lossless (0 real mismatches; the rest exact or near-ties ≤ 0.163). W=8 verifies 9-10
tokens per forward, past where a bf16 verification stops costing about one step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import specdistill  # noqa: F401  (offline environment)
from specdistill.modeling.eagle3_io import load_eagle3
from specdistill.modeling.models import load_model
from specdistill.speculative import NgramDrafter
from specdistill.speculative.eagle import EagleDrafter
from specdistill.speculative.harness_bench import BenchConfig, Prompt, load_prompts, run_bench_many


def held_out(path: Path) -> list[Prompt]:
    """A nightly run's answered eval prompts (token ids as the benchmark ran them), or a bench prompt file."""
    first = path.read_text(encoding="utf-8").lstrip()[:1]
    if first == "{":
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if all("prompt_ids" in r for r in rows):
            return [Prompt(text="", slice=r.get("slice", "default"), ids=r["prompt_ids"]) for r in rows]
    return load_prompts(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", required=True, help="an EAGLE-3 head directory")
    ap.add_argument("--prompts", required=True, type=Path)
    ap.add_argument("--target", default="demo")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--widths", default="1,4,8")
    ap.add_argument("--gammas", default="1,2")
    ap.add_argument("--ngram-gamma", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    target = load_model(args.target, dtype=args.dtype)
    head = load_eagle3(args.head, target.model).head
    prompts = held_out(args.prompts)
    drafters, gammas = {}, {}
    for w in (int(x) for x in args.widths.split(",")):
        for g in (int(x) for x in args.gammas.split(",")):
            name = f"head W={w} γ={g}" if w > 1 else f"head chain γ={g}"
            drafters[name], gammas[name] = EagleDrafter(head, target.model, name=name, tree_width=w), g
    drafters["ngram"], gammas["ngram"] = NgramDrafter(), args.ngram_gamma
    config = BenchConfig(max_new_tokens=args.max_new_tokens, repeats=args.repeats, measure_cost=False)
    results = run_bench_many(target.model, target.tokenizer, drafters, prompts, config, gammas=gammas)
    some = next(iter(results.values()))
    print(f"\n{len(prompts)} held-out prompts, {args.max_new_tokens} new tokens, greedy, {some.dtype}, threads "
          f"{args.threads}, {args.repeats} repeat(s); target-only {some.tokens_per_second_target_only:.1f} tokens/s")
    print(f"{'drafter':<20} {'speedup':>8} {'α (chain)':>10} {'τ':>6}  lossless")
    for name, r in results.items():
        print(f"{name:<20} {r.speedup:>7.2f}x {r.acceptance_rate:>10.3f} {r.accepted_length:>6.2f}  {r.render_lossless()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
