"""The answers file both answer paths write: append-only JSONL, one line per finished answer with its id,
so a killed run resumes where it stopped and never answers a prompt twice."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from transformers import PreTrainedTokenizerBase

from specdistill import paths
from specdistill.data.prompts import Prompt, as_messages
from specdistill.distill.examples import read_done


def drop_unbacked(out_path: Path, done: dict[str, dict], caches: list) -> dict[str, dict]:
    """Resume is keyed on the answers file and on the caches it feeds: an answer whose teacher (or
    feature) rows are gone, because their shard failed its checksum and was quarantined, is taken out
    of the answers file so that this run answers it again. Returns the answers that stand."""
    caches = [c for c in caches if c is not None]
    if not caches or not done:
        return done
    have: set[str] | None = None
    for cache in caches:
        ids, bad = cache.verified_ids()
        for line in bad:
            print(f"quarantined a bad cache shard: {line}", file=sys.stderr)
        have = ids if have is None else have & ids
    lost = [i for i in done if i not in have]
    if not lost:
        return done
    print(f"{len(lost)} answers in {out_path} have no verified cache rows: answering them again", file=sys.stderr)
    kept = {i: r for i, r in done.items() if i in have}
    tmp = out_path.with_name(out_path.name + ".tmp")
    with paths.open_private(tmp, "w", encoding="utf-8") as f:
        append_records(f, kept.values())
    os.replace(tmp, out_path)
    return kept


def resume(out_path: Path, prompts: Iterable[Prompt], caches: list) -> tuple[dict[str, dict], list[Prompt]]:
    """The answers that stand in `out_path` (backed by `caches`) and the prompts still to answer, in order."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if out_path.exists() and out_path.stat().st_size:  # a partial last line is cut, so appends start on a fresh line
        with open(out_path, "rb+") as f:
            data = f.read()
            if not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)
    done = drop_unbacked(out_path, read_done(out_path), caches)
    todo = [p for p in prompts if str(p.id) not in done]
    repeated = [pid for pid, n in Counter(p.id for p in todo).items() if n > 1]
    if repeated:
        raise ValueError(f"duplicate prompt id {repeated[0]!r}")
    return done, todo


def append_records(out: IO[str], records: Iterable[dict], done: dict[str, dict] | None = None) -> int:
    """Write answer lines and sync them to disk (a line on disk is a finished answer), noting each in `done`;
    returns their answer tokens."""
    tokens = 0
    for record in records:
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
        tokens += len(record["response_ids"])
        if done is not None:
            done[record["id"]] = record
    out.flush()
    os.fsync(out.fileno())
    return tokens


def answer_record(p: Prompt, prompt_ids: list[int], answer: list[int], tokenizer: PreTrainedTokenizerBase,
                  finish: str, temperature: float) -> dict:
    return {"id": p.id, "prompt": as_messages(p.messages), "prompt_ids": prompt_ids, "response_ids": answer,
            "response": tokenizer.decode(answer, skip_special_tokens=True), "finish": finish, "temperature": temperature}
