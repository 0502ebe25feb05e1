"""Training examples: a conversation or a target answer (written by `pipeline.stages.answers`) as ids with the
mask of the assistant tokens that every loss is restricted to; the batches and resumable data order a
trainer reads them in."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from specdistill import paths
from specdistill.data.prompts import as_messages, encode_chat
from specdistill.distill.night_files import read_done  # noqa: F401  (its public name, as before night_files)
from specdistill.distill.teacher import pad_batch


@dataclass
class Example:
    """One training sequence: ids and which of them are assistant tokens (the ones the draft learns)."""

    id: str
    input_ids: list[int]
    assistant_mask: list[bool]  # assistant_mask[t]: token t was written by the assistant


def encode_conversation(tokenizer: PreTrainedTokenizerBase, messages: Sequence, max_len: int | None = None) -> Example:
    """Chat-template a whole conversation and mark every assistant turn (its content and end token).

    Each turn is located by rendering the conversation up to its header and up to its end, so the marked
    tokens are exactly the assistant's, whatever the template adds around them."""
    msgs = as_messages(messages)
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    mask: list[bool] = []
    for i, m in enumerate(msgs):
        if max_len is not None and len(ids) >= max_len:
            break  # the later turns would be cut off: rendering them cost the demo's generic baseline 70 s
        if m["role"] != "assistant":
            continue
        head = encode_chat(tokenizer, msgs[:i])
        full = tokenizer.apply_chat_template(msgs[: i + 1], tokenize=True)
        full = list(full["input_ids"] if hasattr(full, "keys") else full)
        if full[: len(head)] != head:
            raise ValueError(f"chat template does not render turn {i} as an extension of its prompt")
        if head[: len(ids)] != ids:
            raise ValueError(f"chat template re-renders earlier turns differently at turn {i}")
        answer = full[len(head):]
        if eos in answer:  # what the template adds after the end token (a newline) is not the assistant's
            answer = answer[: answer.index(eos) + 1]
        mask += [False] * (len(head) - len(ids)) + [True] * len(answer)
        ids = head + answer
    if not ids:
        raise ValueError("conversation has no assistant turn to learn from")
    ids, mask = ids[:max_len], mask[:max_len]  # [:None] keeps all
    return Example("", ids, mask)


def encode_generated(tokenizer: PreTrainedTokenizerBase, record: dict, max_len: int | None = None) -> Example:
    """A target-generated record: the prompt rendered as at generation time, then the exact generated ids."""
    head = record.get("prompt_ids") or encode_chat(tokenizer, record["prompt"])
    answer = list(record["response_ids"])
    ids = list(head) + answer
    mask = [False] * len(head) + [True] * len(answer)
    ids, mask = ids[:max_len], mask[:max_len]
    return Example(str(record["id"]), ids, mask)


def read_examples(path: str, kind: str, tokenizer: PreTrainedTokenizerBase, max_len: int,
                  limit: int | None = None) -> list[Example]:
    """JSONL records into training examples; a bad line fails naming the file and line."""
    out = []
    with io.TextIOWrapper(paths.open_regular(path, "training data file"), encoding="utf-8") as f:  # never a FIFO
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(out) >= limit:
                break
            try:
                rec = json.loads(line)
                if kind == "generated":
                    ex = encode_generated(tokenizer, rec, max_len)
                else:
                    ex = encode_conversation(tokenizer, rec["messages"], max_len)
                    ex.id = str(rec.get("id", f"{Path(path).name}:{lineno}"))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a usable {kind} record: {exc}") from None
            if any(ex.assistant_mask[1:]):
                out.append(ex)
    if not out:
        raise ValueError(f"{path}: no record with assistant tokens to train on")
    return out


@dataclass
class Batch:
    ids: list[str]
    input_ids: torch.Tensor  # [B, T]
    attention: torch.Tensor  # [B, T]
    positions: torch.Tensor  # [B, T] bool: logits here predict an assistant token
    labels: torch.Tensor  # [N] the next token (target ids) at those positions, row-major
    rows_per_example: list[int] = field(default_factory=list)

    def to(self, device: torch.device) -> Batch:
        return Batch(self.ids, self.input_ids.to(device), self.attention.to(device), self.positions.to(device),
                     self.labels.to(device), self.rows_per_example)


def collate(examples: list[Example]) -> Batch:
    input_ids, attention = pad_batch([ex.input_ids for ex in examples])
    positions = torch.zeros_like(input_ids, dtype=torch.bool)
    for row, ex in enumerate(examples):
        mask = torch.tensor(ex.assistant_mask[1:], dtype=torch.bool)
        positions[row, : mask.numel()] = mask
    labels = input_ids[:, 1:][positions[:, :-1]] if input_ids.shape[1] > 1 else input_ids.new_zeros(0)
    return Batch([ex.id for ex in examples], input_ids, attention, positions, labels,
                 [int(positions[r].sum()) for r in range(len(examples))])


class DataOrder:
    """A seeded permutation per epoch and a cursor: exactly resumable data position."""

    def __init__(self, n: int, seed: int, epoch: int = 0, cursor: int = 0):
        self.n, self.seed, self.epoch, self.cursor = n, seed, epoch, cursor
        self._perm = self._permutation()

    def _permutation(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.cursor >= self.n:
                self.epoch, self.cursor = self.epoch + 1, 0
                self._perm = self._permutation()
            out.append(self._perm[self.cursor])
            self.cursor += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}
