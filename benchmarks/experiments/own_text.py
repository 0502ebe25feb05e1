"""Which test tells the target's own text from imitations and noise? Measured on the demo target.

    python benchmarks/experiments/own_text.py --answers ANSWERS.jsonl [--n 48] [--dtype auto]

ANSWERS.jsonl: a demo state's decoded answers (`.specdistill/nightly/data/*/train_generated.jsonl`): the
target's greedy answers. Beside them, answers to the same prompts that the target samples now at
temperature 1 and 0.7, and texts it did not write: ChatGPT's (ShareGPT's answers), the target's own
greedy answer to another prompt, its greedy answer with one token in ten replaced, random printable
characters, and Chinese boilerplate. Each is labelled by one prefill, as the nightly labels a logged
answer (`distill.prefill.label_by_prefill`, the response cut to `generation.logged.max_tokens`), and
the table gives, per set, the median and the 5th/95th percentiles of each statistic of `Labelled`, then
how many of each set every rule admits (`pipeline.stages.answers.logged.own_text_check`: the rule in use).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

CHINESE = ["感谢您的提问！作为一个人工智能助手，我很乐意为您提供帮助。如果您有任何其他问题，请随时告诉我。",
           "以下是关于该主题的详细说明：首先，我们需要了解基本概念；其次，我们需要分析相关因素；最后，我们可以得出结论。",
           "本文仅供参考，不构成任何投资建议。市场有风险，投资需谨慎。版权所有，未经许可不得转载。"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--answers")
    ap.add_argument("--stats", help="a stats.json an earlier run wrote: print its rules table again, labelling nothing")
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--work", default="/tmp/own_text")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.stats:
        from specdistill.distill.prefill import Labelled
        from specdistill.pipeline.stages.answers.logged import own_text_check

        saved = json.loads(Path(args.stats).read_text())
        table({k: [Labelled(**s) for s in v] for k, v in saved.items()}, own_text_check)
        return
    if not args.answers:
        ap.error("--answers (or --stats) is required")

    import specdistill  # noqa: F401  (offline environment)
    from specdistill.data.datasets import sharegpt_first_turns
    from specdistill.data.prompts import Prompt
    from specdistill.distill.examples import Example
    from specdistill.distill.prefill import label_by_prefill
    from specdistill.hardware import describe_device
    from specdistill.modeling.models import shared_model
    from specdistill.pipeline.generation_section import LoggedConfig
    from specdistill.pipeline.stages.answers.harness import generate_answers
    from specdistill.pipeline.stages.answers.logged import check_response, own_text_check

    target = shared_model("demo", dtype=args.dtype)
    tok, max_tokens = target.tokenizer, LoggedConfig().max_tokens
    context = target.model.config.max_position_embeddings
    rng = random.Random(0)
    answers = [json.loads(line) for line in Path(args.answers).read_text().splitlines() if line.strip()]
    answers = [a for a in answers if a["response_ids"] and a.get("temperature") in (0, 0.0, None)][: args.n]
    prompts = [Prompt(id=a["id"], messages=a["prompt"]) for a in answers]
    sets: dict[str, list[tuple[list[dict], str | list[int]]]] = {}
    sets["own greedy"] = [(a["prompt"], a["response_ids"]) for a in answers]
    for t in (1.0, 0.7):
        sampled = generate_answers(target.model, tok, prompts, work / f"sampled-{t}.jsonl", temperature=t, seed=1,
                                   max_new_tokens=args.max_new_tokens, progress=False)
        sets[f"own sampled T={t}"] = [(a["prompt"], sampled[a["id"]]["response_ids"]) for a in answers
                                     if sampled[a["id"]]["response_ids"]]
    chatgpt = [t for t in sharegpt_first_turns(scan=3000, answered=True) if t.answer and t.answer.strip()][: args.n]
    sets["ChatGPT (ShareGPT)"] = [(t.messages, t.answer) for t in chatgpt]
    sets["own answer, other prompt"] = [(a["prompt"], answers[(i + 1) % len(answers)]["response_ids"])
                                        for i, a in enumerate(answers)]
    common = sorted({i for a in answers for i in a["response_ids"]})
    sets["own greedy, 1 token in 10 replaced"] = [
        (a["prompt"], [rng.choice(common) if j % 10 == 5 else i for j, i in enumerate(a["response_ids"])]) for a in answers]
    printable = "".join(chr(c) for c in range(33, 127))
    sets["random characters"] = [(a["prompt"], "".join(rng.choice(printable) for _ in range(300))) for a in answers]
    sets["Chinese boilerplate"] = [(a["prompt"], "".join(rng.choice(CHINESE) for _ in range(4))) for a in answers]

    stats: dict[str, list] = {}
    for name, items in sets.items():
        examples = []
        for i, (prompt, response) in enumerate(items):
            if isinstance(response, list):  # token ids as decoded: the exact text
                head = next(a["prompt_ids"] for a in answers if a["prompt"] == prompt)
                response = response[:max_tokens]
                examples.append(Example(f"{i}", head + response, [False] * len(head) + [True] * len(response)))
                continue
            example, reason = check_response(tok, prompt, response, context, max_tokens)
            if example is not None:
                example.id = f"{i}"
                examples.append(example)
        temperature = 0.7 if name.endswith("T=0.7") else 1.0
        labelled = label_by_prefill(target.model, examples, None, progress=False,
                                    temperatures={ex.id: temperature for ex in examples}, special_ids=tok.all_special_ids)
        stats[name] = list(labelled.values())
        log(f"{name}: {len(labelled)} labelled")

    print(f"\n{describe_device('cpu')}, {str(target.model.dtype).removeprefix('torch.')}; responses cut to {max_tokens} tokens;"
          " z at T=0.7 for the T=0.7 samples, else at T=1\n")
    fields = [("mean_logprob", "mean log-prob"), ("greedy_share", "greedy share"), ("near_greedy_share", "near-greedy share"),
              ("top_k_share", "top-20 share"), ("sampled_z", "sampled z")]
    print("| set | n | " + " | ".join(label for _, label in fields) + " |")
    print("|---|---:|" + "---:|" * len(fields))
    for name, values in stats.items():
        cells = []
        for key, _ in fields:
            v = [getattr(s, key) for s in values]
            cells.append(f"{statistics.median(v):.2f} [{pct(v, 0.05):.2f}, {pct(v, 0.95):.2f}]")
        print(f"| {name} | {len(values)} | " + " | ".join(cells) + " |")

    (work / "stats.json").write_text(json.dumps({k: [vars(s) for s in v] for k, v in stats.items()}, indent=1))
    table(stats, own_text_check)


def table(stats: dict[str, list], own_text_check) -> None:
    rules = {
        "likelihood floor (mean log-prob >= -5.15, the old test)": lambda s, t: s.mean_logprob >= -5.15,
        "own_text_check, a greedy request (T=0, the default when none is logged)": lambda s, t: own_text_check(s, 0.0) is None,
        "own_text_check, a sampled request (top-20 share >= 0.5, z >= -3 at the set's T)":
            lambda s, t: own_text_check(s, 1.0) is None,
        "own_text_check at the set's own temperature": lambda s, t: own_text_check(s, t) is None,
    }
    print("\n| rule: admitted of | " + " | ".join(stats) + " |")
    print("|---|" + "---:|" * len(stats))
    for rule, admits in rules.items():
        cells = []
        for name, values in stats.items():
            t = 0.7 if name.endswith("T=0.7") else 1.0 if "sampled" in name else 0.0
            cells.append(f"{sum(admits(s, t) for s in values)}/{len(values)}")
        print(f"| {rule} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
