"""What does verifying k tokens in one forward cost against a 1-token decode step? k = 1..8, fp32 and bf16,
the demo target and a layer-extracted draft: the number that decides γ and whether speculation can pay at
all on this hardware.

    python benchmarks/verify_cost.py [--context 256] [--repeats 9] [--rounds 3]

Each (model, dtype) is measured in turn, `--rounds` times, rotating the order; medians are taken
over rounds, so the dtypes are compared side by side on the same machine state.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch

from specdistill.modeling.drafts import init_draft_from_target
from specdistill.modeling.models import load_model
from specdistill.speculative.gamma import measure_forward_seconds

KS = tuple(range(1, 9))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="demo")
    ap.add_argument("--draft-layers", default="0,1,2,29")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    target = load_model(args.target, dtype="float32").model  # fp32 weights; bf16 copies below
    draft = init_draft_from_target(target, [int(x) for x in args.draft_layers.split(",")])
    models = {"target fp32": target, "draft fp32": draft,
              "target bf16": copy.deepcopy(target).to(torch.bfloat16), "draft bf16": copy.deepcopy(draft).to(torch.bfloat16)}

    runs: dict[str, list[dict[int, float]]] = {k: [] for k in models}
    names = list(models)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            runs[name].append(measure_forward_seconds(models[name], KS, context=args.context, repeats=args.repeats))

    seconds = {name: {k: statistics.median(run[k] for run in rs) for k in KS} for name, rs in runs.items()}
    print(f"forward over k new tokens ÷ 1-token decode step (KV cache {args.context} tokens, "
          f"{torch.get_num_threads()} threads, median of {args.rounds} rounds × {args.repeats} repeats)")
    head = f"{'k':>3} " + " ".join(f"{n:>12}" for n in names)
    print(head)
    print("-" * len(head))
    for k in KS:
        print(f"{k:>3} " + " ".join(f"{seconds[n][k] / seconds[n][1]:>12.3f}" for n in names))
    print("-" * len(head))
    print(f"{'1-token step ms':>15}  " + "  ".join(f"{n}: {seconds[n][1] * 1e3:.2f}" for n in names))
    t32, t16 = seconds["target fp32"][1], seconds["target bf16"][1]
    print(f"target decode step fp32 ÷ bf16: {t32 / t16:.2f}x;  draft cost c (1-token step, draft ÷ target): "
          f"fp32 {seconds['draft fp32'][1] / t32:.3f}, bf16 {seconds['draft bf16'][1] / t16:.3f}")


if __name__ == "__main__":
    main()
