"""Which recipe trains the EAGLE-3 head best on one night's answers? Variant against variant: the defaults rest on it.

    python benchmarks/head_recipe.py --answers DIR [--work /tmp/head_recipe] [--steps 2400] \\
        [--variant NAME=key=value,key=value ...]

DIR is a night's answer directory (`train_generated.jsonl`, `teacher_cache/`, `features/`), as the demo
writes it under `.specdistill/runs/answers/`. Each variant trains the head from the target on exactly
those answers for --steps steps (no minute budget, so a loaded machine changes the minutes, not the
result) with the nightly's train section plus its overrides (keys under `train.`, e.g.
`optim.lr=2e-3`, `eagle3.steps=1`, `loss.kind=mix`). The minutes each took are reported beside it.

Every variant is scored on the same --heldout prompts that neither the night's answers nor any held-out
set under --exclude-dir saw (ShareGPT first turns, disjoint by prompt text): the target's greedy
answers, first-position acceptance and chained τ(γ=4), teacher-forced, at each evaluation along the way.
Tune here, then judge on the demo's own held-out prompts, which this never reads.
Prints the table; writes results.json in --work (a rerun reuses finished variants).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from common import answer, log

from specdistill.data.datasets import sharegpt_first_turns
from specdistill.distill.distill_recipe import DataConfig, TeacherConfig
from specdistill.distill.train import distill
from specdistill.hardware import describe_device
from specdistill.modeling.models import load_model
from specdistill.pipeline.nightly_recipe import load_nightly_config


def seen_prompts(paths: list[Path]) -> set[str]:
    out = set()
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                out.add(json.dumps(json.loads(line)["prompt"], sort_keys=True))
    return out


def heldout_prompts(tok, args) -> list[dict]:
    path = Path(args.work) / "heldout_prompts.json"
    if path.is_file():
        return json.loads(path.read_text())
    files = [Path(args.answers) / "train_generated.jsonl"]
    for d in args.exclude_dir:
        files += sorted(Path(d).rglob("*_generated.jsonl"))  # the answer files, not the suffix corpus
    seen = seen_prompts([f for f in files if f.is_file()])
    turns = sharegpt_first_turns(scan=args.scan, tokenizer=tok, max_tokens=args.max_prompt_tokens)
    pool = [{"id": f"recipe-{t.id}", "prompt": t.messages} for t in turns
            if json.dumps(t.messages, sort_keys=True) not in seen]
    random.Random(1).shuffle(pool)
    chosen = pool[: args.heldout]
    path.write_text(json.dumps(chosen, ensure_ascii=False))
    return chosen


def train_variant(name: str, overrides: list[str], heldout: Path, args) -> dict:
    out = Path(args.work) / "runs" / name
    if (out / "result.json").is_file():
        return json.loads((out / "result.json").read_text())
    config = load_nightly_config(None, ["target=demo", f"dtype={args.dtype}"] + [f"train.{o}" for o in overrides])
    answers = Path(args.answers)
    data = DataConfig(path=str(answers / "train_generated.jsonl"), heldout_path=str(heldout), heldout_limit=args.heldout)
    dcfg = config.train.for_run(config, data=data, out_dir=out, feature_dir=str(answers / "features"),
                                teacher=TeacherConfig(mode="cache", cache_dir=str(answers / "teacher_cache")))
    dcfg = dcfg.model_copy(update={"progress": False, "eval_every": args.eval_every, "checkpoint_every": args.steps,
                                   "optim": dcfg.optim.model_copy(update={"max_steps": args.steps, "max_minutes": None})})
    log(f"train {name}: {' '.join(overrides) or '(defaults)'}")
    t0 = time.time()
    torch.manual_seed(0)
    result = distill(dcfg).result_json()
    result["wall_minutes"] = (time.time() - t0) / 60
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--answers", required=True, help="a night's answer directory (train_generated.jsonl, caches)")
    ap.add_argument("--work", default="/tmp/head_recipe")
    ap.add_argument("--exclude-dir", action="append", default=[], help="answer files under it are never held out")
    ap.add_argument("--variant", action="append", default=[], help="NAME=key=value,key=value (keys under train.)")
    ap.add_argument("--steps", type=int, default=2400)
    ap.add_argument("--eval-every", type=int, default=600)
    ap.add_argument("--heldout", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--max-prompt-tokens", type=int, default=384)
    ap.add_argument("--scan", type=int, default=12000)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    variants = {"base": []}
    for v in args.variant:
        name, _, rest = v.partition("=")
        variants[name] = [x for x in rest.split(",") if x]
    target = load_model("demo", dtype=args.dtype)
    prompts = heldout_prompts(target.tokenizer, args)
    answer(work, target, "heldout", prompts, batch_size=args.batch, max_new_tokens=args.max_new_tokens, record=False)
    heldout = work / "heldout" / "train_generated.jsonl"
    del target
    results = {"cpu": describe_device("cpu"), "args": vars(args), "variants": {}}
    for name, overrides in variants.items():
        r = train_variant(name, overrides, heldout, args)
        results["variants"][name] = {"overrides": overrides, "steps": r.get("steps"), "minutes": r.get("train_minutes"),
                                     "tokens": r.get("tokens"),
                                     "curve": [(c["step"], round(c["acceptance"], 4), round(c.get("tau_chain_4", 0), 3))
                                               for c in r["curve"]]}
        (work / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\n{results['cpu']}, dtype {args.dtype}; {args.steps} steps each; first-position acceptance "
          f"(τ chain γ=4) on {args.heldout} unseen prompts, every {args.eval_every} steps\n")
    print("| variant | overrides | train minutes | curve | final |")
    print("|---|---|---:|---|---:|")
    for name, v in results["variants"].items():
        curve = " ".join(f"{a:.3f}" for _, a, _ in v["curve"])
        step, a, tau = v["curve"][-1]
        print(f"| {name} | {' '.join(v['overrides']) or '–'} | {v['minutes'] or 0:.1f} | {curve} | {a:.3f} ({tau:.2f}) |")


if __name__ == "__main__":
    main()
