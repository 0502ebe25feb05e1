"""How does suffix drafting from the target's past answers compare with n-gram lookup, the head and the hybrid?

    python benchmarks/suffix.py --home COPY_OF_.specdistill --head RUN/distill/KEY/draft --out /tmp/suffix-bench

The corpus is a nightly run's train answers (`train_generated.jsonl`: the target's own greedy answers
to the window's train prompts). The held-out sets: the run's own eval prompts with the target's answers
(`eval_generated.jsonl` beside it: "demo"), and more prompts of the log store's eval split (never in a
train window), per source: ShareGPT chat and HumanEval code, answered here by the target (greedy,
batched, cached under --out). Three parts:

1. Greedy rounds replayed against the target's held-out answers (no target forward: in greedy
   decoding the output is the target's answer, so a round accepts the longest common prefix of the
   draft and the answer): α, τ, the share of plain steps and the lookup time per round, for n-gram
   lookup and the suffix drafter (chain and tree), and τ against corpus size (the oldest answers
   dropped first, as the cap does).
2. The corpus index: build time, bytes per million corpus tokens, lookup time per round.
3. The harness benchmark (`speculative.harness_bench.run_bench_many`: one shared interleaved target-only run
   per prompt, lossless check): n-gram, suffix (chain, tree), the head (tree, as the nightly measures it)
   and the hybrid at several thresholds: α, τ, speedup, c side by side.

Nothing is written into --home (give it a copy of the demo's state directory: its log store is opened
read-only in effect, answers are generated under --out).

Measured on a `make demo` of main (run 1 December 2026; bf16, 2 threads, AMD EPYC with AVX-512 BF16; the machine shared,
load average 11-16): corpus 1024 train answers, 88,838 tokens; held-out: the demo's own 10 eval
prompts ("demo"), 12 more ShareGPT and 2 HumanEval eval prompts (all the HumanEval eval split left);
answers 96 tokens. `--bench-prompts 0`, replayed greedy rounds (tokens/forward: generated tokens per
target forward, plain steps included):

| drafter | demo α | demo τ | demo plain share | demo tokens/forward | ShareGPT tokens/forward | HumanEval tokens/forward |
|---|---:|---:|---:|---:|---:|---:|
| n-gram [1,3], γ 4 | 0.283 | 2.12 | 0.41 | 1.66 | 1.49 | 1.18 |
| n-gram [1,3], γ 8 | 0.175 | 2.33 | 0.43 | 1.77 | 1.57 | 1.19 |
| suffix, request only, γ 8 | 0.525 | 2.16 | 0.41 | 1.69 | 1.53 | 1.15 |
| suffix, γ 8 | 0.426 | 2.22 | 0.06 | 2.15 | 2.06 | 1.75 |
| suffix, γ 8, max_spec_factor 2 | 0.305 | 2.34 | 0.06 | 2.26 | 2.19 | 1.84 |
| suffix, γ 8, min_token_prob 0.3 | 0.452 | 2.29 | 0.13 | 2.12 | 2.03 | 1.73 |
| suffix, γ 8, tree of 4 | 0.436 | 2.33 | 0.06 | 2.25 | 2.17 | 1.78 |

The corpus turns the 41-53% of plain steps (no match in the request) into drafting rounds: 2.15-2.26
tokens per target forward against n-gram's 1.77 on the demo's prompts (1.21-1.28x), 1.75-1.84 against
1.19 on HumanEval. τ against corpus size (suffix, γ 8, the newest answers kept; demo / ShareGPT /
HumanEval tokens per forward): none 1.69 / 1.53 / 1.15, 64 answers 1.87 / 1.68 / 1.35, 256 answers
2.08 / 1.77 / 1.62, 512 answers 2.15 / 2.00 / 1.70, 1024 answers 2.15 / 2.06 / 1.75: still rising at
1024 answers off the demo's prompts. The index holds 8.0 bytes per corpus token (8 MB per million),
builds in 0.2-0.4 s for the demo's corpus and 3.7-7.7 s for a million tokens; a lookup took 1.1-1.8 ms
per round on the demo's corpus and 2-3 ms on the million-token one on this loaded machine (0.4-0.8 ms
at a lower load, c ≈ 0.02-0.03 of a quiet bf16 target step of ~27 ms).

The harness benchmark and the hybrid's threshold, `--bench-only` on a fresh `make demo` of main
(1 December 2026, 19:30-19:45 UTC; bf16, 2 threads, AMD EPYC with AVX-512 BF16, quiet but for
niced tests; its corpus 960 train answers, 83k tokens; head: that demo's EAGLE-3 head, tree 4 at
γ=2), 40 new tokens, interleaved, one shared target-only run per prompt:

    python benchmarks/suffix.py --home COPY --head RUN/distill/KEY/draft --bench-prompts 10 \
        --bench-sets demo,sharegpt,humaneval --max-new-tokens 40 --bench-only --repeats 2 --thresholds 1,2,3

22 prompts (demo 10, ShareGPT 10, HumanEval 2: all the HumanEval eval split holds), 2 repeats,
target-only ≈ 22.5 tokens/s:

| drafter | γ | α | τ | speedup | c | demo | sharegpt | humaneval |
|---|---:|---:|---:|---:|---:|---:|---:|---:|
| ngram γ4 | 4 | 0.153 | 1.59 | 1.22x | 0.004 | 1.34x | 1.12x | 1.25x |
| ngram γ8 | 8 | 0.096 | 1.68 | 1.18x | 0.003 | 1.30x | 1.06x | 1.26x |
| suffix | 8 | 0.329 | 1.86 | 1.62x | 0.005 | 1.63x | 1.58x | 1.74x |
| suffix, spec factor 2, tree 4 | 8 | 0.237 | 2.06 | 1.70x | 0.009 | 1.67x | 1.66x | 2.15x |
| head (tree 4) | 2 | 0.287 | 1.77 | 1.39x | 0.079 | 1.40x | 1.34x | 1.59x |
| hybrid, threshold 1 | 8 | 0.334 | 2.04 | 1.68x | 0.077 | 1.67x | 1.64x | 1.96x |
| hybrid, threshold 2 | 8 | 0.330 | 2.10 | 1.70x | 0.081 | 1.66x | 1.71x | 1.83x |
| hybrid, threshold 3 | 8 | 0.328 | 2.08 | 1.61x | 0.079 | 1.60x | 1.58x | 1.80x |

All lossless (16 exact, 6 near-tie for n-gram and suffix; 14 and 8 with the head). Suffix over the
faster n-gram: 1.32x (demo 1.22, ShareGPT 1.42, HumanEval 1.37). The run before it (12 prompts:
demo and HumanEval, 1 repeat, thresholds 0.5,1,2,3) gave the hybrid 1.56x, 1.68x, 1.60x, 1.66x: the
threshold (expected accepted suffix tokens before the suffix proposal is taken over the head's) is
flat from 1 to 3 within the runs' noise and lower at 0.5, so `HYBRID_THRESHOLD` stays 2.0 (at
threshold 2 the suffix proposed in 362 rounds, the head in 448). HumanEval's 2 prompts say little.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from specdistill.data.logstore import LogStore
from specdistill.data.prompts import Prompt, usable_prompt
from specdistill.modeling.models import dtype_name, load_model
from specdistill.pipeline.stages.answers.harness import generate_answers
from specdistill.speculative import NgramDrafter, drafter_from_spec
from specdistill.speculative.decode import greedy_path, tree_depths
from specdistill.speculative.harness_bench import BenchConfig, run_bench_many
from specdistill.speculative.hybrid import HybridDrafter
from specdistill.speculative.suffix import SuffixDrafter, SuffixIndex, SuffixParams


def answers_file(home: Path) -> Path:
    found = sorted((home / "nightly" / "data").glob("*/train_generated.jsonl"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"no train_generated.jsonl under {home}/nightly/data: run `make demo` first")
    return found[-1]


def read_jsonl(path: Path) -> list[dict]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def heldout_sets(home: Path, target, out: Path, per_source: dict[str, int], max_new_tokens: int, exclude: set[str]):
    """{slice: [records with prompt_ids, response_ids]}: eval-split prompts per source, answered by the target."""
    sets = {}
    with LogStore(f"sqlite:///{home / 'logs.db'}") as store:
        for name, n in per_source.items():
            sources = [s["source"] for s in store.stats()["by_source"] if name in s["source"].lower()]
            if not sources:
                continue
            rows = store.sample(max(4 * n, n + 50), seed=1, split="eval", source=sources[0])
            prompts = []
            for row in rows:
                if str(row.id) in exclude:
                    continue
                usable = usable_prompt(row.messages, target.tokenizer)
                if usable is not None:
                    prompts.append(Prompt(id=str(row.id), messages=usable[0]))
                if len(prompts) >= n:
                    break
            path = out / f"heldout_{name}.jsonl"
            records = generate_answers(target.model, target.tokenizer, prompts, path, max_new_tokens=max_new_tokens)
            sets[name] = [records[p.id] for p in prompts]
    return sets


def replay(drafter, records: list[dict], gamma: int, tree: bool = False) -> dict:
    """Greedy rounds against the target's answers: what the decoding loop would accept, without the target."""
    rounds = proposed = accepted = extra = plain = generated = 0
    seconds = 0.0
    for rec in records:
        prompt, answer = list(rec["prompt_ids"]), list(rec["response_ids"])
        seq = torch.tensor(prompt + answer)
        drafter.reset()
        g = 1  # the prefill's token
        while g < len(answer):
            length = len(prompt) + g
            k = min(gamma, len(answer) - g - 1)
            if k <= 0:
                g += 1
                plain += 1
                continue
            start = time.perf_counter()
            if tree:
                ids, parents = drafter.propose_tree(seq[:length], k)
            else:
                ids, _ = drafter.propose(seq[:length], k, None, None)
                parents = list(range(-1, ids.numel() - 1))
            seconds += time.perf_counter() - start
            if ids.numel() == 0:
                g += 1
                plain += 1
                continue
            depths = tree_depths(parents)
            truth = answer[g:]
            choice = torch.tensor([truth[0]] + [truth[d] if d < len(truth) else -1 for d in depths])
            path, _ = greedy_path(choice, ids, parents)
            chain = next((i for i, p in enumerate(parents) if p != i - 1), len(parents))
            on_chain = next((i for i, node in enumerate(path) if node != i), len(path))
            rounds += 1
            proposed += chain
            accepted += on_chain
            extra += len(path) - on_chain
            g += len(path) + 1
        generated += len(answer)
    steps = rounds + plain
    return {"alpha": accepted / proposed if proposed else 0.0, "tau": 1 + (accepted + extra) / rounds if rounds else 1.0,
            "plain_share": plain / steps if steps else 0.0, "rounds": rounds,
            "tokens_per_step": (generated - len(records)) / steps if steps else 0.0,
            "lookup_ms": 1e3 * seconds / max(1, rounds + plain)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home", type=Path, required=True, help="a copy of the demo's state directory")
    ap.add_argument("--answers", type=Path, default=None, help="the corpus: a train_generated.jsonl (default: newest)")
    ap.add_argument("--head", default=None, help="the distilled EAGLE-3 head (or draft) directory, for head and hybrid")
    ap.add_argument("--out", type=Path, default=Path("/tmp/suffix-bench"))
    ap.add_argument("--chat", type=int, default=48, help="held-out ShareGPT prompts")
    ap.add_argument("--code", type=int, default=48, help="held-out HumanEval prompts (the eval split has few)")
    ap.add_argument("--answer-tokens", type=int, default=96, help="the target's answer length (the nightly's 96)")
    ap.add_argument("--bench-prompts", type=int, default=12, help="per set, for the harness benchmark (0: skip it)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--thresholds", default="1,2", help="hybrid thresholds (expected accepted suffix tokens)")
    ap.add_argument("--bench-sets", default=None, help="comma-separated sets for the harness benchmark (default: all)")
    ap.add_argument("--bench-only", action="store_true", help="skip the replayed rounds and the corpus curve")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    target = load_model("demo", dtype=args.dtype)
    dtype = dtype_name(target.model.dtype)
    corpus_path = args.answers or answers_file(args.home)
    corpus_records = read_jsonl(corpus_path)
    sequences = [r["response_ids"] for r in corpus_records if r.get("response_ids")]
    demo_eval = corpus_path.with_name("eval_generated.jsonl")  # the nightly's own held-out prompts and answers
    demo = read_jsonl(demo_eval) if demo_eval.is_file() else []
    sets = {"demo": demo} if demo else {}
    sets.update(heldout_sets(args.home, target, args.out, {"sharegpt": args.chat, "humaneval": args.code},
                             args.answer_tokens, {str(r["id"]) for r in corpus_records + demo}))
    results: dict = {"corpus": str(corpus_path), "dtype": dtype, "threads": args.threads,
                     "sets": {k: len(v) for k, v in sets.items()}}
    print(f"corpus {corpus_path}: {len(sequences)} answers, {sum(map(len, sequences))} tokens; held-out "
          + ", ".join(f"{k} {len(v)}" for k, v in sets.items()) + f"; {dtype}, {args.threads} threads", flush=True)

    # 2. the index: build time, memory, per-round lookup time on a synthetic million-token corpus as well
    t = time.perf_counter()
    index = SuffixIndex(sequences)
    build = time.perf_counter() - t
    rng = np.random.default_rng(0)
    synthetic = [sequences[i % len(sequences)] if i % 2 else rng.integers(0, 49152, 90).tolist() for i in range(12_000)]
    t = time.perf_counter()
    big = SuffixIndex(synthetic)
    big_build = time.perf_counter() - t
    results["index"] = {"tokens": index.num_tokens, "build_s": build, "bytes_per_million": 1e6 * index.nbytes / index.num_tokens,
                        "synthetic_tokens": big.num_tokens, "synthetic_build_s": big_build,
                        "synthetic_bytes_per_million": 1e6 * big.nbytes / big.num_tokens}

    # 1. replayed greedy rounds
    drafters = {} if args.bench_only else {"ngram[1,3] γ4": (NgramDrafter(1, 3), 4, False), "ngram[1,3] γ8": (NgramDrafter(1, 3), 8, False),
                "suffix request-only γ8": (SuffixDrafter(None), 8, False),
                "suffix γ4": (SuffixDrafter(index), 4, False), "suffix γ8": (SuffixDrafter(index), 8, False),
                "suffix γ8 factor 2": (SuffixDrafter(index, SuffixParams(max_spec_factor=2.0)), 8, False),
                "suffix γ8 min prob 0.3": (SuffixDrafter(index, SuffixParams(min_token_prob=0.3)), 8, False),
                "suffix γ8 tree 4": (SuffixDrafter(index, tree_width=4), 8, True),
                "suffix γ8 1M-token corpus": (SuffixDrafter(big), 8, False)}
    replayed = {}
    for name, records in sets.items():
        replayed[name] = {d: replay(dr, records, g, tree) for d, (dr, g, tree) in drafters.items()}
    results["replay"] = replayed
    if drafters:  # --bench-only: the benchmark alone
        print("\n## Greedy rounds replayed against the target's held-out answers\n")
        print("τ counts drafting rounds only; tokens/forward counts every target step (plain steps too): the speed a "
              "free draft and a free verification would give\n")
        print("| drafter | " + " | ".join(f"{s} α | {s} τ | {s} plain | {s} tokens/forward | {s} ms/lookup" for s in sets) + " |")
        print("|---|" + "---:|" * 5 * len(sets))
        for d in drafters:
            print(f"| {d} | " + " | ".join(f"{replayed[s][d]['alpha']:.3f} | {replayed[s][d]['tau']:.2f} | "
                                          f"{replayed[s][d]['plain_share']:.2f} | {replayed[s][d]['tokens_per_step']:.2f} | "
                                          f"{replayed[s][d]['lookup_ms']:.3f}" for s in sets) + " |")
        ix = results["index"]
        print(f"\nindex: {ix['tokens']} tokens built in {ix['build_s']:.2f} s, {ix['bytes_per_million'] / 1e6:.1f} MB per "
              f"million tokens; {ix['synthetic_tokens']} tokens in {ix['synthetic_build_s']:.2f} s, "
              f"{ix['synthetic_bytes_per_million'] / 1e6:.1f} MB per million")

    # corpus size against acceptance: the newest answers kept, as the cap keeps them
    curve = {}
    for frac in () if args.bench_only else (0.0, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0):
        keep = sequences[len(sequences) - int(round(frac * len(sequences))):] if frac else []
        drafter = SuffixDrafter(SuffixIndex(keep))
        curve[f"{frac:.4g}"] = {"answers": len(keep), "tokens": sum(map(len, keep)),
                                **{s: replay(drafter, records, 8) for s, records in sets.items()}}
    results["corpus_curve"] = curve
    if curve:
        print("\n## Corpus size against acceptance (suffix, γ 8; the newest answers kept)\n")
        print("| answers | tokens | " + " | ".join(f"{s} α | {s} τ | {s} tokens/forward" for s in sets) + " |")
        print("|---:|---:|" + "---:|" * 3 * len(sets))
        for row in curve.values():
            print(f"| {row['answers']} | {row['tokens']} | " + " | ".join(
                f"{row[s]['alpha']:.3f} | {row[s]['tau']:.2f} | {row[s]['tokens_per_step']:.2f}" for s in sets) + " |")

    # 3. the harness benchmark
    if args.bench_prompts:
        chosen = args.bench_sets.split(",") if args.bench_sets else list(sets)
        prompts = [Prompt("", name, list(r["prompt_ids"])) for name, records in sets.items() if name in chosen
                   for r in records[: args.bench_prompts]]
        wide = SuffixParams(max_spec_factor=2.0)
        made = {"ngram γ4": NgramDrafter(1, 3), "ngram γ8": NgramDrafter(1, 3), "suffix": SuffixDrafter(index, name="suffix"),
                "suffix-f2-tree4": SuffixDrafter(index, wide, tree_width=4, name="suffix-f2-tree4")}
        gammas = {"ngram γ4": 4, "ngram γ8": 8, "suffix": 8, "suffix-f2-tree4": 8}
        if args.head:
            made["head"] = drafter_from_spec(target.model, f"eagle3:{args.head}", tree_width=4)
            gammas["head"] = 2
            for x in [float(v) for v in args.thresholds.split(",") if v]:
                name = f"hybrid@{x:g}"
                made[name] = HybridDrafter(drafter_from_spec(target.model, f"eagle3:{args.head}", tree_width=4),
                                           SuffixDrafter(index), x, name=name, model_gamma=2)
                gammas[name] = 8
        config = BenchConfig(max_new_tokens=args.max_new_tokens, repeats=args.repeats)
        bench = run_bench_many(target.model, target.tokenizer, made, prompts, config, gammas=gammas)
        results["bench"] = {k: v.to_dict() for k, v in bench.items()}
        base = statistics.median([s.tokens_per_second_target_only for s in bench["ngram γ4"].slices])
        print(f"\n## Harness benchmark ({len(prompts)} held-out prompts, {args.max_new_tokens} new tokens, {dtype}, "
              f"{args.threads} threads, {args.repeats} repeat(s); target-only ≈ {base:.1f} tokens/s)\n")
        slices = [s for s in sets if s in chosen]
        print("| drafter | γ | α | τ | speedup | c | lossless | " + " | ".join(f"{s} speedup" for s in slices) + " |")
        print("|---|---:|---:|---:|---:|---:|---|" + "---:|" * len(slices))
        for name, r in bench.items():
            per = {s.name: s.speedup for s in r.slices}
            c = "n/a" if r.cost_ratio is None else f"{r.cost_ratio:.3f}"
            print(f"| {name} | {r.gamma} | {r.acceptance_rate:.3f} | {r.accepted_length:.2f} | {r.speedup:.2f}x | {c} | "
                  f"{'yes' if r.lossless else 'NO'} ({r.lossless_exact} exact, {r.lossless_near_ties} near-tie) | "
                  + " | ".join(f"{per.get(s, 0):.2f}x" for s in slices) + " |")
        for name, d in made.items():
            if isinstance(d, HybridDrafter):
                print(f"{name}: suffix proposed in {d.suffix_rounds} rounds, the head in {d.model_rounds}")
        ngram = max(r.speedup for n, r in bench.items() if n.startswith("ngram"))
        ours = {n: r.speedup for n, r in bench.items() if n.startswith(("suffix", "hybrid"))}
        print(f"\nagainst the faster n-gram ({ngram:.2f}x): " + ", ".join(f"{n} {x / ngram:.2f}" for n, x in ours.items()))
        for s in slices:
            ng = max(next((x.speedup for x in r.slices if x.name == s), 0) for n, r in bench.items() if n.startswith("ngram"))
            print(f"  {s}: " + ", ".join(f"{n} {next((x.speedup for x in r.slices if x.name == s), 0) / ng:.2f}"
                                         for n, r in bench.items() if n.startswith(("suffix", "hybrid")) and ng))
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"\nresults -> {args.out / 'results.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
