"""Held-out acceptance of distilled drafts against training budget, on the demo target and ShareGPT.

    python benchmarks/experiments/distill_budget.py [--work DIR] [--minutes M] [--only NAME|...]
    python benchmarks/experiments/distill_budget.py --long-minutes 60 --extra-train-prompts 600   # the 60-minute run

Phases (each cached in --work, so a rerun or a resume after a kill never redoes them):
  1. prompts: first-turn ShareGPT prompts, shuffled once, split into train and held-out (disjoint).
  2. target answers: the target answers every prompt greedily (batched, resumable); the top-k
     log-probs it produced on the way are the offline teacher cache.
  3. draft vocabulary: the N most frequent tokens in the target's training answers.
  4. one training run per configuration, each under the same wall-clock budget (and the same
     token budget where compared), with held-out acceptance (greedy top-1 agreement with the
     target's continuation) and expected τ(γ=4) logged as curves; c measured for each draft shape.
  5. with --long-minutes: one long run of the best shape on the 200 training answers plus
     --extra-train-prompts more (answered by the target the same way, never a held-out prompt),
     to see how far acceptance climbs within the time the issue allows.
Prints a table per configuration and the curves; writes results.json in --work.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import torch

import specdistill  # noqa: F401  (offline environment)
from specdistill.data.datasets import sharegpt_first_turns
from specdistill.data.prompts import Prompt
from specdistill.distill.examples import read_done, read_examples
from specdistill.distill.teacher import TeacherCache
from specdistill.modeling.models import load_model
from specdistill.modeling.vocab import build_draft_vocab
from specdistill.pipeline.stages.answers.harness import generate_answers

REPO = Path(__file__).resolve().parents[2]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def select_prompts(tokenizer, n_train: int, n_heldout: int, max_prompt_tokens: int, scan: int, seed: int = 0,
                   skip: int = 0):
    """First user turn (with its human answer) of ShareGPT records skip..scan, shuffled once, split in two."""
    turns = sharegpt_first_turns(skip=skip, scan=scan, tokenizer=tokenizer, max_tokens=max_prompt_tokens, answered=True)
    pool = [{"id": t.id, "prompt": t.messages, "human": t.answer} for t in turns]
    random.Random(seed).shuffle(pool)
    if len(pool) < n_train + n_heldout:
        raise SystemExit(f"only {len(pool)} usable prompts in the first {scan} records")
    return pool[n_heldout : n_heldout + n_train], pool[:n_heldout]


def prepare(args) -> dict:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    target = load_model("demo", dtype="float32")
    tok = target.tokenizer
    split_path = work / "split.json"
    if split_path.is_file():
        split = json.loads(split_path.read_text())
    else:
        train, heldout = select_prompts(tok, args.train_prompts, args.heldout_prompts, args.max_prompt_tokens, args.scan)
        split = {"train": train, "heldout": heldout}
        split_path.write_text(json.dumps(split, ensure_ascii=False))
    if args.extra_train_prompts > len(split.get("extra", [])):
        split["extra"] = extra_prompts(tok, split, args)
        split_path.write_text(json.dumps(split, ensure_ascii=False))
    extra = split.get("extra", [])[: args.extra_train_prompts]
    log(f"prompts: {len(split['train'])} train (+{len(extra)} for the long run), "
        f"{len(split['heldout'])} held-out (disjoint ids)")

    cache = TeacherCache.create(work / "teacher_cache", fingerprint=target.fingerprint, k=args.top_k,
                                temperature=1.0, vocab="full", data="generated")
    prompts = [Prompt(id=p["id"], messages=p["prompt"]) for p in split["heldout"] + split["train"] + extra]
    t0 = time.time()
    answers_path = work / "target_answers.jsonl"
    before = len(read_done(answers_path))
    if args.no_generate:  # use the answers already there (e.g. a generation stopped at its time box)
        done = read_done(answers_path)
        missing = [p.id for p in prompts if p.id not in done]
        if any(p["id"] in missing for p in split["train"] + split["heldout"]):
            raise SystemExit("--no-generate: the comparison split is not fully answered yet")
        extra = [p for p in extra if p["id"] in done]
        prompts = [p for p in prompts if p.id in done]
    else:
        done = generate_answers(target.model, tok, prompts, answers_path, batch_size=args.gen_batch,
                                max_new_tokens=args.max_new_tokens, teacher_cache=cache)
    gen_tokens = sum(len(done[p.id]["response_ids"]) for p in prompts)
    log(f"target answers: {len(done)} ({len(done) - before} new in {time.time() - t0:.0f}s), {gen_tokens} answer tokens")
    return {"target": target, "split": split, "answers": done, "cache": cache, "extra": extra}


def extra_prompts(tok, split: dict, args) -> list[dict]:
    """More training prompts for the long run: from records after the first `scan`, so the split the
    comparison table was measured on stays as it is and no held-out prompt can come back."""
    used = {p["prompt"][-1]["content"].strip() for p in split["train"] + split["heldout"]}
    train, _ = select_prompts(tok, args.extra_train_prompts, 0, args.max_prompt_tokens,
                              args.scan + args.extra_scan, seed=1, skip=args.scan)
    return [p for p in train if p["prompt"][-1]["content"].strip() not in used]


# --------------------------------------------------------------------------------------------
# Training runs


def build_vocab(work: Path, tok, split: dict, answers: dict, size: int):
    """The `size` most frequent tokens: the target's training answers first, then training-side text."""
    from specdistill.modeling.vocab import DraftVocab

    vdir = work / f"vocab{size}"
    if (vdir / "draft_vocab.safetensors").is_file():
        return vdir, DraftVocab.load(vdir)
    counts: Counter = Counter()
    for p in split["train"]:
        for t in answers[p["id"]]["response_ids"]:
            counts[t] += 1000
        counts.update(tok.encode(p["human"] + "\n" + p["prompt"][-1]["content"], add_special_tokens=False))
    vocab = build_draft_vocab(counts, size, len(tok), [tok.eos_token_id])
    vdir.mkdir(parents=True, exist_ok=True)
    vocab.save(vdir)
    return vdir, vocab


def write_jsonl(path: Path, records: list[dict]) -> Path:
    if not path.is_file():
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        tmp.replace(path)
    return path


def run_config(work: Path, name: str, overrides: list[str]) -> dict:
    """One training run (resumes from its checkpoints if killed; skipped if already finished)."""
    from specdistill.distill.distill_recipe import load_config
    from specdistill.distill.train import distill

    out = work / "runs" / name
    done = out / "result.json"
    if done.is_file():
        return json.loads(done.read_text())
    log(f"run {name}: {' '.join(overrides)}")
    cfg = load_config(None, [f"out_dir={out}", "progress=false", *overrides])
    return distill(cfg).result_json()  # as result.json holds it


def cost_ratio(target, layers: str, vocab) -> float:
    from specdistill.modeling.drafts import (
        init_draft_from_target,
        measure_cost_ratio,
        parse_layers,
    )

    draft = init_draft_from_target(target.model, parse_layers(layers, target.config.num_hidden_layers))
    return measure_cost_ratio(target.model, draft, draft_vocab=vocab, repeats=9)


def train_all(args, state) -> list[dict]:
    work = Path(args.work)
    target, split, answers = state["target"], state["split"], state["answers"]
    tok = target.tokenizer
    train_ids = [p["id"] for p in split["train"]]
    gen_train = write_jsonl(work / "train_generated.jsonl", [answers[i] for i in train_ids])
    gen_heldout = write_jsonl(work / "heldout_generated.jsonl", [answers[p["id"]] for p in split["heldout"]])
    human_train = write_jsonl(work / "train_human.jsonl", [
        {"id": p["id"], "messages": p["prompt"] + [{"role": "assistant", "content": p["human"]}]} for p in split["train"]])
    vdir, vocab = build_vocab(work, tok, split, answers, args.vocab)
    held_tokens = [t for p in split["heldout"] for t in answers[p["id"]]["response_ids"]]
    kept = set(vocab.token_ids.tolist())
    coverage = sum(t in kept for t in held_tokens) / len(held_tokens)
    mean_answer = sum(len(answers[i]["response_ids"]) for i in train_ids) / len(train_ids)
    log(f"draft vocabulary {args.vocab}: covers {coverage:.3f} of held-out target answer tokens "
        f"(an upper bound on a reduced-vocab draft's acceptance); mean target answer {mean_answer:.0f} tokens")

    budget = args.tokens
    steps = max(10, round(budget / (args.batch * mean_answer)))
    common = ["target=demo", f"data.heldout_path={gen_heldout}", f"data.max_len={args.max_len}", f"optim.batch_size={args.batch}",
              f"optim.max_tokens={budget}", f"optim.max_minutes={args.minutes}", f"optim.warmup_steps={max(2, steps // 5)}",
              f"eval_every={max(5, steps // 2)}", f"checkpoint_every={max(5, steps // 4)}", f"threads={args.threads}"]
    kl = ["teacher.mode=cache", f"teacher.cache_dir={work / 'teacher_cache'}", f"data.path={gen_train}", f"optim.max_steps={steps}"]
    # human answers are longer per example: same token budget, so fewer steps
    human = read_examples(str(human_train), "conversations", tok, args.max_len)
    human_mean = sum(sum(ex.assistant_mask[1:]) for ex in human) / len(human)
    human_steps = max(10, round(budget / (args.batch * human_mean)))
    lr = f"optim.lr={args.lr}"
    v8k = f"draft_vocab={vdir}"
    kl_ref = work / "runs" / "kl-target [0,1,2,29] v8k" / "draft"
    configs = {  # in order of importance: a cut-short run still has the main comparisons
        "generic-ce-human [0,1,2,29] v8k": ["layers=0,1,2,29", v8k, "loss.kind=ce", "teacher.mode=none", lr,
                                            f"data.path={human_train}", "data.kind=conversations",
                                            f"optim.max_steps={human_steps}", f"optim.warmup_steps={max(2, human_steps // 5)}",
                                            f"eval_every={max(5, human_steps // 2)}", f"checkpoint_every={max(5, human_steps // 4)}"],
        "kl-target [0,1,2,29] v8k": ["layers=0,1,2,29", v8k, *kl, lr],
        "kl-target first:6 v8k": ["layers=first:6", v8k, *kl, lr],
        "kl-target [0,1,2,29] full": ["layers=0,1,2,29", "draft_vocab=null", *kl, lr],
        "kl-target evenly:4 v8k": ["layers=evenly:4", v8k, *kl, lr],
        "ce-target [0,1,2,29] v8k": ["layers=0,1,2,29", v8k, "loss.kind=ce", "teacher.mode=none", lr,
                                     f"data.path={gen_train}", f"optim.max_steps={steps}"],
        "kl-target [0,1,2,29] v8k lr3e-3": ["layers=0,1,2,29", v8k, *kl, "optim.lr=3e-3"],
        "tv-target [0,1,2,29] v8k": ["layers=0,1,2,29", v8k, *kl, lr, "loss.kind=tv"],
        "kl-target [0,1,2,29] v8k top4": ["layers=0,1,2,29", v8k, *kl, lr, "loss.top_k=4"],
        "kl-target [0,1,2,29] v8k adaspec0.5": ["layers=0,1,2,29", v8k, *kl, lr, "loss.selective_keep=0.5",
                                                f"loss.selective_reference={kl_ref}"],
    }
    # temperature: the recorded cache is at T=1; T=2 needs one teacher-forced target pass over the answers
    t2_dir = work / "teacher_cache_T2"
    if not args.only or "T2" in args.only:
        from specdistill.distill.features import build_cache

        log("teacher cache at T=2 (one target pass over the training answers)")
        build_cache(target.model, read_examples(str(gen_train), "generated", tok, args.max_len), t2_dir,
                    fingerprint=target.fingerprint, k=args.top_k, temperature=2.0, draft_vocab=vocab)
    configs["kl-target [0,1,2,29] v8k T2"] = ["layers=0,1,2,29", v8k, "teacher.mode=cache", f"teacher.cache_dir={t2_dir}",
                                               f"data.path={gen_train}", f"optim.max_steps={steps}", lr,
                                               "loss.temperature=2.0"]
    if args.long_minutes:
        configs[LONG] = long_config(args, work, state, vocab, v8k)
    only = set(args.only.split("|")) if args.only else None
    rows = []
    costs: dict[tuple, float] = {}
    results_path = work / "results.json"
    for name, overrides in configs.items():
        if only and name not in only:
            continue
        try:
            result = run_config(work, name, [*common, *overrides])
        except Exception as exc:  # one broken configuration must not cost the others their budget
            log(f"run {name} FAILED: {type(exc).__name__}: {exc}")
            continue
        layers = next(o.split("=", 1)[1] for o in overrides if o.startswith("layers="))
        full = "draft_vocab=null" in overrides
        key = (layers, full)
        if key not in costs:
            costs[key] = cost_ratio(target, layers, None if full else vocab)
        rows.append({"name": name, "c": costs[key], **{k: v for k, v in result.items() if k != "draft_dir"}})
        results_path.write_text(json.dumps({"coverage": coverage, "rows": rows}, indent=2, default=str))
        print_table(rows, coverage)
    return rows


LONG = "kl-target first:6 v8k lr3e-3 long"


def long_config(args, work: Path, state: dict, vocab, v8k: str) -> list[str]:
    """The best shape and settings of the comparison (first:6, KL on the target's answers, lr 3e-3),
    trained for --long-minutes on every training answer there is, evaluated along the way."""
    answers = state["answers"]
    ids = [p["id"] for p in state["split"]["train"] + state["extra"] if p["id"] in answers]
    data = write_jsonl(work / f"train_generated_long{len(ids)}.jsonl", [answers[i] for i in ids])
    steps = args.long_steps
    return ["layers=first:6", v8k, "teacher.mode=cache", f"teacher.cache_dir={work / 'teacher_cache'}",
            f"data.path={data}", "optim.lr=3e-3", f"optim.batch_size={args.batch}", f"optim.max_steps={steps}",
            "optim.max_tokens=null", f"optim.max_minutes={args.long_minutes}", f"optim.warmup_steps={max(2, steps // 20)}",
            f"eval_every={max(5, steps // 24)}", f"checkpoint_every={max(5, steps // 24)}", f"threads={args.long_threads}"]


def print_table(rows: list[dict], coverage: float) -> None:
    print("\nheld-out: greedy top-1 agreement with the target's continuation (acceptance α) and expected τ(γ=4)")
    print(f"draft vocabulary coverage of held-out target tokens: {coverage:.3f}")
    head = f"{'config':40} {'c':>6} {'steps':>6} {'tokens':>7} {'cpu-min':>7} {'α start':>8} {'α end':>7} {'τ(4)':>6} {'ideal x':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        curve = r["curve"]
        a0, a1 = curve[0]["acceptance"], curve[-1]["acceptance"]
        tau = curve[-1]["tau"]
        ideal = tau / (4 * r["c"] + 1)
        print(f"{r['name']:40} {r['c']:6.3f} {r['steps']:6d} {r['tokens']:7d} {r['train_minutes']:7.1f} "
              f"{a0:8.3f} {a1:7.3f} {tau:6.2f} {ideal:7.2f}")
    print("\ncurves (tokens: acceptance)")
    for r in rows:
        pts = "  ".join(f"{p['tokens']}:{p['acceptance']:.3f}" for p in r["curve"])
        print(f"{r['name']:40} {pts}")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=str(REPO / ".specdistill" / "bench" / "distill_budget"))
    parser.add_argument("--phase", choices=["prepare", "all"], default="all")
    parser.add_argument("--train-prompts", type=int, default=200)
    parser.add_argument("--heldout-prompts", type=int, default=40)
    parser.add_argument("--max-prompt-tokens", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gen-batch", type=int, default=20)
    parser.add_argument("--scan", type=int, default=4000)
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the 2 cores are shared)")
    parser.add_argument("--vocab", type=int, default=8192, help="reduced draft vocabulary size")
    parser.add_argument("--tokens", type=int, default=20000, help="training budget: assistant tokens per config")
    parser.add_argument("--minutes", type=float, default=5.0, help="training-time cap per config")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-len", type=int, default=384)
    parser.add_argument("--only", default=None, help="run only these configs ('|'-separated names)")
    parser.add_argument("--extra-train-prompts", type=int, default=0, help="more training prompts for the long run")
    parser.add_argument("--extra-scan", type=int, default=8000, help="records after --scan searched for them")
    parser.add_argument("--no-generate", action="store_true", help="train on the answers already generated")
    parser.add_argument("--long-minutes", type=float, default=0.0, help="also run the long configuration this long")
    parser.add_argument("--long-steps", type=int, default=1500, help="the long run's schedule length (cosine to its end)")
    parser.add_argument("--long-threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    state = prepare(args)
    if args.phase == "prepare":
        return
    train_all(args, state)


if __name__ == "__main__":
    main()
