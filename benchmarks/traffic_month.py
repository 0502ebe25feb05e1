"""What does a month of a busy service's request log look like, at any size, for the log store's growth curve?

    python benchmarks/traffic_month.py --count 100000 --out DIR [--seed 0 --days 30 --users 5000]

Writes OpenAI-format chat-completion logs (`{"request": {"model", "messages", "user", "temperature"},
"response": {"id", "created", "model", "choices"}}`, one per line) as rotated hourly files
`DIR/YYYY/MM/DD/HH.jsonl.gz` over `--days` days ending at `--end` (default 2026-12-01). Requests are
built from the shipped ShareGPT first turns and HumanEval prompts: an opening cut from one prompt plus
a request number (so contents are unique), an answer cut from a ShareGPT answer, about 500 bytes a
line. Each request has a unique `response.id`, a timestamp inside its hour (sorted), and one of
`--users` users (`user-000042`). A share of lines are exact duplicates of an earlier line of the same
file (`--duplicates`, a client retrying) and a share are malformed (`--malformed`: a line cut short, a
missing `choices`, an empty turn), so ingestion's count conservation is exercised. Seeded: the same
arguments write the same bytes. Prints one JSON summary (lines written by kind, files, bytes).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

SOURCES_TURNS = 3000  # ShareGPT first turns read (enough variety; reading the whole file costs ~30 s)


def source_texts(turns: int = SOURCES_TURNS) -> tuple[list[str], list[str]]:
    """(prompts, answers) from the shipped data: ShareGPT's first user turns and answers, HumanEval prompts."""
    from specdistill.data.datasets import humaneval_prompts, sharegpt_first_turns  # lazy: --help stays fast

    first = sharegpt_first_turns(turns, answered=True, min_chars=20)
    prompts = [t.text for t in first] + humaneval_prompts()
    answers = [t.answer for t in first if t.answer]
    return prompts, answers


def cut(rng: random.Random, text: str, lo: int, hi: int) -> str:
    """A piece of `text` of lo..hi characters from a random start (the whole text when shorter)."""
    n = rng.randint(lo, hi)
    if len(text) <= n:
        return text
    start = rng.randrange(len(text) - n)
    return text[start : start + n]


def record(rng: random.Random, n: int, when: datetime, prompts: list[str], answers: list[str], users: int,
           model: str) -> dict:
    prompt = f"{cut(rng, rng.choice(prompts), 80, 200).strip() or 'hello'} (request {n})"
    answer = cut(rng, rng.choice(answers), 80, 200).strip() or "ok"
    request = {"model": model, "messages": [{"role": "user", "content": prompt}],
               "user": f"user-{rng.randrange(users):06d}", "temperature": 0}
    response = {"id": f"chatcmpl-{n:010d}", "created": int(when.timestamp()), "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}]}
    return {"request": request, "response": response}


def malformed(rng: random.Random, line: str) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        return line[: len(line) // 2]  # cut short: invalid JSON
    obj = json.loads(line)
    if kind == 1:
        del obj["response"]["choices"]
    else:
        obj["request"]["messages"][0]["content"] = "  "
    return json.dumps(obj, ensure_ascii=False)


def generate(out: Path, count: int, *, seed: int = 0, days: int = 30, users: int = 5000,
             duplicates: float = 0.02, malformed_share: float = 0.005,
             end: datetime = datetime(2026, 12, 1, tzinfo=timezone.utc), model: str = "acme-chat-v3",
             texts: tuple[list[str], list[str]] | None = None) -> dict:
    """Write `count` lines (duplicates and malformed ones included) over `days` hourly files; returns the summary."""
    rng = random.Random(seed)
    prompts, answers = texts or source_texts()
    hours = days * 24
    start = end - timedelta(hours=hours)
    per_hour = [count // hours + (1 if h < count % hours else 0) for h in range(hours)]
    rng.shuffle(per_hour)
    summary = {"files": 0, "lines": 0, "unique": 0, "duplicates": 0, "malformed": 0, "bytes": 0,
               "first": start.isoformat(), "last": end.isoformat()}
    n = 0
    for h, k in enumerate(per_hour):
        if not k:
            continue
        hour = start + timedelta(hours=h)
        path = out / f"{hour:%Y/%m/%d/%H}.jsonl.gz"
        path.parent.mkdir(parents=True, exist_ok=True)
        offsets = sorted(rng.randrange(3600) for _ in range(k))
        lines: list[str] = []
        for sec in offsets:
            if lines and rng.random() < duplicates:
                lines.append(rng.choice(lines))
                summary["duplicates"] += 1
                continue
            line = json.dumps(record(rng, n, hour + timedelta(seconds=sec), prompts, answers, users, model),
                              ensure_ascii=False)
            n += 1
            if rng.random() < malformed_share:
                line = malformed(rng, line)
                summary["malformed"] += 1
            else:
                summary["unique"] += 1
            lines.append(line)
        data = ("\n".join(lines) + "\n").encode("utf-8")
        # mtime=0: the same arguments write the same bytes
        path.write_bytes(gzip.compress(data, compresslevel=6, mtime=0))
        summary["files"] += 1
        summary["lines"] += len(lines)
        summary["bytes"] += len(data)
    return summary


def hourly_files(directory: Path) -> list[Path]:
    """The generated files, oldest hour first (the order a log shipper delivers them)."""
    return sorted(directory.glob("*/*/*/*.jsonl.gz"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, required=True, help="lines to write (duplicates and malformed included)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--users", type=int, default=5000)
    parser.add_argument("--duplicates", type=float, default=0.02)
    parser.add_argument("--malformed", type=float, default=0.005)
    parser.add_argument("--end", default="2026-12-01", help="the day after the last hour (UTC)")
    args = parser.parse_args(argv)
    end = datetime.fromisoformat(args.end).replace(tzinfo=timezone.utc)
    summary = generate(args.out, args.count, seed=args.seed, days=args.days, users=args.users,
                       duplicates=args.duplicates, malformed_share=args.malformed, end=end)
    json.dump(summary, sys.stdout)
    print()


if __name__ == "__main__":
    main()
