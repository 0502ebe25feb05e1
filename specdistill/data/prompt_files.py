"""Benchmark prompt files in the layouts users already have.

- plain text: one prompt a line;
- JSONL `{"prompt": str, "slice": str}` (slice optional);
- Spec-Bench's `question.jsonl`: `{"question_id", "category", "turns": [str, ...]}`; the category
  becomes the slice. The first turn by default; `turns="all"` keeps every turn, for a replay in which
  the later turns follow the target's own answers (MT-Bench style);
- this project's own chat records, whose user messages are the turns: the nightly's answers files
  (`train_generated.jsonl`, the held-out `eval_generated.jsonl`: `{"id", "prompt": [{"role", "content"},
  ...], "prompt_ids", "response_ids", ...}`) and conversations (`{"messages": [...]}`, the generic
  baseline's data and `distill` kind conversations). Their system messages are not kept: the benchmark
  asks each turn under the tokenizer's own template, as it does every layout's.

A line in none of these layouts is an error naming the file, the line and what was expected.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdistill import paths


class PromptFileError(ValueError):
    """A prompt file that cannot be read; the message names the file and line."""


@dataclass
class PromptRecord:
    turns: list[str]  # user turns, in order; one for single-turn prompts
    slice: str = "default"
    id: str | None = None


def read_prompt_file(path: str | Path, turns: str = "first") -> list[PromptRecord]:
    path = Path(path)
    if path.is_dir():
        raise PromptFileError(f"prompts file {path} is a directory")
    if not path.exists():
        raise PromptFileError(f"prompts file not found: {path}")
    records = []
    try:
        f = paths.open_regular(path, "prompts file")  # a FIFO or a device is refused, never waited on
    except paths.UnsafeFileError as exc:
        raise PromptFileError(str(exc)) from None
    with f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise PromptFileError(f"{path}:{lineno}: not UTF-8 text (byte {exc.start + 1} of the line is "
                                      f"{raw[exc.start]:#04x}): a prompts file is text or JSONL") from None
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            if not line.lstrip().startswith("{"):
                records.append(PromptRecord([line.rstrip("\r\n")]))
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptFileError(f"{where}: not valid JSON ({exc.msg})") from exc
            record = _record(obj, where)
            if turns == "first":
                record.turns = record.turns[:1]
            records.append(record)
    if not records:
        raise PromptFileError(f"{path}: no prompts")
    return records


def _record(obj: dict, where: str) -> PromptRecord:
    if "turns" in obj:  # Spec-Bench / MT-Bench question.jsonl
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise PromptFileError(f"{where}: Spec-Bench layout: 'turns' must be a non-empty list of non-empty strings")
        category = obj.get("category", "default")
        if not isinstance(category, str):
            raise PromptFileError(f"{where}: Spec-Bench layout: 'category' must be a string")
        qid = obj.get("question_id")
        return PromptRecord(list(turns), category, None if qid is None else str(qid))
    if "messages" in obj or isinstance(obj.get("prompt"), list):  # the project's answers and conversations
        return _chat_record(obj, "messages" if "messages" in obj else "prompt", where)
    if "prompt" in obj:
        text, slice_name = obj["prompt"], obj.get("slice", "default")
        if not isinstance(text, str) or not text.strip():
            raise PromptFileError(f"{where}: key 'prompt' must be a non-empty string")
        if not isinstance(slice_name, str):
            raise PromptFileError(f"{where}: key 'slice' must be a string")
        return PromptRecord([text], slice_name)
    raise PromptFileError(f"{where}: expected {{\"prompt\": ..., \"slice\": ...}}, Spec-Bench's "
                          f"{{\"question_id\", \"category\", \"turns\": [...]}} or chat {{\"messages\": [...]}}, "
                          f"got keys {sorted(obj)}")


def _chat_record(obj: dict, key: str, where: str) -> PromptRecord:
    """A chat record's user messages, in order, as its turns; its slice and id when it has them."""
    messages = obj[key]
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise PromptFileError(f"{where}: chat layout: {key!r} must be a list of {{\"role\", \"content\"}} messages")
    turns = [m.get("content") for m in messages if m.get("role") == "user"]
    if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise PromptFileError(f"{where}: chat layout: {key!r} needs at least one user message, each with "
                              "non-empty text content")
    slice_name, rid = obj.get("slice", "default"), obj.get("id")
    if not isinstance(slice_name, str):
        raise PromptFileError(f"{where}: key 'slice' must be a string")
    return PromptRecord(turns, slice_name, None if rid is None else str(rid))
