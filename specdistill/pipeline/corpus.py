"""Stage: the suffix drafter's corpus from the window's train answers (the target's regenerated answers).

The nightly answers the window's train prompts anyway (for the distilled draft); their token ids are
the corpus of the suffix drafter, versioned with the target fingerprint and tokenizer and kept beside
the answers (a rerun on the same answers finds it). Held-out prompts never enter it: every record's
prompt is looked up in the log store and a record of the eval split refuses the whole build.
"""

from __future__ import annotations

import json
from pathlib import Path

from specdistill.speculative.suffix_corpus import CorpusError, CorpusMeta, read_corpus_meta, save_corpus

CORPUS_FILE = "suffix_corpus.safetensors"


def read_answers(path: str | Path) -> list[dict]:
    """The answers JSONL (`distill.datagen.generate_answers`): every record with `id` and `response_ids`;
    a torn last line (a killed writer) is skipped, any other bad line is an error naming it."""
    path = Path(path)
    records = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            records.append({"id": str(rec["id"]), "response_ids": [int(t) for t in rec["response_ids"]]})
        except (ValueError, KeyError, TypeError) as exc:
            if n == len(lines):  # the torn tail of an interrupted write
                continue
            raise CorpusError(f"{path}:{n}: not an answer record ({exc})") from exc
    return records


def build_corpus(answers: list[str | Path], out_path: str | Path, *, target_fingerprint: str, tokenizer: str,
                 log_db: str | None = None, max_tokens: int | None = None) -> Path:
    """The corpus file from answers files of the train split (newest last; `max_tokens` keeps the
    newest answers that fit). Every record's prompt must be a train prompt of the log store."""
    from specdistill.data.logstore import LogStore

    sequences: list[list[int]] = []
    with LogStore(log_db) as store:
        for path in answers:
            records = read_answers(path)
            if not records:
                continue
            try:
                ids = [int(r["id"]) for r in records]
                stored = store.by_ids(ids)
            except (KeyError, ValueError) as exc:
                raise CorpusError(f"{path}: answers whose prompts are not in the log store {store.display_url} "
                                  f"({exc}): their split cannot be checked") from exc
            held_out = [s.id for s in stored if s.split != "train"]
            if held_out:
                raise CorpusError(f"{path}: {len(held_out)} answers are to held-out (eval) prompts (ids {held_out[:5]}): "
                                  "a suffix corpus is built from the train split only, or the benchmark measures leakage")
            sequences += [r["response_ids"] for r in records if r["response_ids"]]
    if max_tokens is not None:
        total, keep = 0, len(sequences)
        while keep > 0 and total + len(sequences[keep - 1]) <= max_tokens:
            keep -= 1
            total += len(sequences[keep])
        sequences = sequences[keep:]
    meta = CorpusMeta(target_fingerprint=target_fingerprint, tokenizer=tokenizer, split="train",
                      sources=[str(p) for p in answers],
                      note="" if sequences else "no answers: the suffix drafter drafts from the request alone")
    return save_corpus(out_path, sequences, meta)


def corpus_is_current(path: str | Path, target_fingerprint: str) -> tuple[bool, str]:
    """Whether a corpus can draft for this target version (a target update makes it stale, as a draft)."""
    try:
        meta = read_corpus_meta(path)
    except CorpusError as exc:
        return False, str(exc)
    if meta.target_fingerprint != target_fingerprint:
        return False, (f"suffix corpus {path} is stale: built for target {meta.target_fingerprint}, "
                       f"the target is now {target_fingerprint}")
    return True, ""
