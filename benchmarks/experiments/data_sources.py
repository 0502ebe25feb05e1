"""Learning curve by data source: what a CPU-minute of data buys the EAGLE-3 head, on the demo target.

    python benchmarks/experiments/data_sources.py [--work DIR] [--data-minutes 6] [--train-steps 1000] [--only a,c,...]

Sources, each bought with the same --data-minutes of this machine's CPU (rates measured here, side by
side, in phase 2), then the same training (--train-steps, the recipe the nightly uses):
  a   regenerated answers: the target decodes answers (greedy, teacher and features on the way), today.
  b   a (half the minutes) + logged answers of the current target: responses the target already served,
      labelled by one prefill from their text (here --served, an earlier run's greedy answers to other
      prompts: production paid their decoding when it served them), as many as the log holds.
  c   a + other models' responses (ShareGPT's ChatGPT answers) labelled by the target's prefill. Half
      the minutes each.
  c1  other models' responses only, all the minutes at prefill speed.
  d   on-policy contexts (draft-proposed, target-corrected): under lossless greedy verification the draft
      drafts from the target's own text, which a (and b, for sampled traffic) already are; not built, the
      table says why (docs/data.md, "Draft-proposed contexts").
Every arm is scored on the same held-out prompts (never trained on, disjoint by prompt text): the
target's greedy answers, first-position acceptance and chained τ(γ=4) of the head, teacher-forced.

Phases, each cached in --work (a rerun or a resume after a kill never redoes them):
  1. prompts: first-turn ShareGPT prompts with their answers, shuffled once: held-out, then train.
  2. rates: decoding (batch --batch, teacher and features) against labelling by prefill, interleaved.
  3. data: held-out answers; regenerated answers; "logged" target answers; labelled ChatGPT answers.
  4. one training run per arm on its view of the data (symlinks, no copies).
Prints the table; writes results.json in --work.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import specdistill  # noqa: E402,F401  (offline environment)
from benchmarks.common import answer, answer_caches, log  # noqa: E402
from specdistill.data.datasets import sharegpt_first_turns  # noqa: E402
from specdistill.data.prompts import encode_chat  # noqa: E402
from specdistill.distill.distill_recipe import DataConfig, TeacherConfig  # noqa: E402
from specdistill.distill.examples import Example, encode_conversation, read_done  # noqa: E402
from specdistill.distill.features import FEATURE_META  # noqa: E402
from specdistill.distill.prefill import label_by_prefill  # noqa: E402
from specdistill.distill.train import distill  # noqa: E402
from specdistill.hardware import describe_device  # noqa: E402
from specdistill.modeling.models import load_model  # noqa: E402
from specdistill.pipeline.nightly_recipe import load_nightly_config  # noqa: E402

ARMS = {
    "a": "regenerated answers only (today)",
    "b": "a + logged answers of the current target (prefill)",
    "c": "a + other models' responses (prefill)",
    "c1": "other models' responses only (prefill)",
}


def select(tok, args) -> dict:
    """Held-out and train prompts (with ShareGPT's answer), shuffled once, disjoint by prompt text from each
    other and from the --served answers."""
    path = Path(args.work) / "split.json"
    if path.is_file():
        return json.loads(path.read_text())
    served = {json.dumps(json.loads(line)["prompt"], sort_keys=True) for line in Path(args.served).read_text().splitlines() if line.strip()}
    turns = sharegpt_first_turns(scan=args.scan, tokenizer=tok, max_tokens=args.max_prompt_tokens, answered=True)
    pool = [{"id": str(t.id), "prompt": t.messages, "answer": t.answer} for t in turns
            if t.answer and t.answer.strip() and json.dumps(t.messages, sort_keys=True) not in served]
    random.Random(0).shuffle(pool)
    split = {"heldout": pool[: args.heldout], "train": pool[args.heldout:]}
    path.write_text(json.dumps(split, ensure_ascii=False))
    return split


def labelled_examples(tok, prompts: list[dict], texts: dict[str, str], max_tokens: int, suffix: str) -> list[tuple[dict, Example]]:
    """Each prompt with its logged response (cut to `max_tokens` tokens) as a record and an example."""
    out = []
    for p in prompts:
        text = texts.get(p["id"])
        if not text or not text.strip():
            continue
        try:
            ex = encode_conversation(tok, p["prompt"] + [{"role": "assistant", "content": text}])
        except ValueError:
            continue
        head = encode_chat(tok, p["prompt"])
        response = ex.input_ids[len(head):][:max_tokens]
        rid = f"{p['id']}{suffix}"
        record = {"id": rid, "prompt": p["prompt"], "prompt_ids": head, "response_ids": response,
                  "response": tok.decode(response), "finish": "logged", "temperature": None}
        out.append((record, Example(rid, head + response, [False] * len(head) + [True] * len(response))))
    return out


def label(work: Path, target, name: str, pairs: list[tuple[dict, Example]], args) -> tuple[dict, float]:
    """Label the examples by prefill into `name`'s caches (resumable); (records, seconds)."""
    directory = work / name
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "train_generated.jsonl"
    done = read_done(path)
    todo = [(r, ex) for r, ex in pairs if r["id"] not in done]
    teacher, features = answer_caches(directory, target)
    t0 = time.time()
    with open(path, "a", encoding="utf-8") as f:
        for begin in range(0, len(todo), 256):
            chunk = todo[begin : begin + 256]
            stats = label_by_prefill(target.model, [ex for _, ex in chunk], teacher, features, progress=False)
            for record, _ in chunk:
                s = stats[record["id"]]
                record.update(mean_logprob=round(s.mean_logprob, 4), greedy_share=round(s.greedy_share, 4))
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                done[record["id"]] = record
            f.flush()
            log(f"{name}: labelled {min(begin + 256, len(todo))}/{len(todo)}")
    return done, time.time() - t0


def rates(work: Path, target, split: dict, args) -> dict:
    """Answer tokens/s of decoding (teacher and features) and of prefill labelling, interleaved medians."""
    path = work / "rates.json"
    if path.is_file():
        return json.loads(path.read_text())
    tok = target.tokenizer
    prompts = split["train"][-args.batch * 3:]
    decode, prefill = [], []
    for rep in range(3):
        batch = prompts[rep * args.batch : (rep + 1) * args.batch]
        scratch = work / f"rates-{rep}"
        done, seconds = answer(work, target, scratch.name, batch, batch_size=args.batch, max_new_tokens=args.max_new_tokens)
        decode.append(sum(len(r["response_ids"]) for r in done.values()) / seconds)
        pairs = labelled_examples(tok, batch, {p["id"]: p["answer"] for p in batch}, args.label_max_tokens, "~log")
        records, seconds = label(work, target, scratch.name + "-label", pairs, args)
        prefill.append(sum(len(r["response_ids"]) for r in records.values()) / seconds)
    out = {"decode_tokens_per_s": statistics.median(decode), "prefill_tokens_per_s": statistics.median(prefill),
           "decode_runs": decode, "prefill_runs": prefill, "batch": args.batch}
    path.write_text(json.dumps(out, indent=1))
    return out


def take_tokens(records: list[dict], tokens: float) -> list[dict]:
    """The leading records whose answer tokens fit in `tokens`."""
    out, used = [], 0
    for r in records:
        n = len(r["response_ids"])
        if used + n > tokens:
            break
        out.append(r)
        used += n
    return out


def view(work: Path, name: str, parts: list[tuple[Path, list[dict]]]) -> Path:
    """One training directory over several sources: their records in one JSONL, their shards linked."""
    directory = work / "views" / name
    for sub in ("teacher_cache", "features"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    lines = []
    for source, records in parts:
        lines += [json.dumps(r, ensure_ascii=False) for r in records]
        for sub, meta in (("teacher_cache", "teacher_cache.json"), ("features", FEATURE_META)):
            if not (directory / sub / meta).is_file():
                (directory / sub / meta).write_text((source / sub / meta).read_text())
            for shard in (source / sub).glob("shard-*.safetensors"):
                link = directory / sub / f"shard-{source.name}-{shard.name.removeprefix('shard-')}"  # the caches read shard-*
                if not link.exists():
                    os.symlink(shard.resolve(), link)
    (directory / "train_generated.jsonl").write_text("\n".join(lines) + "\n")
    return directory


def train(work: Path, name: str, directory: Path, heldout: Path, args) -> dict:
    out = work / "runs" / name
    if (out / "result.json").is_file():
        return json.loads((out / "result.json").read_text())
    config = load_nightly_config(None, ["target=demo", f"dtype={args.dtype}"])
    data = DataConfig(path=str(directory / "train_generated.jsonl"), heldout_path=str(heldout), heldout_limit=args.heldout)
    dcfg = config.train.for_run(config, data=data, out_dir=out, feature_dir=str(directory / "features"),
                                teacher=TeacherConfig(mode="cache", cache_dir=str(directory / "teacher_cache")))
    dcfg = dcfg.model_copy(update={"progress": False, "optim": dcfg.optim.model_copy(
        update={"max_steps": args.train_steps, "max_minutes": None})})
    log(f"train {name}: {directory}")
    t0 = time.time()
    result = distill(dcfg).result_json()  # as result.json holds it
    result["wall_minutes"] = (time.time() - t0) / 60
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/data_sources")
    ap.add_argument("--data-minutes", type=float, default=6.0)
    ap.add_argument("--train-steps", type=int, default=1000)
    ap.add_argument("--heldout", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--label-max-tokens", type=int, default=192)
    ap.add_argument("--max-prompt-tokens", type=int, default=384)
    ap.add_argument("--scan", type=int, default=12000)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--only", default=",".join(ARMS))
    ap.add_argument("--served", required=True,
                    help="an answers JSONL of the target's greedy answers (a demo run's train_generated.jsonl): the logged answers")
    ap.add_argument("--rates", default=None, help="DECODE,PREFILL answer tokens/s measured before (else measured here)")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    target = load_model("demo", dtype=args.dtype)
    tok = target.tokenizer
    split = select(tok, args)
    log(f"prompts: {len(split['heldout'])} held-out, {len(split['train'])} train; {describe_device('cpu')}")
    if args.rates:
        decode_rate, prefill_rate = (float(x) for x in args.rates.split(","))
        r = {"decode_tokens_per_s": decode_rate, "prefill_tokens_per_s": prefill_rate, "batch": args.batch, "given": True}
    else:
        r = rates(work, target, split, args)
    log(f"rates: decode {r['decode_tokens_per_s']:.0f} answer tokens/s (batch {args.batch}), "
        f"prefill labels {r['prefill_tokens_per_s']:.0f} tokens/s")
    budget = args.data_minutes * 60
    decode_tokens, prefill_tokens = r["decode_tokens_per_s"] * budget, r["prefill_tokens_per_s"] * budget
    heldout_done, _ = answer(work, target, "heldout", split["heldout"], batch_size=args.batch,
                             max_new_tokens=args.max_new_tokens, record=False)
    heldout = work / "heldout" / "train_generated.jsonl"

    train_prompts = split["train"][: -args.batch * 3]
    mean_answer = 80  # answer tokens per prompt, to size what each source needs before measuring it
    n_decode = int(decode_tokens / mean_answer * 1.2)
    regen_prompts, rest = train_prompts[:n_decode], train_prompts[n_decode:]
    regen, _ = answer(work, target, "regenerated", regen_prompts, batch_size=args.batch, max_new_tokens=args.max_new_tokens)
    regen = [regen[p["id"]] for p in regen_prompts if p["id"] in regen]
    # the store's logged answers of the current target: its greedy answers to other prompts (--served: an
    # earlier run's answers file; production paid their decoding when it served them), labelled again by
    # one prefill as the stage does, from their text
    served = [json.loads(line) for line in Path(args.served).read_text().splitlines() if line.strip()]
    logged_prompts = [{"id": str(r["id"]), "prompt": r["prompt"]} for r in served]
    pairs = labelled_examples(tok, logged_prompts, {str(r["id"]): r["response"] for r in served}, args.max_new_tokens + 1, "~own")
    logged, _ = label(work, target, "logged", pairs, args)
    other_pairs = labelled_examples(tok, rest, {p["id"]: p["answer"] for p in rest}, args.label_max_tokens, "~log")
    other_needed = {x["id"] for x in take_tokens([r for r, _ in other_pairs], prefill_tokens * 1.05)}
    other, _ = label(work, target, "other", [(r, ex) for r, ex in other_pairs if r["id"] in other_needed], args)

    logged_list = [logged[r["id"]] for r, _ in pairs if r["id"] in logged]
    other_list = [other[r["id"]] for r, _ in other_pairs if r["id"] in other]
    arms = {
        "a": [(work / "regenerated", take_tokens(regen, decode_tokens))],
        "b": [(work / "regenerated", take_tokens(regen, decode_tokens / 2)),
              (work / "logged", take_tokens(logged_list, prefill_tokens / 2))],
        "c": [(work / "regenerated", take_tokens(regen, decode_tokens / 2)),
              (work / "other", take_tokens(other_list, prefill_tokens / 2))],
        "c1": [(work / "other", take_tokens(other_list, prefill_tokens))],
    }
    likelihood = {
        "own greedy answers (labelled)": [r["mean_logprob"] for r in logged_list],
        "other models' responses": [r["mean_logprob"] for r in other_list],
    }
    results = {"cpu": describe_device("cpu"), "dtype": str(target.model.dtype).removeprefix("torch."), "rates": r,
               "args": vars(args), "arms": {}, "likelihood": {}}
    for name, values in likelihood.items():
        q = statistics.quantiles(values, n=100) if len(values) > 2 else [float("nan")] * 99
        results["likelihood"][name] = {"n": len(values), "p1": q[0], "p5": q[4], "median": statistics.median(values), "p95": q[94]}
    for name in args.only.split(","):
        parts = arms[name]
        directory = view(work, name, parts)
        result = train(work, name, directory, heldout, args)
        last = result["curve"][-1]
        results["arms"][name] = {
            "what": ARMS[name], "answers": sum(len(p[1]) for p in parts),
            "tokens": sum(len(x["response_ids"]) for p in parts for x in p[1]),
            "by_source": {p[0].name: sum(len(x["response_ids"]) for x in p[1]) for p in parts},
            "first_position": last["acceptance"], "tau_chain_4": last["tau_chain_4"],
            "curve": [(c["step"], round(c["acceptance"], 4)) for c in result["curve"]],
            "train_minutes": result.get("train_minutes"), "steps": result.get("steps")}
        (work / "results.json").write_text(json.dumps(results, indent=1))
    print_table(results)


def print_table(results: dict) -> None:
    r = results["rates"]
    print(f"\n{results['cpu']}, {results['dtype']}; decode {r['decode_tokens_per_s']:.0f} answer tokens/s "
          f"(batch {r['batch']}, teacher+features), prefill labels {r['prefill_tokens_per_s']:.0f} tokens/s; "
          f"{results['args']['data_minutes']} data minutes, "
          f"{results['args']['train_steps']} training steps per arm\n")
    print("| arm | data | answers | answer tokens (by source) | first-position acceptance | τ (chain, γ=4) |")
    print("|---|---|---:|---|---:|---:|")
    for name, a in results["arms"].items():
        sources = ", ".join(f"{k} {v:,}" for k, v in a["by_source"].items())
        print(f"| {name} | {a['what']} | {a['answers']} | {a['tokens']:,} ({sources}) | "
              f"{a['first_position']:.3f} | {a['tau_chain_4']:.2f} |")
    print("| d | on-policy contexts (draft-proposed, target-corrected) | – | the same contexts as a: verification is "
          "lossless and greedy (docs/data.md) | – | – |")
    print("\nmean log-likelihood of a response under the target (nats per token):")
    for name, q in results["likelihood"].items():
        print(f"- {name}: n={q['n']}, p1 {q['p1']:.2f}, p5 {q['p5']:.2f}, median {q['median']:.2f}, p95 {q['p95']:.2f}")


if __name__ == "__main__":
    main()
