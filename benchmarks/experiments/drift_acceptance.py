"""The drift scenario in numbers: is the updated target still a good model, does the champion's
acceptance fall below the red line against it, and does incremental distillation bring it back?

    OMP_NUM_THREADS=1 python benchmarks/experiments/drift_acceptance.py [--work DIR] [--steps N] [--lr LR]
        [--drafts 0-13+16-29] [--recover-steps 30]

1. The target update (`specdistill.ops.demo_update.make_target_update`, cached in --work per steps and lr).
2. Fluency: the next-token loss of the target before and after the update on the answers of
   held-out ShareGPT chat (`--heldout` conversations the update never saw; `ops.demo_update.assistant_loss`).
3. Acceptance of a strong "before" draft (the champion: target layers, `init_draft_from_target`,
   untrained) on 5 HumanEval prompts (every 8th of the first 40) + 5 ShareGPT first turns (9 to 200
   prompt tokens), greedy, γ=4: against the original target, and against the updated target through
   a transplanted copy (the updated target has more tokens than the draft).
4. Recovery (`--recover-steps` > 0): the monitor's incremental distillation in small: the updated
   target answers train prompts disjoint from the measured ones (HumanEval problems 40.. and ShareGPT
   first turns after the measured ones), the transplanted champion is warm-started on them (forward
   KL on the recorded teacher, the nightly's incremental lr), and its acceptance is measured again.

Prints one table and writes results-<steps>-<lr>.json in --work.
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
    from specdistill.speculative.harness_bench import encode_prompt

    code = humaneval_prompts()[0:40:8][:n_code]
    chat = sharegpt_first_turns(n_chat, tokenizer=tokenizer, min_tokens=9, max_tokens=max_tokens)
    return [("code", encode_prompt(tokenizer, text)) for text in code] + [("chat", encode_prompt(tokenizer, t.text)) for t in chat]


def heldout_chats(tokenizer, n: int, skip: int = 2000) -> list[list[dict]]:
    """ShareGPT first turns with their answers, from far past the measured prompts (the update
    trains on HumanEval only: every ShareGPT conversation is held out from it)."""
    from specdistill.data.datasets import sharegpt_first_turns

    turns = sharegpt_first_turns(n, skip=skip, tokenizer=tokenizer, min_tokens=9, max_tokens=200, answered=True,
                                 min_chars=20)
    return [t.messages + [{"role": "assistant", "content": t.answer}] for t in turns]


def measure(target, drafter, prompt_set, gamma: int, max_new_tokens: int) -> dict:
    from specdistill.speculative import SpecStats, generate

    stats = {"code": [], "chat": []}
    for kind, ids in prompt_set:
        stats[kind].append(generate(target.model, ids, max_new_tokens=max_new_tokens, drafter=drafter, gamma=gamma).stats)
    out = {}
    for kind, rows in [("all", stats["code"] + stats["chat"]), ("code", stats["code"]), ("chat", stats["chat"])]:
        t = SpecStats.total(rows).counts
        out[kind] = {"alpha": round(t.acceptance_rate or 0.0, 3), "tau": round(t.accepted_length or 1.0, 3),
                     "proposed": t.proposed}
    return out


def cached(path: Path, compute):
    if path.is_file():
        return json.loads(path.read_text())
    value = compute()
    path.write_text(json.dumps(value, indent=2))
    return value


def recover(work: Path, updated_dir: Path, draft_dir: Path, dtype: str, steps: int, minutes: float,
            n_code: int, n_chat: int) -> Path:
    """The transplanted champion warm-started on the updated target's answers; returns the new draft's directory."""
    from specdistill.data.datasets import humaneval_prompts, sharegpt_first_turns
    from specdistill.data.prompts import Prompt
    from specdistill.distill.distill_recipe import DataConfig, DistillConfig, LossConfig, OptimConfig, TeacherConfig
    from specdistill.distill.teacher import TeacherCache
    from specdistill.distill.train import distill
    from specdistill.modeling.drafts import align_draft, save_draft
    from specdistill.modeling.models import load_model
    from specdistill.modeling.vocab import DraftVocab
    from specdistill.pipeline.nightly_recipe import NightlyTrain
    from specdistill.pipeline.stages.answers.harness import generate_answers

    out = work / f"recovered-{updated_dir.name}-{draft_dir.name}-{steps}"
    if (out / "draft" / "config.json").is_file():
        return out / "draft"
    target = load_model(updated_dir, dtype=dtype)
    code = humaneval_prompts()[40:40 + n_code]
    chat = sharegpt_first_turns(n_chat, skip=200, tokenizer=target.tokenizer, min_tokens=9, max_tokens=200)
    train = ([Prompt(id=f"code-{i}", messages=[{"role": "user", "content": text}]) for i, text in enumerate(code)]
             + [Prompt(id=f"chat-{i}", messages=t.messages) for i, t in enumerate(chat)])
    data_dir = work / f"answers-{updated_dir.name}"
    cache = TeacherCache.create(data_dir / "teacher_cache", fingerprint=target.fingerprint, k=32, temperature=1.0,
                                vocab="full", data=f"drift-bench-{n_code}-{n_chat}-{dtype}")
    generate_answers(target.model, target.tokenizer, train, data_dir / "train_generated.jsonl", batch_size=8,
                     max_new_tokens=96, teacher_cache=cache)
    draft = load_model(draft_dir, dtype="float32")  # its weights are trained further
    aligned = align_draft(draft.model, draft.tokenizer, target.tokenizer, DraftVocab.load(draft_dir),
                          target_vocab_size=target.config.vocab_size, copy_model=False)
    warm = save_draft(aligned.model, target.tokenizer, work / f"aligned-{updated_dir.name}-{draft_dir.name}",
                      draft_vocab=aligned.draft_vocab, meta={"transplanted_from": str(draft_dir)})
    distill(DistillConfig(
        target=str(updated_dir), draft=str(warm), draft_vocab=None,
        data=DataConfig(path=str(data_dir / "train_generated.jsonl"), kind="generated"),
        loss=LossConfig(kind="fkl"), teacher=TeacherConfig(mode="cache", cache_dir=str(cache.dir)),
        optim=OptimConfig(lr=NightlyTrain().incremental_lr, batch_size=4, max_steps=steps, max_minutes=minutes,
                          warmup_steps=min(20, steps // 10)),
        out_dir=str(out), checkpoint_every=max(10, steps), eval_every=max(10, steps), threads=1))
    return out / "draft"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default=".specdistill/bench-drift")
    parser.add_argument("--steps", type=int, default=None, help="update steps (default: make_target_update's)")
    parser.add_argument("--lr", type=float, default=None, help="update learning rate (default: make_target_update's)")
    parser.add_argument("--drafts", default="0-13+16-29", help="the champion(s): target layers; "
                        "0-13+16-29 (without 14, 15) is tests/test_monitor_flow.py's")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="auto", help="the models' dtype for acceptance (the monitor's: auto)")
    parser.add_argument("--heldout", type=int, default=24, help="held-out ShareGPT conversations for the chat loss")
    parser.add_argument("--recover-steps", type=int, default=0, help="incremental distillation steps (0: skip)")
    parser.add_argument("--recover-minutes", type=float, default=4.0)
    parser.add_argument("--recover-prompts", default="24,8", help="train prompts for recovery: CODE,CHAT")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from specdistill.modeling.drafts import init_draft_from_target, parse_layers, save_draft
    from specdistill.modeling.models import dtype_name, load_model, resolve_dtype
    from specdistill.ops.demo_update import TargetUpdateConfig, assistant_loss, make_target_update
    from specdistill.speculative import ModelDrafter, generate
    from specdistill.speculative.specs import DrafterSpec

    defaults = TargetUpdateConfig()
    steps = args.steps if args.steps is not None else defaults.steps
    lr = args.lr if args.lr is not None else defaults.lr
    dtype = dtype_name(resolve_dtype(args.dtype))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    updated_dir = work / f"target-update-{steps}-{lr:g}"
    if not (updated_dir / "config.json").is_file():
        t0 = time.time()
        make_target_update("demo", updated_dir, steps=steps, lr=lr)
        print(f"target update ({steps} steps, lr {lr:g}) made in {time.time() - t0:.0f} s", file=sys.stderr)

    base32 = load_model("demo", dtype="float32")
    chats = heldout_chats(base32.tokenizer, args.heldout)
    loss_before = cached(work / f"heldout-loss-base-{args.heldout}.json",
                         lambda: {"loss": assistant_loss(base32.model, base32.tokenizer, chats)})["loss"]
    upd32 = load_model(updated_dir, dtype="float32")
    loss_after = assistant_loss(upd32.model, upd32.tokenizer, chats)
    update_losses = json.loads((updated_dir / "specdistill_target_update.json").read_text())["losses"]
    del upd32

    base = load_model("demo", dtype=dtype)
    updated = load_model(updated_dir, dtype=dtype)

    def carried(draft_dir: Path):
        """The draft on the updated target as the monitor replays it, and why it was transplanted ("": it was not)."""
        draft = DrafterSpec.for_draft(draft_dir)
        return draft.of.carry(updated.model, draft, updated.tokenizer)

    prompt_set = prompts(base.tokenizer)
    results = {"steps": steps, "lr": lr, "dtype": dtype, "gamma": args.gamma, "max_new_tokens": args.max_new_tokens,
               "prompts": {"code": sum(k == "code" for k, _ in prompt_set), "chat": sum(k == "chat" for k, _ in prompt_set)},
               "update_train_loss": [update_losses[0], update_losses[-1]],
               "heldout_chat_loss": {"before": round(loss_before, 4), "after": round(loss_after, 4),
                                     "conversations": len(chats)},
               "drafts": {}}
    n = base.config.num_hidden_layers
    for spec in args.drafts.split(","):
        if "-" in spec:  # ranges joined by '+': 0-12+17-29 skips layers 13..16
            layers = [i for part in spec.split("+") for i in range(int(part.split("-")[0]), int(part.split("-")[1]) + 1)]
        else:
            layers = parse_layers(spec, n)
        ddir = work / f"draft-{spec.replace(':', '')}"
        if not (ddir / "config.json").is_file():
            save_draft(init_draft_from_target(base32.model, layers), base32.tokenizer, ddir, meta={"layers": layers})
        before = cached(work / f"before-{ddir.name}-{dtype}-{args.gamma}-{args.max_new_tokens}.json",
                        lambda d=ddir: measure(base, ModelDrafter(load_model(d, dtype=dtype).model, base.config.vocab_size),
                                        prompt_set, args.gamma, args.max_new_tokens))
        drafter, why = carried(ddir)
        after = measure(updated, drafter, prompt_set, args.gamma, args.max_new_tokens)
        row = {"layers": len(layers), "before": before, "after": after, "transplanted": bool(why)}
        if args.recover_steps:
            t0 = time.time()
            code_n, chat_n = (int(x) for x in args.recover_prompts.split(","))
            rdir = recover(work, updated_dir, ddir, dtype, args.recover_steps, args.recover_minutes, code_n, chat_n)
            drafter, _ = carried(rdir)
            row["recovered"] = measure(updated, drafter, prompt_set, args.gamma, args.max_new_tokens)
            row["recover"] = {"steps": args.recover_steps, "prompts": args.recover_prompts,
                              "seconds": round(time.time() - t0), "draft": str(rdir)}
        results["drafts"][spec] = row

    samples = []
    for kind, ids in [prompt_set[0], prompt_set[-1]]:
        out = generate(updated.model, ids, max_new_tokens=48).output_ids
        samples.append({"kind": kind, "answer": updated.tokenizer.decode(out)})
    results["updated_target_samples"] = samples
    (work / f"results-{steps}-{lr:g}.json").write_text(json.dumps(results, indent=2))

    h = results["heldout_chat_loss"]
    print(f"target update: {steps} steps, lr {lr:g}, train loss {update_losses[0]:.3f} -> {update_losses[-1]:.3f}")
    print(f"held-out chat loss ({h['conversations']} ShareGPT answers, nats/token): before {h['before']:.3f}  "
          f"after {h['after']:.3f}  ({h['after'] - h['before']:+.3f})")
    print(f"{'draft':<12} {'':>9} {'α all':>6} {'α code':>7} {'α chat':>7} {'τ all':>6}   ({dtype}, γ={args.gamma}, "
          f"{args.max_new_tokens} new tokens, {results['prompts']['code']} code + {results['prompts']['chat']} chat prompts)")
    for spec, row in results["drafts"].items():
        for label in ("before", "after", "recovered"):
            if label in row:
                m = row[label]
                print(f"{spec if label == 'before' else '':<12} {label:>9} {m['all']['alpha']:>6.3f} {m['code']['alpha']:>7.3f} "
                      f"{m['chat']['alpha']:>7.3f} {m['all']['tau']:>6.2f}")
        if "recover" in row:
            r = row["recover"]
            print(f"  recovered: {r['steps']} warm-start steps on {r['prompts']} (code,chat) prompts, {r['seconds']} s")
        elif not args.recover_steps:
            print("  recovery not measured (--recover-steps 0)")
    for s in samples:
        print(f"--- updated target, {s['kind']} prompt:\n{s['answer']}", flush=True)


if __name__ == "__main__":
    main()
