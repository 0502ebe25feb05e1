"""Which batch size answers fastest in the nightly's decode loop? Answer tokens/s at several sizes, interleaved.

    python benchmarks/answer_batch.py [--sizes 64,128,256] [--prompts 256] [--rounds 2] [--dtype auto]

The target answers the same ShareGPT first turns (chat template applied, prompts cut to 384 tokens),
greedy, 96 new tokens, through `pipeline.stages.answers.decode_loop.decode_batch` as the harness runs it
(decode attention on, the top-32 teacher and the EAGLE-3 feature layers recorded on the way), the
prompts cut into batches of each size. Rounds alternate the order of the sizes; tokens/s counts answer
tokens up to and including EOS over the wall time of all batches. What `generation.batch_size: null`
picks per CPU kind rests on this table (`pipeline.stages.answers.harness.answer_batch`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdistill.data.datasets import sharegpt_first_turns
from specdistill.data.prompts import encode_chat
from specdistill.hardware import describe_device
from specdistill.modeling.attention import decode_attention_for
from specdistill.modeling.eagle3 import default_aux_layers
from specdistill.modeling.models import load_model
from specdistill.pipeline.stages.answers.decode_loop import FeatureRecorder, TopKRecorder, decode_batch

NEW_TOKENS, TOP_K, MAX_PROMPT = 96, 32, 384


def answer_all(model, prompts: list[list[int]], batch: int, layers: list[int], pad: int, eos: int) -> tuple[float, int]:
    """Answer tokens/s over every prompt in batches of `batch`, and the answer tokens."""
    tokens, start = 0, time.perf_counter()
    for begin in range(0, len(prompts), batch):
        rows = prompts[begin : begin + batch]
        teacher = TopKRecorder(TOP_K, 1.0, len(rows), NEW_TOKENS)
        features = FeatureRecorder(layers, 0, len(rows), NEW_TOKENS)
        with decode_attention_for(model):
            answers = decode_batch(model, rows, max_new_tokens=NEW_TOKENS, pad=pad, eos=eos, recorder=teacher,
                                   features=features)
        for row in answers.tolist():
            tokens += row.index(eos) + 1 if eos in row else len(row)
    return tokens / (time.perf_counter() - start), tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64,128,256")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    torch.set_num_threads(args.threads)
    target = load_model("demo", dtype=args.dtype)
    model, tok = target.model, target.tokenizer
    turns = sharegpt_first_turns(args.prompts, min_chars=20, max_chars=400, continuations=False, tokenizer=tok)
    prompts = [encode_chat(tok, t.messages)[-MAX_PROMPT:] for t in turns][: args.prompts]
    layers = default_aux_layers(model.config.num_hidden_layers)
    eos, pad = tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    print(f"{describe_device('cpu')}; {model.dtype}, {args.threads} threads; {len(prompts)} prompts "
          f"(mean {statistics.mean(map(len, prompts)):.0f} tokens), {NEW_TOKENS} new tokens", flush=True)
    rates: dict[int, list[float]] = {b: [] for b in sizes}
    for r in range(args.rounds):
        for b in sizes if r % 2 == 0 else sizes[::-1]:
            rate, tokens = answer_all(model, prompts, b, layers, pad, eos)
            rates[b].append(rate)
            print(f"  round {r} batch {b}: {rate:.1f} answer tokens/s ({tokens} tokens)", flush=True)
    base = statistics.median(rates[sizes[0]])
    print(f"\n| batch | answer tokens/s (median) | per round | against batch {sizes[0]} |\n|---:|---:|---|---:|")
    for b in sizes:
        m = statistics.median(rates[b])
        print(f"| {b} | {m:.1f} | {' '.join(f'{x:.1f}' for x in rates[b])} | {m / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
