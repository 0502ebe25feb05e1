"""Night after night: an EAGLE-3 head trained on the answer pool against one trained on each night's window alone.

    python -m benchmarks.experiments.nights [--work DIR] [--nights 4] [--prompts 1024] [--minutes 3] [--threads 1]

N simulated nights over disjoint windows of the shipped ShareGPT traffic (first user turns, shuffled
once; the held-out prompts are disjoint from every window). Each night the bf16 target answers its
window as the nightly's answer stage does (teacher top-k rows and the head's features recorded in the
same pass), the answers join an `AnswerPool`, and two heads are trained with the nightly's settings,
each warm-started from its own previous night's head (the champion):

  pool    trains on the pool view: every night so far, newest first, capped by --pool-max-tokens
  single  trains on the night's window only (what the nightly did before the pool)

Night 1 is the same run for both. Each night prints the first-position acceptance and the chained τ(4)
of both heads on the same held-out answers (the trainer's estimate), and, with --bench-prompts, the
harness benchmark of both heads on the same held-out prompts (first-position acceptance, τ and
speedup, tree width 4, γ 4). Every stage is cached in --work: a rerun resumes. Writes results.json
and, when matplotlib is installed, nights.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import specdistill  # noqa: F401  (offline environment)
from benchmarks.experiments.distill_budget import log, select_prompts, write_jsonl
from specdistill.data.prompts import Prompt
from specdistill.distill.distill_recipe import DataConfig, DistillConfig, Eagle3Config, LossConfig, OptimConfig, TeacherConfig
from specdistill.distill.examples import read_done, read_examples
from specdistill.distill.features import FeatureCache, build_feature_cache
from specdistill.distill.pool import AnswerPool
from specdistill.distill.teacher import TeacherCache
from specdistill.distill.train import distill
from specdistill.distill.trained import Trained
from specdistill.modeling.eagle3 import default_aux_layers
from specdistill.modeling.models import load_model, resolve_dtype
from specdistill.pipeline.stages.answers.harness import generate_answers

REPO = Path(__file__).resolve().parents[2]


def answer_night(args, target, night: int, prompts: list[dict]) -> dict:
    """The answer stage for one window: answers, teacher rows and features in one target pass."""
    d = Path(args.work) / "data" / f"night{night}"
    cache = TeacherCache.create(d / "teacher_cache", fingerprint=target.fingerprint, k=32, temperature=1.0,
                                vocab="full", data=f"night{night}")
    features = FeatureCache.create(d / "features", fingerprint=target.fingerprint,
                                   layers=default_aux_layers(target.config.num_hidden_layers), data=f"night{night}",
                                   prompt_context=0)
    t0 = time.time()
    records = generate_answers(target.model, target.tokenizer, [Prompt(id=p["id"], messages=p["prompt"]) for p in prompts],
                               d / "train_generated.jsonl", batch_size=args.gen_batch, max_new_tokens=args.max_new_tokens,
                               teacher_cache=cache, feature_cache=features)
    tokens = sum(len(r["response_ids"]) for r in records.values())
    log(f"night {night}: {len(records)} answers, {tokens} answer tokens ({time.time() - t0:.0f} s)")
    return {"key": f"night{night}", "answers": d / "train_generated.jsonl", "teacher_cache": d / "teacher_cache",
            "features": d / "features", "tokens": tokens}


def train(args, name: str, data: str, teacher_cache: str, features: str, warm: str | None, heldout: str,
          heldout_features: str) -> Trained:
    """One nightly distillation run (the pipeline's settings: fkl, batch 4, 2 unroll steps, bf16 autocast)."""
    out = Path(args.work) / "runs" / name
    if (out / "result.json").is_file():
        return json.loads((out / "result.json").read_text())
    per_eval = max(10, int(args.minutes * args.steps_per_minute / 4))
    cfg = DistillConfig(
        target="demo", kind="eagle3", draft=warm, draft_vocab=None if warm else 8192,
        eagle3=Eagle3Config(steps=2, feature_dir=features, heldout_feature_dir=heldout_features),
        data=DataConfig(path=data, heldout_path=heldout, heldout_limit=args.eval),
        loss=LossConfig(kind="fkl"), teacher=TeacherConfig(mode="cache", cache_dir=teacher_cache),
        optim=OptimConfig(lr=3e-4 if warm else 1e-3, batch_size=4, max_steps=100_000, max_minutes=args.minutes,
                          warmup_steps=20, clock=args.clock, bf16=args.bf16 and resolve_dtype("auto") == torch.bfloat16),
        out_dir=str(out), checkpoint_every=per_eval, eval_every=per_eval, threads=args.threads, progress=False)
    t0 = time.time()
    result = distill(cfg)
    final = result.curve[-1]
    log(f"{name}: {result.steps} steps, {result.tokens} tokens trained, acceptance {final['acceptance']:.3f} "
        f"τ(4) chain {final.get('tau_chain_4', float('nan')):.2f} ({time.time() - t0:.0f} s)")
    return result


def bench_heads(args, target, heads: dict[str, str], eval_prompts: list[dict]) -> dict:
    """Both heads and target-only on the same held-out prompts, one interleaved run (the nightly's bench)."""
    from specdistill.data.prompts import encode_chat
    from specdistill.speculative import drafter_from_spec
    from specdistill.speculative.harness_bench import BenchConfig, run_bench_many

    prompts = [Prompt(text="", ids=encode_chat(target.tokenizer, p["prompt"])) for p in eval_prompts[: args.bench_prompts]]
    made = {name: drafter_from_spec(target.model, f"eagle3:{d}", tree_width=4) for name, d in heads.items()}
    results = run_bench_many(target.model, target.tokenizer, made, prompts,
                             BenchConfig(gamma=4, max_new_tokens=args.bench_tokens, repeats=1), progress=False)
    return {name: {"first_position": r.per_position_acceptance[0] if r.per_position_acceptance else 0.0,
                   "tau": r.accepted_length, "speedup": r.speedup, "lossless": r.lossless} for name, r in results.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default=str(REPO / ".specdistill" / "bench" / "nights"))
    p.add_argument("--nights", type=int, default=4)
    p.add_argument("--prompts", type=int, default=1024, help="train prompts per night (the demo's window)")
    p.add_argument("--eval", type=int, default=40, help="held-out prompts (the trainer's estimate)")
    p.add_argument("--minutes", type=float, default=3.0, help="training minutes per night and head (the demo's)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="cpu",
                   help="what --minutes counts (cpu: this process's CPU time, fair on a shared machine)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--max-prompt-tokens", type=int, default=128)
    p.add_argument("--gen-batch", type=int, default=16)
    p.add_argument("--pool-max-tokens", type=int, default=400_000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast in training")
    p.add_argument("--bench-prompts", type=int, default=0, help="held-out prompts for the speed benchmark (0: none)")
    p.add_argument("--bench-tokens", type=int, default=40)
    p.add_argument("--steps-per-minute", type=float, default=60.0, help="for eval/checkpoint spacing")
    p.add_argument("--scan", type=int, default=12000)
    p.add_argument("--plot", default=None, help="default: WORK/nights.png")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    target = load_model("demo", dtype="auto")
    tok = target.tokenizer
    split_path = work / "split.json"
    if split_path.is_file():
        split = json.loads(split_path.read_text())
    else:
        train_prompts, heldout = select_prompts(tok, args.nights * args.prompts, args.eval, args.max_prompt_tokens, args.scan)
        split = {"train": train_prompts, "heldout": heldout}
        split_path.write_text(json.dumps(split, ensure_ascii=False))
    windows = [split["train"][i * args.prompts : (i + 1) * args.prompts] for i in range(args.nights)]
    assert all(len(w) == args.prompts for w in windows), "not enough prompts for the windows asked"
    log(f"{args.nights} nights x {args.prompts} prompts (disjoint windows), {len(split['heldout'])} held-out; "
        f"target dtype {target.model.dtype}, {args.threads} thread(s), {args.minutes} training minutes "
        f"({args.clock} clock) per head")

    heldout_path = work / "eval_generated.jsonl"
    held = generate_answers(target.model, tok, [Prompt(id=p["id"], messages=p["prompt"]) for p in split["heldout"]],
                            work / "eval_answers.jsonl", batch_size=args.gen_batch, max_new_tokens=args.max_new_tokens)
    write_jsonl(heldout_path, [held[p["id"]] for p in split["heldout"]])
    held_features = work / "heldout_features"
    build_feature_cache(target.model, read_examples(str(heldout_path), "generated", tok, 512), held_features,
                        fingerprint=target.fingerprint, layers=default_aux_layers(target.config.num_hidden_layers),
                        prompt_context=None, extend=True, progress=False)

    pool = AnswerPool.open(work / "pool", target.fingerprint)
    pool.hold_out(read_done(heldout_path).values())
    rows, heads = [], {"pool": None, "single": None}
    for night in range(1, args.nights + 1):
        data = answer_night(args, target, night, windows[night - 1])
        pool.add_night(data["key"], data["answers"], data["teacher_cache"], data["features"])
        view = pool.view(include=data["key"], max_tokens=args.pool_max_tokens)
        runs = {}
        runs["single"] = train(args, f"single-night{night}" if night > 1 else "night1", str(data["answers"]),
                               str(data["teacher_cache"]), str(data["features"]), heads["single"], str(heldout_path),
                               str(held_features))
        runs["pool"] = runs["single"] if night == 1 else train(
            args, f"pool-night{night}", view.path, view.teacher_cache, view.features, heads["pool"], str(heldout_path),
            str(held_features))
        heads = {arm: r.draft_dir for arm, r in runs.items()}
        row = {"night": night, "pool_answers": view.answers, "pool_tokens": view.tokens, "pool_nights": len(view.nights),
               "night_tokens": data["tokens"], "pool_disk_gb": pool.disk_bytes() / 2**30}
        for arm, r in runs.items():
            final = r.curve[-1]
            row[arm] = {"acceptance": final["acceptance"], "tau_chain_4": final.get("tau_chain_4"),
                        "steps": r.steps, "tokens_trained": r.tokens}
        if args.bench_prompts:
            bench_cache = work / "runs" / f"bench-night{night}.json"
            if not bench_cache.is_file():
                bench_cache.write_text(json.dumps(bench_heads(args, target, heads, split["heldout"])))
            for arm, b in json.loads(bench_cache.read_text()).items():
                row[arm]["bench"] = b
        rows.append(row)
        (work / "results.json").write_text(json.dumps({"args": vars(args), "nights": rows}, indent=2))
    print_table(rows)
    plot(rows, Path(args.plot or work / "nights.png"))
    return 0


def print_table(rows: list[dict]) -> None:
    print("\nnight | pool: nights answers tokens | acceptance@1 pool / single | τ(4) chain pool / single"
          " | bench acc@1, τ, speedup pool / single")
    for r in rows:
        bench = ""
        if "bench" in r["pool"]:
            b, s = r["pool"]["bench"], r["single"]["bench"]
            bench = (f" | {b['first_position']:.3f} {b['tau']:.2f} {b['speedup']:.2f}x / "
                     f"{s['first_position']:.3f} {s['tau']:.2f} {s['speedup']:.2f}x")
        print(f"{r['night']:5d} | {r['pool_nights']:2d} {r['pool_answers']:6d} {r['pool_tokens']:7d} | "
              f"{r['pool']['acceptance']:.3f} / {r['single']['acceptance']:.3f} | "
              f"{r['pool']['tau_chain_4']:.2f} / {r['single']['tau_chain_4']:.2f}{bench}")


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    nights = [r["night"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, style in (("pool", "o-"), ("single", "s--")):
        ax.plot(nights, [r[arm]["acceptance"] for r in rows], style, label=f"{arm} (held-out, trainer)")
    ax.axhline(0.5, color="red", lw=0.8, label="red line 0.5")
    ax.set_xlabel("night")
    ax.set_ylabel("first-position acceptance")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
