"""A night over an OpenAI-format log that names the current target: its answers are used as they are.

    python benchmarks/experiments/logged_answers.py --served ANSWERS.jsonl [--work DIR] [--claimed-wrong 32] [--other 256]

The log (written here, then ingested like any traffic):
  - every answer in --served (an earlier run's target answers, e.g. a demo's train_generated.jsonl) as
    served by `SmolLM2-135M-Instruct`, the demo target's served name (`generation.logged.served_names`);
  - --claimed-wrong of them with their response swapped for ShareGPT's (ChatGPT's) answer to the same
    prompt, still claimed by the target's name: the own-text check (`pipeline.stages.answers.logged`) must
    refuse them;
  - --other ShareGPT conversations served by `gpt-3.5-turbo`: other models' responses.
Then the answers stage of a nightly (`pipeline.stages.answers.stage.generate_responses`, the demo target in its
run dtype, no time budget) over all of them, and, for the price, the target decoding one batch of the
same prompts. Prints what was logged-as-is, refused (and why) and answered again, labelled and skipped,
and the minutes against what decoding them all would have cost.

Its numbers in benchmarks/experiments/README.md were measured with the likelihood floor that issue 51
replaced by the own-text check: `git checkout c2a50fb` and `python benchmarks/logged_answers.py` rerun that.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SERVED_NAME = "SmolLM2-135M-Instruct"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def openai_record(messages: list[dict], answer: str, model: str) -> dict:
    return {"request": {"model": model, "messages": messages},
            "response": {"model": model, "choices": [{"message": {"role": "assistant", "content": answer}}]}}


def write_log(path: Path, served: list[dict], claimed_wrong: int, other: int) -> dict[str, int]:
    """The traffic file; returns how many records of each kind it holds."""
    from specdistill.data.datasets import sharegpt_first_turns

    served_prompts = {json.dumps(r["prompt"], sort_keys=True) for r in served}
    chatgpt = [t for t in sharegpt_first_turns(scan=6000, answered=True)
               if t.answer and t.answer.strip() and json.dumps(t.messages, sort_keys=True) not in served_prompts]
    random.Random(0).shuffle(chatgpt)
    swapped = set(range(claimed_wrong))
    lines = []
    for i, r in enumerate(served):
        text = chatgpt[-1 - i].answer if i in swapped else r["response"]  # another prompt's ChatGPT answer
        lines.append(openai_record(r["prompt"], text, SERVED_NAME))
    lines += [openai_record(t.messages, t.answer, "gpt-3.5-turbo") for t in chatgpt[:other]]
    path.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))
    return {"served": len(served) - claimed_wrong, "claimed_wrong": claimed_wrong, "other": other}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--served", required=True)
    ap.add_argument("--work", default="/tmp/logged_answers")
    ap.add_argument("--claimed-wrong", type=int, default=32)
    ap.add_argument("--other", type=int, default=256)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    os.environ["SPECDISTILL_HOME"] = str(work / "home")

    import specdistill  # noqa: F401  (offline environment)
    from specdistill.hardware import describe_device
    from specdistill.pipeline.nightly_recipe import load_nightly_config
    from specdistill.pipeline.stages.answers.harness import generate_answers
    from specdistill.pipeline.stages.answers.stage import generate_responses
    from specdistill.pipeline.stages.ingest import ingest_source
    from specdistill.pipeline.stages.pool import data_line
    from specdistill.pipeline.stages.window import select_window

    served = [json.loads(line) for line in Path(args.served).read_text().splitlines() if line.strip()]
    traffic = work / "traffic.jsonl"
    if not traffic.is_file():
        kinds = write_log(traffic, served, args.claimed_wrong, args.other)
        log(f"log: {kinds}")
    n = len(served) + args.other
    config = load_nightly_config(None, [
        f"sources=[{{path: '{traffic}', format: openai, slice: chat}}]", f"dtype={args.dtype}",
        f"window.train_prompts={n}", "window.eval_prompts=4", "window.replay_share=0", "generation.max_minutes=null",
        f"generation.logged.served_names.{SERVED_NAME}=demo"])
    for source in config.sources:
        ingest_source(source, config.log_db)
    window = select_window(config)
    log(f"window: {len(window.train)} train prompts")
    t0 = time.time()
    data = generate_responses(config, window, "train", record_teacher=True)
    stage_minutes = (time.time() - t0) / 60
    logged = data.logged

    # the price of decoding instead: one batch of 16 of the same prompts, answered with teacher and features
    from specdistill.distill.features import FeatureCache
    from specdistill.distill.teacher import TeacherCache
    from specdistill.modeling.eagle3 import default_aux_layers
    from specdistill.modeling.models import shared_model

    target = shared_model(config.target, dtype=config.dtype, device=config.device)
    probe = work / "probe"
    teacher = TeacherCache.create(probe / "t", fingerprint=target.fingerprint, k=32, temperature=1.0, vocab="full", data="probe")
    features = FeatureCache.create(probe / "f", fingerprint=target.fingerprint, data="probe", prompt_context=0,
                                   layers=default_aux_layers(target.model.config.num_hidden_layers))
    t0 = time.time()
    done = generate_answers(target.model, target.tokenizer, window.train[:16], probe / "a.jsonl", batch_size=16,
                            max_new_tokens=config.generation.max_new_tokens, teacher_cache=teacher, feature_cache=features,
                            progress=False)
    decode_rate = sum(len(r["response_ids"]) for r in done.values()) / (time.time() - t0)
    logged_tokens = logged.own_tokens + logged.other_tokens

    print(f"\n{describe_device('cpu')}, {str(target.model.dtype).removeprefix('torch.')}\n")
    print("| what | count | answer tokens |")
    print("|---|---:|---:|")
    print(f"| logged answers of the target used as they are (not decoded) | {logged.own} | {logged.own_tokens:,} |")
    print(f"| claimed by the target, refused by the own-text check, answered again | {logged.refused} | – |")
    print(f"| other models' responses labelled by the target | {logged.other} | {logged.other_tokens:,} |")
    print(f"| prompts decoded by the target | {data.answers - logged.own} | "
          f"{data.tokens - logged_tokens:,} |")
    print(f"| skipped | {sum(logged.skipped.values())} | {logged.skipped} |")
    print(f"\nrefused: {logged.refused_why}; labelling took {logged.minutes:.2f} min of the "
          f"stage's {stage_minutes:.2f}; decoding runs at {decode_rate:.0f} answer tokens/s here (batch 16, teacher "
          f"and features), so decoding the {logged_tokens:,} labelled tokens would have taken "
          f"{logged_tokens / decode_rate / 60:.2f} min")
    print("\n" + data_line(data))


if __name__ == "__main__":
    main()
