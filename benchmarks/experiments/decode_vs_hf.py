"""Our speculative decoding loop side by side with transformers' assisted generation.

Same target (the demo target), same draft, same γ, same dtype, greedy, same prompts (ShareGPT first
turns with the chat template, HumanEval prompts as raw code; both from `specdistill.data.datasets`),
same `max_new_tokens`, one process. Also checks every greedy method's output against our target-only
output (the lossless check on the real target): exact equality in fp32; in bf16 the near-tie
criterion of docs/metrics.md ("Losslessness in reduced precision": an output that differs is
re-scored by the target in fp32), for transformers' methods as for ours.

Run it in both dtypes (every number depends on the dtype: on a CPU with AVX-512 BF16 a bf16 decode
step is faster and a k-token verification costs about one step, against 1.5-2 steps in fp32):

    python benchmarks/experiments/decode_vs_hf.py --dtype bfloat16 --prompts 20 --max-new-tokens 32 --repeats 2 --gamma 3
    python benchmarks/experiments/decode_vs_hf.py --dtype float32 --prompts 20 --max-new-tokens 32 --repeats 2 --gamma 3

Our methods run through `specdistill.speculative.harness_bench.run_bench_many` (the library's rotating order,
shared target-only run, per-repeat medians, lossless check, α, τ and measured c). transformers'
`generate` cannot run inside that loop, so the hf-* methods run in a second loop of the same shape:
every hf method and one target-only run of our loop per prompt, in an order that rotates from
prompt to prompt and repeat to repeat. Every speedup is a median over repeats against the
target-only run of its own loop; a head-to-head ratio is the ratio of the two methods' speedups.

Methods (pick with --methods): ours-base, hf-base, ours-draft, hf-assisted (assistant_model= the
same draft, num_assistant_tokens=γ, constant schedule, confidence threshold off), ours-draft-rv
(the same draft with a reduced draft vocabulary, no transformers counterpart), ours-ngram,
hf-lookup (prompt_lookup_num_tokens=γ), ours-self-K, hf-early-exit-K (assistant_early_exit=K).

The draft: by default the target's layers `--layers`, untrained (α near 0, so the head-to-head
mostly compares per-round overhead); with `--draft DIR` a trained draft checkpoint, loaded in the
target's dtype. ours-draft and hf-assisted both run its full-vocabulary head (transformers'
assistant needs the target's vocabulary); ours-draft-rv uses the draft's own reduced vocabulary
(draft_vocab.safetensors) when the checkpoint has one, as `specdistill generate --draft` does.
ours-draft-tree is the same draft at the same γ with our loop's tree verification (`--tree-width`
W: the chain plus the draft's W-1 runner-ups for the first position, one target forward), which
transformers' assisted generation does not have.

    python benchmarks/experiments/decode_vs_hf.py --dtype bfloat16 --draft DIR \\
        --methods ours-base,hf-base,ours-draft,hf-assisted,ours-draft-rv

With the demo's trained 4-layer draft (α 0.12, c 0.23 full head / 0.17 reduced), bf16, 1 thread,
10 prompts × 48 tokens, γ 3, load average 6-8: ours-draft / hf-assisted 0.97x, ours-draft-rv /
hf-assisted 1.14x, ours-base / hf-base 1.00x. Both loops spend their time in the same model
forwards: in a CPU-time profile of 6 prompts our loop's work outside them was ~2% and
transformers' ~11%, which bounds what a leaner loop can gain with the same draft.

Since then the loop runs its forwards its own way (transformers' `generate` keeps the stock
modeling code; both get the same packed bf16 weights): matmul attention for the few tokens of a
step or verification instead of SDPA's CPU flash kernel (`modeling.attention`), a preallocated KV
cache, and the lean Llama forward (`modeling.lean`). With the demo's generic draft (α 0.083),
bf16, 10 prompts × 32 tokens, γ 3, quiet machine, the checkout before them and after:

    threads      ours-base / hf-base  ours-draft / hf-assisted
    1 (before)         0.99x                 1.04x
    1 (two runs)       1.08x, 1.06x          1.10x, 1.08x
    2                  1.04x                 1.11x

With the demo's trained 4-layer generic draft (full head: α 0.09 at γ 3, c 0.245), bf16, 1 thread,
10 prompts × 32 tokens, 2 repeats, quiet machine (load 0.6), `--methods
ours-base,hf-base,ours-draft,hf-assisted,ours-draft-tree`: ours-base / hf-base 1.07x, ours-draft /
hf-assisted 1.08x, ours-draft-tree (W 4) / hf-assisted 1.10x (τ 1.26 -> 1.38, but the draft's cost
dominates a round: both draft rows run at 0.76-0.77x of target-only). Every row lossless.

A bf16 step of the demo target moves ~270 MB of weights (7.7 GB/s at 35 ms a step on one core):
the GEMMs are bandwidth-bound and the same in both loops, so what is left between them is the
~20% of a step in small ops and per-call machinery, of which the lean forward removes about half.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter

import torch

import specdistill  # noqa: F401  (offline environment)
from specdistill.data.datasets import humaneval_prompts, sharegpt_first_turns
from specdistill.modeling.drafts import init_draft_from_target
from specdistill.modeling.models import DTYPE_CHOICES, dtype_name, load_model
from specdistill.modeling.vocab import DraftVocab, build_draft_vocab, token_frequencies
from specdistill.speculative import ModelDrafter, NgramDrafter, SelfSpecDrafter, default_stop_ids, generate
from specdistill.speculative.harness_bench import BenchConfig, Prompt, encode_prompt, run_bench_many
from specdistill.speculative.lossless import check_lossless, fp32_reference, model_dtype

HF_METHODS = ("hf-base", "hf-assisted", "hf-lookup", "hf-early-exit")


def prompt_texts(n: int) -> tuple[list[str], list[str]]:
    """Half ShareGPT first turns (20 to 400 characters, chats that open with them), half HumanEval prompts."""
    chat = [turn.text for turn in sharegpt_first_turns(n - n // 2, min_chars=20, max_chars=400, continuations=False)]
    return chat, humaneval_prompts()[: n // 2]


def run_hf(target, draft, prompts: list[Prompt], methods: list[str], args) -> dict:
    """Rows for each hf method and for our target-only run (the loop's reference), measured in one rotating loop."""
    eos = default_stop_ids(target)
    N, g, K = args.max_new_tokens, args.gamma, args.self_spec
    options = {
        "hf-base": {},
        "hf-assisted": {"assistant_model": draft, "num_assistant_tokens": g, "num_assistant_tokens_schedule": "constant",
                        "assistant_confidence_threshold": 0.0},
        "hf-lookup": {"prompt_lookup_num_tokens": g, "max_matching_ngram_size": 3},
        "hf-early-exit": {"assistant_early_exit": K, "num_assistant_tokens": g, "num_assistant_tokens_schedule": "constant",
                          "assistant_confidence_threshold": 0.0},
    }

    def run(method: str, ids: list[int]) -> tuple[list[int], float]:
        if method == "ours-base":
            r = generate(target, ids, max_new_tokens=N, gamma=g)
            return r.output_ids, r.stats.seconds
        x = torch.tensor([ids])
        start = time.perf_counter()
        out = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos[0], **options[method])
        return out[0, len(ids):].tolist(), time.perf_counter() - start

    modes = ["ours-base", *methods]
    with torch.inference_mode():
        for m in modes:  # warm-up
            run(m, prompts[0].ids[:16])
        times = {m: [[] for _ in range(args.repeats)] for m in modes}  # (slice, tokens, seconds)
        outputs = {m: {} for m in modes}
        for r in range(args.repeats):
            for i, p in enumerate(prompts):
                shift = (r + i) % len(modes)
                for m in modes[shift:] + modes[:shift]:
                    out, seconds = run(m, p.ids)
                    times[m][r].append((p.slice, len(out), seconds))
                    outputs[m][i] = out
            print(f"hf loop: repeat {r + 1}/{args.repeats} done", file=sys.stderr)

    def tps(m: str, r: int, slice_name: str | None = None) -> float:
        rows = [x for x in times[m][r] if slice_name is None or x[0] == slice_name]
        return sum(x[1] for x in rows) / sum(x[2] for x in rows)

    def speedup(m: str, slice_name: str | None = None) -> float:
        return statistics.median(tps(m, r, slice_name) / tps("ours-base", r, slice_name) for r in range(args.repeats))

    exact = torch.finfo(model_dtype(target)).bits >= 32
    reference = None
    rows = {}
    for m in modes:  # the last repeat's outputs against our target-only output, by the library's criterion
        base = [outputs["ours-base"][i] for i in range(len(prompts))]
        mine = [outputs[m][i] for i in range(len(prompts))]
        if not exact and reference is None and base != mine:
            reference = fp32_reference(target)
        report = check_lossless(reference, [p.ids for p in prompts], base, mine, exact=exact)
        rows[m] = {"tokens_per_second": statistics.median(tps(m, r) for r in range(args.repeats)),
                   "speedup_vs_ours_base": speedup(m), "speedup_chat": speedup(m, "chat"), "speedup_code": speedup(m, "code"),
                   "lossless": (report.exact, report.near_ties, report.mismatches),
                   "acceptance_rate": None, "accepted_length": None, "cost_ratio": None}
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=20, help="half ShareGPT, half HumanEval")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="target and draft dtype (auto: bf16 where native)")
    ap.add_argument("--layers", default="0,1,2,29", help="target layers of the (untrained) draft")
    ap.add_argument("--draft", default=None, metavar="DIR", help="a trained draft checkpoint instead of the untrained layers")
    ap.add_argument("--self-spec", type=int, default=8, help="exit layer for ours-self-K / hf-early-exit-K")
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--tree-width", type=int, default=4, help="first-position candidates of ours-draft-tree")
    ap.add_argument("--methods", default="ours-base,hf-base,ours-draft,hf-assisted,ours-draft-rv,ours-ngram,hf-lookup,"
                                          "ours-self,hf-early-exit")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    ap.add_argument("--write-prompts", default=None, metavar="JSONL",
                    help="only write the prompt set as `specdistill bench --prompts` reads it, and exit")
    args = ap.parse_args()
    if args.write_prompts:
        chat, code = prompt_texts(args.prompts)
        with open(args.write_prompts, "w", encoding="utf-8") as f:
            for text in chat:
                f.write(json.dumps({"prompt": text, "slice": "chat"}) + "\n")
            for text in code:
                f.write(json.dumps({"prompt": text, "slice": "code"}) + "\n")
        return 0
    torch.set_num_threads(args.threads)

    loaded = load_model("demo", dtype=args.dtype)
    dtype = dtype_name(loaded.model.dtype)
    target, tok = loaded.model, loaded.tokenizer
    layers = [int(x) for x in args.layers.split(",")]
    own_vocab = None
    if args.draft:
        loaded_draft = load_model(args.draft, dtype=loaded.model.dtype)
        draft, own_vocab = loaded_draft.model, DraftVocab.load(loaded_draft.path)
        if draft.config.vocab_size != target.config.vocab_size:
            raise SystemExit(f"{args.draft}: draft vocabulary {draft.config.vocab_size} differs from the target's "
                             f"{target.config.vocab_size}; transformers' assistant cannot use it")
        draft_name = f"{args.draft} (trained, {draft.config.num_hidden_layers} layers)"
    else:
        draft = init_draft_from_target(target, layers)
        draft_name = f"target layers {layers} (untrained)"
    draft.generation_config.num_assistant_tokens = args.gamma
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0  # same γ every round, as in our loop
    chat, code = prompt_texts(args.prompts)
    prompts = [Prompt(t, "chat", ids=encode_prompt(tok, t, chat_template=True)) for t in chat]
    prompts += [Prompt(t, "code", ids=encode_prompt(tok, t, chat_template=False)) for t in code]
    counts = token_frequencies(tok, chat + code)
    counts.update(Counter(range(args.draft_vocab)))  # plus the lowest ids (bytes, common merges)
    draft_vocab = own_vocab or build_draft_vocab(counts, args.draft_vocab, target.config.vocab_size, [tok.eos_token_id])

    g, K = args.gamma, args.self_spec
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if "ours-base" not in methods:
        methods.insert(0, "ours-base")
    ours = {
        "ours-draft": lambda: ModelDrafter(draft, target.config.vocab_size, name="draft"),
        "ours-draft-rv": lambda: ModelDrafter(draft, target.config.vocab_size, draft_vocab, name="draft+reduced-vocab"),
        "ours-draft-tree": lambda: ModelDrafter(draft, target.config.vocab_size, name=f"draft, tree {args.tree_width}",
                                                tree_width=args.tree_width),
        "ours-ngram": lambda: NgramDrafter(1, 3),
        "ours-self": lambda: SelfSpecDrafter(target, K),
    }
    unknown = [m for m in methods if m != "ours-base" and m not in ours and m not in HF_METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}")
    print(f"dtype {dtype}  threads {torch.get_num_threads()}  prompts {len(prompts)}  max_new_tokens {args.max_new_tokens}  gamma {g}  "
          f"draft {draft_name}  self-spec exit {K}  reduced draft vocab {draft_vocab.size}", file=sys.stderr)

    rows = {}
    drafters = {m: ours[m]() for m in methods if m in ours}
    config = BenchConfig(gamma=g, max_new_tokens=args.max_new_tokens, repeats=args.repeats)
    for m, res in (run_bench_many(target, tok, drafters, prompts, config) if drafters else {}).items():
        by_slice = {s.name: s for s in res.slices}
        rows[m] = {"tokens_per_second": res.tokens_per_second_speculative, "speedup_vs_ours_base": res.speedup,
                   "speedup_chat": by_slice["chat"].speedup if "chat" in by_slice else None,
                   "speedup_code": by_slice["code"].speedup if "code" in by_slice else None,
                   "lossless": (res.lossless_exact, res.lossless_near_ties, res.lossless_mismatches),
                   "acceptance_rate": res.acceptance_rate, "accepted_length": res.accepted_length, "cost_ratio": res.cost_ratio}
        rows.setdefault("ours-base", {"tokens_per_second": res.tokens_per_second_target_only, "speedup_vs_ours_base": 1.0,
                                      "speedup_chat": 1.0, "speedup_code": 1.0, "lossless": (len(prompts), 0, 0),
                                      "acceptance_rate": None, "accepted_length": None, "cost_ratio": None})
    hf_methods = [m for m in methods if m in HF_METHODS]
    if hf_methods or not drafters:
        for m, row in run_hf(target, draft, prompts, hf_methods, args).items():
            rows.setdefault(m, row)  # ours-base: from the library's loop when it ran, else from this one
    costs = {"hf-assisted": rows.get("ours-draft", {}).get("cost_ratio"), "hf-early-exit": rows.get("ours-self", {}).get("cost_ratio")}
    table = []
    for m in methods:
        row = {"method": m, **rows[m]}
        if row["cost_ratio"] is None:
            row["cost_ratio"] = costs.get(m)
        row["speedup_vs_hf_base"] = (row["speedup_vs_ours_base"] / rows["hf-base"]["speedup_vs_ours_base"]
                                     if "hf-base" in rows else None)
        table.append(row)
    pairs = [("ours-draft", "hf-assisted"), ("ours-draft-tree", "hf-assisted"), ("ours-ngram", "hf-lookup"),
             ("ours-self", "hf-early-exit"), ("ours-base", "hf-base")]
    head_to_head = {f"{a} / {b}": rows[a]["speedup_vs_ours_base"] / rows[b]["speedup_vs_ours_base"]
                    for a, b in pairs if a in rows and b in rows}

    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    print(f"\n{dtype}, threads {torch.get_num_threads()}, {len(prompts)} prompts, max_new_tokens {args.max_new_tokens}, "
          f"γ {g}, repeats {args.repeats}, draft {draft_name}; lossless = prompts exact/near-tie/real mismatch "
          f"({'exact equality' if dtype == 'float32' else 'fp32 re-score, tolerance 0.5'})")
    print(f"{'method':<15} {'tok/s':>7} {'vs ours-base':>12} {'vs hf-base':>10} {'chat':>6} {'code':>6} "
          f"{'lossless':>9} {'α':>6} {'τ':>5} {'c':>6}")
    for row in table:
        print(f"{row['method']:<15} {fmt(row['tokens_per_second'], '>7.2f')} {row['speedup_vs_ours_base']:>11.2f}x "
              f"{fmt(row['speedup_vs_hf_base'], '>9.2f')}x {fmt(row['speedup_chat'], '>5.2f')}x {fmt(row['speedup_code'], '>5.2f')}x "
              f"{'/'.join(map(str, row['lossless'])):>9} {fmt(row['acceptance_rate'], '>6.3f')} "
              f"{fmt(row['accepted_length'], '>5.2f')} {fmt(row['cost_ratio'], '>6.3f')}")
    print("\nhead to head (ratio of the two methods' speedups over our target-only decoding, medians of interleaved repeats):")
    for name, ratio in head_to_head.items():
        print(f"  {name:<30} {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "dtype": dtype, "rows": table, "head_to_head": head_to_head,
                       "threads": torch.get_num_threads()}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
