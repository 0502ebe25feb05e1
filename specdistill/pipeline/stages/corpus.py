"""Stage: the suffix drafter's corpus from the window's train answers (the target's regenerated answers).

The nightly answers the window's train prompts anyway (for the distilled draft); their token ids are
the corpus of the suffix drafter, versioned with the target fingerprint and tokenizer and kept beside
the answers (a rerun on the same answers finds it). Held-out prompts never enter it: every record's
prompt is looked up in the log store and a record of the eval split refuses the whole build.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

from specdistill import paths
from specdistill.data.logstore import LogStore
from specdistill.modeling.fingerprints import tokenizer_digest
from specdistill.modeling.models import resolve_model_dir
from specdistill.pipeline.layout import CORPUS_FILE, current_corpus_path, sglang_corpus_path
from specdistill.pipeline.outputs import GeneratedData
from specdistill.speculative.suffix_corpus import CorpusError, CorpusMeta, load_corpus, save_corpus


def nightly_corpus(config, train_data: GeneratedData, target_fingerprint: str) -> str:
    """Stage: the corpus of the window's train answers, beside them (a rerun finds it), its SGLang
    export beside it, and a copy as the state directory's current corpus (what the monitor reads)."""
    out = Path(train_data.path).parent / CORPUS_FILE
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(config.target))
    if not out.is_file():
        build_corpus([train_data.path], out, target_fingerprint=target_fingerprint,
                     tokenizer=tokenizer_digest(tokenizer), log_db=config.log_db,
                     max_tokens=config.bench.suffix_max_tokens)
        export_sglang_corpus(out, tokenizer)
    paths.atomic_copy(out, current_corpus_path(), mode=paths.PRIVATE_FILE_MODE)  # answers, as token ids: the owner only
    return str(out)


def read_answers(path: str | Path) -> list[dict]:
    """The target's answers in an answers JSONL (`pipeline.stages.answers`): every record with `id` and `response_ids`
    but other models' labelled responses;
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
            if rec.get("source") == "other":  # another model's logged response, labelled: not the target's text
                continue
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


def export_sglang_corpus(corpus: str | Path, tokenizer) -> Path:
    """The corpus as SGLang's NGRAM external corpus reads it (`--speculative-ngram-external-corpus-path`):
    one JSON string per line, each answer's text, which SGLang tokenizes again (without special tokens).
    The ids are decoded with `tokenizer`, so the corpus must hold ids of that tokenizer (checked)."""
    sequences, _ = load_corpus(corpus, tokenizer=tokenizer_digest(tokenizer), vocab_size=len(tokenizer))
    out = sglang_corpus_path(corpus)
    tmp = out.with_name(f".{out.name}.tmp")
    with paths.open_private(tmp, "w", encoding="utf-8") as f:  # answer texts: the owner only (see paths)
        for seq in sequences:
            text = tokenizer.decode(seq.tolist(), skip_special_tokens=True)
            if text.strip():
                f.write(json.dumps(text, ensure_ascii=False) + "\n")
    tmp.replace(out)
    return out
