"""Acceptance of a strong "before" draft against the demo target and against its drift update.

    OMP_NUM_THREADS=1 python benchmarks/drift_acceptance.py [--work DIR] [--steps N] [--drafts 0-12+17-29,0-25]

Makes the target update (`specdistill.ops.drift.make_target_update`, cached in --work), then measures
each draft (target layers, init_draft_from_target, untrained) on 5 HumanEval prompts (every 8th of the
first 40) + 5 ShareGPT first turns (9 to 200 prompt tokens), greedy, γ=4: against the original target
as it is, and against the updated target through a transplanted copy (the updated target has more
tokens than the draft). Prints a table, a sample of the updated target's answers (is it still a
sensible LM?) and writes results.json in --work.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import specdistill  # noqa: F401  (offline environment)


def prompts(tokenizer, n_code: int = 5, n_chat: int = 5, max_tokens: int = 200) -> list[tuple[str, list[int]]]:
    from specdistill.data.datasets import humaneval_prompts, sharegpt_first_turns
    from specdistill.speculative.bench import encode_prompt

    code = humaneval_prompts()[0:40:8][:n_code]
    chat = sharegpt_first_turns(n_chat, tokenizer=tokenizer, min_tokens=9, max_tokens=max_tokens)
    return [("code", encode_prompt(tokenizer, text)) for text in code] + [("chat", encode_prompt(tokenizer, t.text)) for t in chat]


def measure(target, drafter, prompt_set, gamma: int, max_new_tokens: int) -> dict:
    from specdistill.speculative import SpecStats, generate

    stats = {"code": [], "chat": []}
    for kind, ids in prompt_set:
        stats[kind].append(generate(target.model, ids, max_new_tokens=max_new_tokens, drafter=drafter, gamma=gamma).stats)
    out = {}
    for kind, rows in [("all", stats["code"] + stats["chat"]), ("code", stats["code"]), ("chat", stats["chat"])]:
        t = SpecStats.total(rows)
        out[kind] = {"alpha": round(t.acceptance_rate, 3), "tau": round(t.accepted_length, 3), "proposed": t.proposed}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default=".specdistill/bench-drift")
    parser.add_argument("--steps", type=int, default=None, help="update steps (default: make_target_update's)")
    parser.add_argument("--lr", type=float, default=None, help="update learning rate (default: make_target_update's)")
    parser.add_argument("--after-only", action="store_true", help="skip the measurement against the original target")
    parser.add_argument("--drafts", default="0-12+17-29")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from specdistill.modeling.drafts import (
        init_draft_from_target,
        parse_layers,
        save_draft,
    )
    from specdistill.modeling.models import load_model
    from specdistill.ops.drift import make_target_update
    from specdistill.ops.monitor import aligned_drafter
    from specdistill.speculative import ModelDrafter, generate

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    base = load_model("demo")
    updated_dir = work / "target-update"
    if not (updated_dir / "config.json").is_file():
        t0 = time.time()
        kw = {} if args.steps is None else {"steps": args.steps}
        kw.update({} if args.lr is None else {"lr": args.lr})
        make_target_update("demo", updated_dir, **kw)
        print(f"target update made in {time.time() - t0:.0f} s", file=sys.stderr)
    updated = load_model(updated_dir)
    prompt_set = prompts(base.tokenizer)
    results = {"drafts": {}, "gamma": args.gamma, "max_new_tokens": args.max_new_tokens,
               "prompts": {"code": sum(k == "code" for k, _ in prompt_set), "chat": sum(k == "chat" for k, _ in prompt_set)}}
    n = base.config.num_hidden_layers
    for spec in args.drafts.split(","):
        if "-" in spec:  # ranges joined by '+': 0-12+17-29 skips layers 13..16
            layers = [i for part in spec.split("+") for i in range(int(part.split("-")[0]), int(part.split("-")[1]) + 1)]
        else:
            layers = parse_layers(spec, n)
        ddir = work / f"draft-{spec.replace(':', '')}"
        if not (ddir / "config.json").is_file():
            save_draft(init_draft_from_target(base.model, layers), base.tokenizer, ddir, meta={"layers": layers})
        if args.after_only:
            before = {k: {"alpha": float("nan"), "tau": float("nan")} for k in ("all", "code", "chat")}
        else:
            before = measure(base, ModelDrafter(load_model(ddir).model, base.config.vocab_size), prompt_set, args.gamma,
                             args.max_new_tokens)
        drafter, transplanted, why = aligned_drafter(updated, load_model(ddir))
        after = measure(updated, drafter, prompt_set, args.gamma, args.max_new_tokens)
        results["drafts"][spec] = {"layers": len(layers), "before": before, "after": after, "transplanted": transplanted}
        print(f"{spec:<12} before α {before['all']['alpha']:.3f} τ {before['all']['tau']:.2f} "
              f"(code {before['code']['alpha']:.3f}, chat {before['chat']['alpha']:.3f})   after α {after['all']['alpha']:.3f} "
              f"τ {after['all']['tau']:.2f} (code {after['code']['alpha']:.3f}, chat {after['chat']['alpha']:.3f})", flush=True)
    samples = []
    for kind, ids in [prompt_set[0], prompt_set[-1]]:
        out = generate(updated.model, ids, max_new_tokens=48).output_ids
        samples.append({"kind": kind, "answer": updated.tokenizer.decode(out)})
        print(f"--- updated target, {kind} prompt:\n{samples[-1]['answer']}", flush=True)
    results["updated_target_samples"] = samples
    (work / "results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results["drafts"], indent=1))


if __name__ == "__main__":
    main()
