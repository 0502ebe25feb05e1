"""Our speculative decoding engine side by side with transformers' assisted generation.

Same target (the demo target), same draft, same γ, greedy, same prompts (ShareGPT first turns with
the chat template, HumanEval prompts as raw code), same `max_new_tokens`, one process, every method
run on every prompt in a rotating order, repeated; tokens/s per repeat, medians reported. Also
checks that every greedy method's output equals our target-only output (the 20-prompt lossless check
on the real target).

    PYTHONPATH=. python benchmarks/engine_vs_hf.py --prompts 20 --max-new-tokens 32 --repeats 2 --gamma 3

Methods (pick with --methods): ours-base, hf-base, ours-draft, hf-assisted (assistant_model= the
same draft, num_assistant_tokens=γ, constant schedule, confidence threshold off), ours-draft-rv
(the same draft with a reduced draft vocabulary, no transformers counterpart), ours-ngram,
hf-lookup (prompt_lookup_num_tokens=γ), ours-self-K, hf-early-exit-K (assistant_early_exit=K).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time
from collections import Counter

import torch

import specdistill  # noqa: F401  (offline environment)
from specdistill.data.datasets import humaneval_path, sharegpt_path
from specdistill.modeling.drafts import init_draft_from_target, measure_cost_ratio
from specdistill.modeling.models import load_model
from specdistill.modeling.vocab import build_draft_vocab, token_frequencies
from specdistill.speculative import (
    ModelDrafter,
    NgramDrafter,
    SelfSpecDrafter,
    SpecStats,
    generate,
)
from specdistill.speculative.bench import encode_prompt


def sharegpt_first_turns(n: int, max_chars: int = 400) -> list[str]:
    """First human turns from the head of the (truncated) ShareGPT file, decoded record by record."""
    decoder = json.JSONDecoder()
    with open(sharegpt_path(), encoding="utf-8") as f:
        head = f.read(4_000_000)
    pos = head.index("[") + 1
    out = []
    while len(out) < n:
        while head[pos] in " \n\r\t,":
            pos += 1
        record, pos = decoder.raw_decode(head, pos)
        turns = record.get("conversations") or []
        if turns and turns[0].get("from") in ("human", "user") and 20 <= len(turns[0]["value"]) <= max_chars:
            out.append(turns[0]["value"])
    return out


def humaneval_prompts(n: int) -> list[str]:
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()][:n]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=20, help="half ShareGPT, half HumanEval")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", default="0,1,2,29", help="target layers of the (untrained) draft")
    ap.add_argument("--self-spec", type=int, default=8, help="exit layer for ours-self-K / hf-early-exit-K")
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--methods", default="ours-base,hf-base,ours-draft,hf-assisted,ours-draft-rv,ours-ngram,hf-lookup,ours-self,hf-early-exit")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    ap.add_argument("--write-prompts", default=None, metavar="JSONL",
                    help="only write the prompt set as `specdistill bench --prompts` reads it, and exit")
    args = ap.parse_args()
    if args.write_prompts:
        with open(args.write_prompts, "w", encoding="utf-8") as f:
            for text in sharegpt_first_turns(args.prompts - args.prompts // 2):
                f.write(json.dumps({"prompt": text, "slice": "chat"}) + "\n")
            for text in humaneval_prompts(args.prompts // 2):
                f.write(json.dumps({"prompt": text, "slice": "code"}) + "\n")
        return 0
    torch.set_num_threads(args.threads)

    loaded = load_model("demo")
    target, tok = loaded.model, loaded.tokenizer
    eos = tok.eos_token_id
    layers = [int(x) for x in args.layers.split(",")]
    draft = init_draft_from_target(target, layers)
    for cfg in (draft.generation_config,):
        cfg.num_assistant_tokens = args.gamma
        cfg.num_assistant_tokens_schedule = "constant"
        cfg.assistant_confidence_threshold = 0.0  # same γ every round, as in our engine
    chat = sharegpt_first_turns(args.prompts - args.prompts // 2)
    code = humaneval_prompts(args.prompts // 2)
    prompts = [("chat", encode_prompt(tok, p, chat_template=True)) for p in chat]
    prompts += [("code", encode_prompt(tok, p, chat_template=False)) for p in code]
    counts = token_frequencies(tok, chat + code)
    counts.update(Counter(range(args.draft_vocab)))  # plus the lowest ids (bytes, common merges)
    draft_vocab = build_draft_vocab(counts, args.draft_vocab, target.config.vocab_size, [eos])

    N, g, K = args.max_new_tokens, args.gamma, args.self_spec
    ours = {
        "ours-base": None,
        "ours-draft": ModelDrafter(draft, target.config.vocab_size, name="draft"),
        "ours-draft-rv": ModelDrafter(draft, target.config.vocab_size, draft_vocab, name="draft+reduced-vocab"),
        "ours-ngram": NgramDrafter(1, 3),
        "ours-self": SelfSpecDrafter(target, K),
    }

    def hf(ids: list[int], **kw):
        x = torch.tensor([ids])
        start = time.perf_counter()
        out = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos, **kw)
        seconds = time.perf_counter() - start
        return out[0, len(ids):].tolist(), seconds, None

    def run(method: str, ids: list[int]):
        if method in ours:
            r = generate(target, ids, max_new_tokens=N, drafter=ours[method], gamma=g, stop_token_ids=[eos])
            return r.output_ids, r.stats.seconds, r.stats
        if method == "hf-base":
            return hf(ids)
        if method == "hf-assisted":
            return hf(ids, assistant_model=draft, num_assistant_tokens=g, num_assistant_tokens_schedule="constant",
                      assistant_confidence_threshold=0.0)
        if method == "hf-lookup":
            return hf(ids, prompt_lookup_num_tokens=g, max_matching_ngram_size=3)
        if method == "hf-early-exit":
            return hf(ids, assistant_early_exit=K, num_assistant_tokens=g, num_assistant_tokens_schedule="constant",
                      assistant_confidence_threshold=0.0)
        raise SystemExit(f"unknown method {method}")

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if "ours-base" not in methods:
        methods.insert(0, "ours-base")
    print(f"threads {torch.get_num_threads()}  prompts {len(prompts)}  max_new_tokens {N}  gamma {g}  "
          f"draft layers {layers}  self-spec exit {K}  draft vocab {args.draft_vocab}", file=sys.stderr)
    with torch.inference_mode():
        for m in methods:  # warm-up
            run(m, prompts[0][1][:16])
    records = {m: [[] for _ in range(args.repeats)] for m in methods}  # (slice, tokens, seconds)
    outputs = {m: {} for m in methods}
    stats = {m: [] for m in methods}
    started = time.perf_counter()
    for r in range(args.repeats):
        for i, (slice_name, ids) in enumerate(prompts):
            shift = (r * len(prompts) + i) % len(methods)
            for m in methods[shift:] + methods[:shift]:
                with torch.inference_mode():
                    out, seconds, st = run(m, ids)
                records[m][r].append((slice_name, len(out), seconds))
                outputs[m][i] = out
                if st is not None and r == 0:
                    stats[m].append(st)
            done = r * len(prompts) + i + 1
            elapsed = time.perf_counter() - started
            print(f"\r{done}/{args.repeats * len(prompts)} prompt runs  {elapsed:.0f}s  "
                  f"eta {elapsed / done * (args.repeats * len(prompts) - done):.0f}s", end="", file=sys.stderr)
    print(file=sys.stderr)

    def tps(m: str, r: int, slice_name: str | None = None) -> float:
        rows = [x for x in records[m][r] if slice_name is None or x[0] == slice_name]
        return sum(x[1] for x in rows) / sum(x[2] for x in rows)

    def median_ratio(a: str, b: str, slice_name: str | None = None) -> float:
        return statistics.median(tps(a, r, slice_name) / tps(b, r, slice_name) for r in range(args.repeats))

    c_draft = measure_cost_ratio(target, draft)
    c_rv = measure_cost_ratio(target, draft, draft_vocab=draft_vocab)
    c_self = measure_cost_ratio(target, ours["ours-self"].model)
    costs = {"ours-draft": c_draft, "hf-assisted": c_draft, "ours-draft-rv": c_rv, "ours-self": c_self, "hf-early-exit": c_self}
    base = outputs["ours-base"]
    rows = []
    for m in methods:
        st = SpecStats.total(stats[m]) if stats[m] and m != "ours-base" else None
        rows.append({
            "method": m,
            "tokens_per_second": statistics.median(tps(m, r) for r in range(args.repeats)),
            "speedup_vs_ours_base": median_ratio(m, "ours-base"),
            "speedup_vs_hf_base": median_ratio(m, "hf-base") if "hf-base" in methods else None,
            "speedup_chat": median_ratio(m, "ours-base", "chat"),
            "speedup_code": median_ratio(m, "ours-base", "code"),
            "outputs_equal_target_only": sum(outputs[m][i] == base[i] for i in base),
            "acceptance_rate": st.acceptance_rate if st else None,
            "accepted_length": st.accepted_length if st else None,
            "cost_ratio": costs.get(m),
        })
    pairs = [("ours-draft", "hf-assisted"), ("ours-ngram", "hf-lookup"), ("ours-self", "hf-early-exit"), ("ours-base", "hf-base")]
    head_to_head = {f"{a} / {b}": median_ratio(a, b) for a, b in pairs if a in methods and b in methods}

    print(f"\n{'method':<15} {'tok/s':>7} {'vs ours-base':>12} {'vs hf-base':>10} {'chat':>6} {'code':>6} "
          f"{'lossless':>9} {'α':>6} {'τ':>5} {'c':>6}")
    for row in rows:
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        print(f"{row['method']:<15} {row['tokens_per_second']:>7.2f} {row['speedup_vs_ours_base']:>11.2f}x "
              f"{fmt(row['speedup_vs_hf_base'], '>9.2f')}x {row['speedup_chat']:>5.2f}x {row['speedup_code']:>5.2f}x "
              f"{row['outputs_equal_target_only']:>5}/{len(base):<3} {fmt(row['acceptance_rate'], '>6.3f')} "
              f"{fmt(row['accepted_length'], '>5.2f')} {fmt(row['cost_ratio'], '>6.3f')}")
    print("\nhead to head (tokens/s ratio, median of interleaved repeats):")
    for name, ratio in head_to_head.items():
        print(f"  {name:<30} {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "head_to_head": head_to_head,
                       "threads": torch.get_num_threads()}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
