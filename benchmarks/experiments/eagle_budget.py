"""EAGLE-3 head against the layer-extracted draft at equal CPU minutes and equal unique data.

    python benchmarks/experiments/eagle_budget.py [--work DIR] [--minutes 2,5,15] [--phase prepare|all]

Phases (each cached in --work, so a rerun or a resume after a kill never redoes them):
  1. prompts: first-turn ShareGPT prompts, shuffled once, split into train and held-out (disjoint).
  2. target answers: the bf16 target answers every prompt greedily (batched, resumable); the top-k
     log-probs it produced on the way are the offline teacher cache, and the inputs of the head's three
     feature layers it saw on the way are the feature cache of the first --prompt-contexts entry.
  3. features: other prompt contexts (and answers reused from elsewhere) get one teacher-forced bf16
     target pass over the answers.
  4. one training run per kind and CPU-minute budget (both kinds on the same answers, the same 8k
     draft vocabulary and the same held-out answers), plus EAGLE-3 runs on fewer unique answers.
  5. costs: c of the layer draft (measure_cost_ratio) and of one EAGLE-3 drafting step (fc +
     midlayer + 8k head) against one target decode step, bf16, interleaved medians.
Prints the table; writes results.json in --work.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import zlib
from collections import Counter
from pathlib import Path

import torch

import specdistill  # noqa: F401  (offline environment)
from benchmarks.experiments.distill_budget import log, run_config, select_prompts, write_jsonl
from specdistill.data.prompts import Prompt
from specdistill.distill.examples import read_examples
from specdistill.distill.features import FeatureCache, build_feature_cache
from specdistill.distill.teacher import TeacherCache
from specdistill.modeling.eagle3 import default_aux_layers
from specdistill.modeling.eagle3_files import DRAFT_MODEL, kind_name
from specdistill.modeling.models import load_model
from specdistill.modeling.vocab import DraftVocab, build_draft_vocab
from specdistill.pipeline.stages.answers.harness import generate_answers

REPO = Path(__file__).resolve().parents[2]


def prepare(args) -> dict:
    """Training and held-out target answers with their top-k teacher rows, the draft vocabulary, the features."""
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    target = load_model("demo", dtype="bfloat16")
    tok = target.tokenizer
    train_path, heldout_path = work / "train_generated.jsonl", work / "heldout_generated.jsonl"
    if args.reuse:
        reuse_answers(Path(args.reuse), work, args.heldout_prompts)
    elif not train_path.is_file():
        split_path = work / "split.json"
        if split_path.is_file():
            split = json.loads(split_path.read_text())
        else:
            train, heldout = select_prompts(tok, args.train_prompts, args.heldout_prompts, args.max_prompt_tokens, args.scan)
            split = {"train": train, "heldout": heldout}
            split_path.write_text(json.dumps(split, ensure_ascii=False))
        cache = TeacherCache.create(work / "teacher_cache", fingerprint=target.fingerprint, k=args.top_k,
                                    temperature=1.0, vocab="full", data="generated-bf16")
        first = args.prompt_contexts[0]  # the answer pass records this context's features; others get a feature pass
        features = FeatureCache.create(work / f"features-ctx{first}", fingerprint=target.fingerprint,
                                       layers=feature_layers(target), data="generated-bf16",
                                       prompt_context=None if first == "all" else int(first))
        prompts = [Prompt(id=p["id"], messages=p["prompt"]) for p in split["heldout"] + split["train"]]
        answers = generate_answers(target.model, tok, prompts, work / "target_answers.jsonl", batch_size=args.gen_batch,
                                   max_new_tokens=args.max_new_tokens, teacher_cache=cache, feature_cache=features)
        write_jsonl(train_path, [answers[p["id"]] for p in split["train"]])
        write_jsonl(heldout_path, [answers[p["id"]] for p in split["heldout"]])
    train = read_examples(str(train_path), "generated", tok, args.max_len)
    heldout = read_examples(str(heldout_path), "generated", tok, args.max_len)
    answer_tokens = sum(sum(ex.assistant_mask) for ex in train)
    log(f"answers: {len(train)} train ({answer_tokens} answer tokens), {len(heldout)} held-out "
        f"({sum(sum(ex.assistant_mask) for ex in heldout)} answer tokens)")

    vdir = work / f"vocab{args.vocab}"
    if not (vdir / "draft_vocab.safetensors").is_file():
        counts: Counter = Counter()
        for ex in train:  # the target's answer tokens first, then the training prompts' tokens
            counts.update({t: 1000 * c for t, c in Counter(t for t, m in zip(ex.input_ids, ex.assistant_mask) if m).items()})
            counts.update(t for t, m in zip(ex.input_ids, ex.assistant_mask) if not m)
        vdir.mkdir(parents=True, exist_ok=True)
        build_draft_vocab(counts, args.vocab, len(tok), [tok.eos_token_id]).save(vdir)
    vocab = DraftVocab.load(vdir)
    kept = vocab.t2d
    held_tokens = torch.tensor([t for ex in heldout for t, m in zip(ex.input_ids, ex.assistant_mask) if m])
    coverage = float(kept[held_tokens].float().mean())

    features = {}
    for context in args.prompt_contexts:
        fdir = work / f"features-ctx{context}"
        t0 = time.process_time()
        cache = build_feature_cache(target.model, train + heldout, fdir, fingerprint=target.fingerprint,
                                    layers=feature_layers(target), prompt_context=None if context == "all" else int(context),
                                    max_bytes=args.feature_max_gb * 1e9, extend=True)
        positions = sum(c["features"].shape[0] for c in cache.load_all().values())
        features[context] = {"dir": str(fdir), "positions": positions, "disk_bytes": cache.disk_bytes(),
                             "bytes_per_position": cache.disk_bytes() / positions,
                             "bytes_per_answer_token": cache.disk_bytes() / (answer_tokens + sum(sum(ex.assistant_mask) for ex in heldout)),
                             "build_cpu_s": time.process_time() - t0}
        log(f"features (prompt context {context}): {positions} positions, {cache.disk_bytes() / 1e6:.1f} MB, "
            f"{features[context]['bytes_per_position']:.0f} B/position, "
            f"{features[context]['bytes_per_answer_token']:.0f} B/answer token")
    return {"target": target, "train": train_path, "heldout": heldout_path, "vocab_dir": vdir, "vocab": vocab,
            "coverage": coverage, "answer_tokens": answer_tokens, "n_train": len(train), "features": features}


def feature_layers(target) -> list[int]:
    return default_aux_layers(target.config.num_hidden_layers)


def reuse_answers(source: Path, work: Path, n_heldout: int) -> None:
    """Target answers from an earlier run (train_generated.jsonl, eval_generated.jsonl, teacher_cache/):
    the held-out side is its eval answers plus the last training answers up to `n_heldout`."""
    train_path, heldout_path = work / "train_generated.jsonl", work / "heldout_generated.jsonl"
    if train_path.is_file():
        return
    train = (source / "train_generated.jsonl").read_text().splitlines()
    heldout = (source / "eval_generated.jsonl").read_text().splitlines()
    move = max(0, n_heldout - len(heldout))
    heldout, train = heldout + train[len(train) - move:], train[: len(train) - move]
    if not (work / "teacher_cache").exists():
        shutil.copytree(source / "teacher_cache", work / "teacher_cache")
    heldout_path.write_text("".join(line + "\n" for line in heldout))
    train_path.write_text("".join(line + "\n" for line in train))
    (work / "source.json").write_text(json.dumps({"reused": str(source), "train": len(train), "heldout": len(heldout)}))


# --------------------------------------------------------------------------------------------
# Training runs


def run_specs(args, state: dict) -> dict[str, list[str]]:
    """Every configuration by name: both kinds at each CPU-minute budget, then the EAGLE-3 ablations
    (unroll length, prompt context, fewer unique answers)."""
    work = Path(args.work)
    common = ["target=demo", f"data.path={state['train']}", f"data.heldout_path={state['heldout']}",
              f"data.heldout_limit={args.heldout_prompts}", f"data.max_len={args.max_len}", f"optim.batch_size={args.batch}",
              "optim.max_steps=100000", "optim.max_tokens=null", "optim.clock=cpu", f"threads={args.threads}",
              "teacher.mode=cache", f"teacher.cache_dir={work / 'teacher_cache'}", f"draft_vocab={state['vocab_dir']}"]
    specs = {}
    for minutes in args.minutes:
        def timed(steps_per_minute: float, minutes: float = minutes) -> list[str]:
            steps = max(10, int(steps_per_minute * minutes))
            return [f"optim.max_minutes={minutes}", f"optim.warmup_steps={max(5, steps // 20)}",
                    f"eval_every={max(5, steps // 6)}", f"checkpoint_every={max(5, steps // 6)}"]

        specs[f"layers {minutes}m"] = [*common, "kind=draft_model", "layers=0,1,2,29", f"optim.lr={args.lr_layers}",
                                       *timed(args.layer_steps_per_minute)]
        eagle = [*common, "kind=eagle3", f"optim.lr={args.lr_eagle}", *timed(args.eagle_steps_per_minute)]
        ctx = args.prompt_contexts[0]
        feature = lambda c: [f"eagle3.feature_dir={state['features'][c]['dir']}",  # noqa: E731
                             f"eagle3.prompt_context={'null' if c == 'all' else c}"]
        specs[f"eagle3 {minutes}m"] = [*eagle, f"eagle3.steps={args.steps}", *feature(ctx)]
        if minutes != args.ablate_minutes:
            continue
        for steps in args.ablate_steps:
            specs[f"eagle3 {minutes}m steps{steps}"] = [*eagle, f"eagle3.steps={steps}", *feature(ctx)]
        for c in args.prompt_contexts[1:]:  # evaluated on the first context's held-out features (the whole prompt)
            specs[f"eagle3 {minutes}m ctx{c}"] = [*eagle, f"eagle3.steps={args.steps}", *feature(c),
                                                  f"eagle3.heldout_feature_dir={state['features'][ctx]['dir']}"]
            specs[f"eagle3 {minutes}m steps1 ctx{c}"] = [*eagle, "eagle3.steps=1", *feature(c),
                                                         f"eagle3.heldout_feature_dir={state['features'][ctx]['dir']}"]
        for lr in args.ablate_lr:
            specs[f"eagle3 {minutes}m lr{lr:g}"] = [*eagle, f"eagle3.steps={args.steps}", *feature(ctx), f"optim.lr={lr}"]
        for n in args.data_limits:
            specs[f"eagle3 {minutes}m data{n}"] = [*eagle, f"eagle3.steps={args.steps}", *feature(ctx), f"data.limit={n}"]
    return specs


def run(work: Path, name: str, overrides: list[str]) -> dict:
    out = work / "runs" / name
    load = Path("/proc/loadavg").read_text().split()[:3]
    result = run_config(work, name, overrides)
    if "load" not in result:
        result["load"] = {"start": load, "end": Path("/proc/loadavg").read_text().split()[:3]}
        (out / "result.json").write_text(json.dumps(result, indent=2, default=str))
    return result


# --------------------------------------------------------------------------------------------
# Costs


@torch.inference_mode()
def eagle_cost_ratio(target, vocab, context: int = 64, repeats: int = 15) -> dict:
    """c of one EAGLE-3 drafting step (fc + midlayer + 8k head, head KV cache of `context` entries)
    against one target decode step (KV cache of `context` tokens), bf16, interleaved medians."""
    from transformers import DynamicCache

    from specdistill.modeling.eagle3 import Eagle3Cache
    from specdistill.modeling.eagle3_init import init_eagle3_from_target

    model = target.model
    head = init_eagle3_from_target(model, vocab).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, context))
    step = torch.randint(0, model.config.vocab_size, (1, 1))
    width = 3 * model.config.hidden_size
    feats = torch.randn(1, context, width, dtype=model.dtype)
    feat1 = torch.randn(1, 1, width, dtype=model.dtype)
    t_cache = DynamicCache(config=model.config)
    model(input_ids=ids, past_key_values=t_cache, use_cache=True)
    h_cache = Eagle3Cache()
    head(ids, head.project(feats), torch.arange(context)[None], h_cache)

    def target_step():
        extra = t_cache.get_seq_length() - context
        if extra:
            t_cache.crop(-extra)
        model(input_ids=step, past_key_values=t_cache, use_cache=True, logits_to_keep=1)

    def head_step():
        h_cache.crop(context)
        hidden = head(step, head.project(feat1), torch.tensor([[context]]), h_cache)
        head.logits(hidden[:, -1])

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    for _ in range(3):
        timed(target_step), timed(head_step)
    t_ms, h_ms, ratios = [], [], []
    for _ in range(repeats):
        t, h = timed(target_step), timed(head_step)
        t_ms.append(t * 1e3)
        h_ms.append(h * 1e3)
        ratios.append(h / t)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"c": med(ratios), "head_ms": med(h_ms), "target_ms": med(t_ms), "dtype": str(model.dtype)}


def costs(target, vocab) -> dict:
    from specdistill.modeling.drafts import init_draft_from_target, measure_cost_ratio

    layer_draft = init_draft_from_target(target.model, [0, 1, 2, 29])
    return {"draft_model": {"c": measure_cost_ratio(target.model, layer_draft, draft_vocab=vocab, repeats=15),
                            "dtype": str(target.model.dtype)},
            "eagle3": eagle_cost_ratio(target, vocab)}


# --------------------------------------------------------------------------------------------
# Report


def row_of(name: str, result: dict, c: float) -> dict:
    last = result["curve"][-1]
    gamma = 4
    tau_chain = last.get(f"tau_chain_{gamma}")
    chain = last.get("accepted_per_position")  # measured chained acceptance (eagle3); i.i.d. powers of α (draft_model)
    chain = chain or [last["acceptance"] ** i for i in range(1, gamma + 1)]
    by_gamma = {g: (1 + sum(chain[:g])) / (g * c + 1) for g in range(1, min(gamma, len(chain)) + 1)}
    best = max(by_gamma, key=by_gamma.get)
    return {"name": name, "kind": kind_name(result.get("kind", DRAFT_MODEL)), "cpu_minutes": result["train_minutes"],
            "best_gamma": best, "best_ideal_speedup": by_gamma[best],
            "steps": result["steps"], "tokens": result["tokens"],
            "tokens_per_cpu_s": result["tokens"] / max(60 * result["train_minutes"], 1e-9),
            "alpha_start": result["curve"][0]["acceptance"], "alpha": last["acceptance"],
            "alpha_per_position": last.get("acceptance_per_position", [last["acceptance"]]),
            "accepted_per_position": last.get("accepted_per_position"),
            "tau_iid": last["tau"], "tau_chain": tau_chain, "c": c,
            "ideal_speedup": (tau_chain or last["tau"]) / (gamma * c + 1), "load": result.get("load"),
            "curve": [{k: p.get(k) for k in ("tokens", "minutes", "acceptance", "acceptance_per_position")}
                      for p in result["curve"]]}


def print_table(rows: list[dict], meta: dict) -> None:
    print("\nheld-out: top-1 agreement with the target's greedy continuation; τ(γ=4): i.i.d. from α "
          "(layers), chained per-position acceptance (eagle3); CPU minutes = process CPU time (1 thread)")
    print(f"draft vocabulary coverage of held-out answer tokens: {meta['coverage']:.3f}; "
          f"unique training answer tokens: {meta['answer_tokens']}")
    head = (f"{'config':28} {'cpu-min':>7} {'tok/cpu-s':>9} {'epochs':>6} {'α0':>6} {'α@1':>6} {'α@2':>6} {'α@3':>6} "
            f"{'α@4':>6} {'τ(4)':>5} {'c':>6} {'ideal x':>7} {'best γ: x':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        per = r["alpha_per_position"] + [float("nan")] * 4
        print(f"{r['name']:28} {r['cpu_minutes']:7.2f} {r['tokens_per_cpu_s']:9.0f} "
              f"{r['tokens'] / meta['answer_tokens']:6.1f} {r['alpha_start']:6.3f} "
              + " ".join(f"{a:6.3f}" for a in per[:4])
              + f" {r['tau_chain'] or r['tau_iid']:5.2f} {r['c']:6.3f} {r['ideal_speedup']:7.2f}"
              + f" {r['best_gamma']:>3}: {r['best_ideal_speedup']:4.2f}")
    print("\ncurves (CPU minutes: α at position 1)")
    for r in rows:
        print(f"{r['name']:28} " + "  ".join(f"{p['minutes']:.1f}:{p['acceptance']:.3f}" for p in r["curve"]))
    sys.stdout.flush()


def report(work: Path, specs: dict, cost: dict, meta: dict) -> None:
    """Every finished run (result.json), in the configurations' order, into results.json; unfinished
    runs are listed with how far they got."""
    rows, partial = [], []
    for name in specs:
        out = work / "runs" / name
        if (out / "result.json").is_file():
            result = json.loads((out / "result.json").read_text())
            rows.append(row_of(name, result, cost["eagle3" if result.get("kind") == "eagle3" else DRAFT_MODEL]["c"]))
        elif (out / "metrics.jsonl").is_file():
            curve = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            partial.append({"name": name, "curve": curve})
    print_table(rows, meta)
    for p in partial:
        last = p["curve"][-1]
        print(f"unfinished: {p['name']:28} at {last['minutes']:.2f} CPU-min: α {last['acceptance']:.3f} "
              f"{last.get('acceptance_per_position', '')}")
    (work / "results.json").write_text(json.dumps({**meta, "rows": rows, "unfinished": partial}, indent=2, default=str))
    log(f"wrote {work / 'results.json'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=str(REPO / ".specdistill" / "bench" / "eagle_budget"))
    parser.add_argument("--phase", choices=["prepare", "costs", "all", "report"], default="all",
                        help="report: collect every finished run in --work into results.json and print the table")
    parser.add_argument("--reuse", default=None, help="a directory of earlier target answers and their teacher cache")
    parser.add_argument("--train-prompts", type=int, default=200)
    parser.add_argument("--heldout-prompts", type=int, default=40)
    parser.add_argument("--max-prompt-tokens", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gen-batch", type=int, default=16)
    parser.add_argument("--scan", type=int, default=4000)
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--max-len", type=int, default=384)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (the 2 cores are shared)")
    parser.add_argument("--minutes", default="2,5,15", help="CPU-minute budgets")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr-layers", type=float, default=3e-3)
    parser.add_argument("--lr-eagle", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=2, help="the EAGLE-3 unroll length of the main rows")
    parser.add_argument("--ablate-steps", default="", help="other unroll lengths to run (comma-separated)")
    parser.add_argument("--prompt-contexts", default="all", help="feature caches: prompt positions kept ('all' or N)")
    parser.add_argument("--data-limits", default="", help="EAGLE-3 runs on the first N training answers")
    parser.add_argument("--ablate-lr", default="", help="other EAGLE-3 learning rates to run (comma-separated)")
    parser.add_argument("--ablate-minutes", type=float, default=2, help="the budget the ablations run at")
    parser.add_argument("--feature-max-gb", type=float, default=5.0)
    parser.add_argument("--layer-steps-per-minute", type=float, default=30.0, help="for eval/checkpoint spacing")
    parser.add_argument("--eagle-steps-per-minute", type=float, default=60.0)
    parser.add_argument("--only", default=None, help="run only these configs ('|'-separated names)")
    args = parser.parse_args()
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    args.minutes = [float(m) if "." in m else int(m) for m in split(args.minutes)]
    args.ablate_steps = [int(x) for x in split(args.ablate_steps)]
    args.prompt_contexts = split(args.prompt_contexts)
    args.data_limits = [int(x) for x in split(args.data_limits)]
    args.ablate_lr = [float(x) for x in split(args.ablate_lr)]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    state = prepare(args)
    if args.phase == "prepare":
        return
    work = Path(args.work)
    cost_path = work / "costs.json"
    if not cost_path.is_file():
        cost_path.write_text(json.dumps(costs(state["target"], state["vocab"]), indent=2))
    cost = json.loads(cost_path.read_text())
    if "layers" in cost:  # a costs.json written before: the layer draft's cost under its old name
        cost[DRAFT_MODEL] = cost.pop("layers")
    log(f"c (bf16, interleaved medians): draft_model {cost[DRAFT_MODEL]['c']:.3f}, eagle3 {cost['eagle3']['c']:.3f} "
        f"({cost['eagle3']['head_ms']:.2f} ms vs target {cost['eagle3']['target_ms']:.2f} ms)")
    if args.phase == "costs":
        return
    meta = {"coverage": state["coverage"], "answer_tokens": state["answer_tokens"], "n_train": state["n_train"],
            "features": state["features"], "costs": cost}
    specs = run_specs(args, state)
    if args.phase == "report":
        report(work, specs, cost, meta)
        return
    only = args.only.split("|") if args.only else None
    rows = []
    for name in only or list(specs):  # --only: in the order given
        overrides = specs.get(name)
        if overrides is None:
            log(f"no configuration named {name!r}")
            continue
        try:
            result = run(work, name, overrides)
        except Exception as exc:  # one broken configuration must not cost the others their budget
            log(f"run {name} FAILED: {type(exc).__name__}: {exc}")
            continue
        rows.append(row_of(name, result, cost["eagle3" if result.get("kind") == "eagle3" else DRAFT_MODEL]["c"]))
        print_table(rows, meta)
    if rows:
        results = work / (f"results-{zlib.crc32(args.only.encode()):08x}.json" if only else "results.json")
        results.write_text(json.dumps({**meta, "rows": rows}, indent=2, default=str))
        log(f"wrote {results}")


if __name__ == "__main__":
    main()
