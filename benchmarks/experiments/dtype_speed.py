"""Target-only decoding in fp32 and bf16, side by side in one run: the bf16 ÷ fp32 tokens/s ratio.

The demo target is loaded twice (fp32 and bf16) and decodes the same held-out prompts greedily
through the decoding loop's target-only path (`speculative.generate` without a drafter, the baseline of
every speedup). Held out: ShareGPT first turns from `--skip` records into the shipped file onwards
(the demo ingests and trains on the file's start), chat-templated, and the last HumanEval prompts as
raw code. For every prompt both dtypes run back to back, the order alternating from prompt to prompt
and repeat to repeat. `--unpacked` adds a third variant, bf16 with plain `F.linear` (weights not
packed for oneDNN, `modeling.packed`), to show what packing buys. Per repeat, tokens/s is generated tokens over seconds summed over the
prompts; the ratio is bf16 ÷ fp32 within the repeat, and the reported ratio is the median over
repeats. Tokens per CPU-second (the process's own CPU time) is printed beside it: on a shared
machine wall time also counts other people's work. Also reports how many bf16 outputs are
token-identical to the fp32 ones.

    python benchmarks/experiments/dtype_speed.py --prompts 16 --max-new-tokens 64 --repeats 3 --threads 1 --unpacked
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import specdistill  # noqa: F401  (offline environment)
from specdistill.data.datasets import humaneval_prompts, sharegpt_first_turns
from specdistill.data.prompts import MAX_PROMPT_TOKENS, encode_chat
from specdistill.hardware import cpu_has_native_bf16
from specdistill.modeling.models import load_model
from specdistill.modeling.packed import PackedLinear
from specdistill.speculative import generate

DTYPES = ("float32", "bfloat16")
UNPACKED = "bf16 unpacked"


def unpack(model: torch.nn.Module) -> torch.nn.Module:
    """The model with plain `nn.Linear` layers again: bf16 as it ran before packing."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.__class__ = torch.nn.Linear
    return model


def held_out_prompts(tokenizer, n: int, skip: int) -> list[tuple[str, list[int]]]:
    """(slice, ids): half ShareGPT first turns past the first `skip` records, half the last HumanEval prompts."""
    turns = sharegpt_first_turns(n - n // 2, skip=skip, min_chars=20, max_chars=400, continuations=False,
                                 tokenizer=tokenizer, max_tokens=MAX_PROMPT_TOKENS)
    code = humaneval_prompts()[-(n // 2):] if n // 2 else []
    return ([("chat", encode_chat(tokenizer, t.messages)) for t in turns]
            + [("code", tokenizer(text, add_special_tokens=False)["input_ids"]) for text in code])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16, help="half ShareGPT, half HumanEval")
    ap.add_argument("--skip", type=int, default=5000, help="ShareGPT records to skip (the demo's training traffic)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--unpacked", action="store_true", help="also bf16 without packed linear weights")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    models = {d: load_model("demo", dtype=d).model for d in DTYPES}
    variants = (*DTYPES, UNPACKED) if args.unpacked else DTYPES
    if args.unpacked:
        models[UNPACKED] = unpack(load_model("demo", dtype="bfloat16").model)
    prompts = held_out_prompts(load_model("demo").tokenizer, args.prompts, args.skip)
    print(f"{len(prompts)} held-out prompts, {args.max_new_tokens} new tokens, greedy, threads {torch.get_num_threads()}, "
          f"native bf16: {cpu_has_native_bf16()}", file=sys.stderr)

    def decode(dtype: str, ids: list[int]) -> tuple[list[int], float, float]:
        cpu_start = time.process_time()
        result = generate(models[dtype], ids, max_new_tokens=args.max_new_tokens)
        return result.output_ids, result.stats.seconds, time.process_time() - cpu_start

    for d in variants:  # warm-up: first-call allocations, oneDNN kernel selection
        decode(d, prompts[0][1][:16])
    # records[variant][repeat] = [(slice, tokens, seconds, CPU seconds)] per prompt
    records: dict[str, list[list[tuple[str, int, float, float]]]] = {d: [[] for _ in range(args.repeats)] for d in variants}
    outputs: dict[str, list[list[int]]] = {d: [[] for _ in prompts] for d in variants}
    for r in range(args.repeats):
        for i, (slice_name, ids) in enumerate(prompts):
            turn = (r + i) % len(variants)  # the order rotates from prompt to prompt and repeat to repeat
            for d in variants[turn:] + variants[:turn]:
                out, seconds, cpu_seconds = decode(d, ids)
                records[d][r].append((slice_name, len(out), seconds, cpu_seconds))
                outputs[d][i] = out
        print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr)

    def tps(d: str, r: int, slice_name: str | None = None, clock: int = 2) -> float:
        rows = [x for x in records[d][r] if slice_name is None or x[0] == slice_name]
        return sum(x[1] for x in rows) / sum(x[clock] for x in rows)

    def ratio(slice_name: str | None = None, clock: int = 2, a: str = "bfloat16", b: str = "float32") -> float:
        return statistics.median(tps(a, r, slice_name, clock) / tps(b, r, slice_name, clock) for r in range(args.repeats))

    same = sum(a == b for a, b in zip(outputs["float32"], outputs["bfloat16"]))
    print(f"\ntarget-only greedy decoding, demo target (SmolLM2-135M), the harness, {len(prompts)} held-out prompts, "
          f"{args.max_new_tokens} new tokens, threads {torch.get_num_threads()}, {args.repeats} interleaved repeats")
    print(f"{'dtype':<14} {'tokens/s (median)':>18} {'tokens/CPU-s':>13} {'per repeat':>24}")
    for d in variants:
        per = [tps(d, r) for r in range(args.repeats)]
        cpu = statistics.median(tps(d, r, clock=3) for r in range(args.repeats))
        print(f"{d:<14} {statistics.median(per):>18.1f} {cpu:>13.1f} {' '.join(f'{x:.1f}' for x in per):>24}")
    slices = dict.fromkeys(s for s, _ in prompts)
    print(f"bf16 / fp32 tokens/s: {ratio():.2f}x (median over repeats of the within-repeat ratio; "
          + ", ".join(f"{s} {ratio(s):.2f}x" for s in slices) + f"); per CPU-second {ratio(clock=3):.2f}x")
    print(f"bf16 outputs token-identical to fp32 outputs: {same}/{len(prompts)}")
    if args.unpacked:
        identical = sum(a == b for a, b in zip(outputs["bfloat16"], outputs[UNPACKED]))
        print(f"bf16 packed / unpacked tokens/s: {ratio(a='bfloat16', b=UNPACKED):.2f}x; unpacked / fp32 "
              f"{ratio(a=UNPACKED):.2f}x; packed outputs token-identical to unpacked: {identical}/{len(prompts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
