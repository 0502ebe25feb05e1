"""Target-generated training data: the target answers the logged prompts (sequence-level distillation).

A draft learns the target's own output distribution far faster from the target's answers than from
the human-written ones in the logs (DistillSpec). Generation is batched with left padding, greedy
or sampled, through an own decode loop (`answer_loop.decode_batch`: no cache re-concatenation, no steps for
finished answers, prefills grouped by length), and append-only: every finished answer is one JSONL
line with its id, so a killed run resumes where it stopped and never generates an answer twice.

Also here: turning a conversation into training ids with the chat template, and the mask of the
assistant tokens that every loss is restricted to.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdistill import paths
from specdistill.budget import Deadline
from specdistill.data.prompts import Prompt, as_messages, encode_chat
from specdistill.distill.answer_loop import FeatureRecorder, TopKRecorder, decode_batch
from specdistill.distill.features import FEATURE_DTYPE, FeatureCache, feature_start
from specdistill.distill.teacher import TeacherCache, pad_batch
from specdistill.modeling.attention import decode_attention_for

SORT_CHUNK = 8  # batches sorted by length together: little padding, and a time cut keeps a sample of the prompts


@dataclass
class Example:
    """One training sequence: ids and which of them are assistant tokens (the ones the draft learns)."""

    id: str
    input_ids: list[int]
    assistant_mask: list[bool]  # assistant_mask[t]: token t was written by the assistant


def encode_conversation(tokenizer: PreTrainedTokenizerBase, messages: Sequence, max_len: int | None = None) -> Example:
    """Chat-template a whole conversation and mark every assistant turn (its content and end token).

    Each assistant turn is located by rendering the conversation up to its header and up to its
    end: the template is applied to prefixes, so the marked tokens are exactly the ones the
    assistant produced, whatever the template adds around them.
    """
    msgs = as_messages(messages)
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    mask: list[bool] = []
    for i, m in enumerate(msgs):
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
    if max_len is not None:
        ids, mask = ids[:max_len], mask[:max_len]
    return Example("", ids, mask)


def encode_generated(tokenizer: PreTrainedTokenizerBase, record: dict, max_len: int | None = None) -> Example:
    """A target-generated record: the prompt rendered as at generation time, then the exact generated ids."""
    head = record.get("prompt_ids") or encode_chat(tokenizer, record["prompt"])
    answer = list(record["response_ids"])
    ids = list(head) + answer
    mask = [False] * len(head) + [True] * len(answer)
    if max_len is not None:
        ids, mask = ids[:max_len], mask[:max_len]
    return Example(str(record["id"]), ids, mask)


# --------------------------------------------------------------------------------------------
# Generation


def read_done(path: Path) -> dict[str, dict]:
    """Records already written; a torn last line (killed mid-write) is ignored and rewritten."""
    done: dict[str, dict] = {}
    if not path.exists():
        return done
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[str(rec["id"])] = rec
    return done


def repair_tail(path: Path) -> None:
    """Cut a partial last line so appends start on a fresh line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return
        cut = data.rfind(b"\n") + 1
        f.truncate(cut)


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
        for record in kept.values():
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out_path)
    return kept


@torch.inference_mode()
def generate_answers(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Iterable[Prompt],
    out_path: str | os.PathLike,
    *,
    batch_size: int = 16,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    seed: int = 0,
    progress: bool = True,
    teacher_cache: TeacherCache | None = None,
    feature_cache: FeatureCache | None = None,
    decode_attention: bool = True,
    deadline: Deadline | None = None,
) -> dict[str, dict]:
    """Answer every prompt with the target, appending one JSONL record per answer; returns all records.

    With a `deadline`, no batch starts after it: the answers written so far are kept and returned (a
    later run with more time resumes from them). Prompts are answered in their given order, chunk by
    chunk (`SORT_CHUNK` batches), sorted by length inside a chunk so a batch pads little while a cut
    leaves a sample of the prompts rather than the shortest ones. With sampling, each batch is seeded from
    `seed` and its first id, so a resumed run samples what an uninterrupted one would have.
    With `teacher_cache`, the target's top-k log-probs at every answer token (temperature 1, full
    vocabulary) go into it too, so no second target pass is needed for offline distillation; with
    `feature_cache`, so do the EAGLE-3 feature layers' inputs at the positions the cache stores (its
    `layers` and `prompt_context`), as seen by the target's decode steps.
    `decode_attention`: decode steps use `modeling.attention.decode_attention` instead of SDPA's
    CPU flash kernel (faster for a batch; the same answers up to numerical near-ties).
    """
    if teacher_cache is not None and temperature > 0:
        raise ValueError("record the teacher during greedy generation only; for sampled answers use teacher.build_cache")
    context = feature_cache.meta["prompt_context"] if feature_cache is not None else None
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    repair_tail(out_path)
    done = drop_unbacked(out_path, read_done(out_path), [teacher_cache, feature_cache])
    todo = [p for p in prompts if str(p.id) not in done]
    seen: set[str] = set()
    for p in todo:
        if p.id in seen:
            raise ValueError(f"duplicate prompt id {p.id!r}")
        seen.add(p.id)
    encoded = [(p, encode_chat(tokenizer, p.messages)) for p in todo]
    chunk = SORT_CHUNK * batch_size
    encoded = [x for begin in range(0, len(encoded), chunk) for x in sorted(encoded[begin:begin + chunk], key=lambda x: len(x[1]))]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    bar = tqdm(total=len(encoded), desc="target answers", unit="prompt", disable=not progress, file=sys.stderr)
    new_tokens = 0
    with paths.open_private(out_path, "a", encoding="utf-8") as out:  # answers to production traffic: the owner only
        for start in range(0, len(encoded), batch_size):
            if deadline is not None and deadline.expired():
                bar.write(f"target answers: time budget reached after {len(done)} of {len(done) + len(encoded) - start} "
                          f"prompts; the answers so far are kept", file=sys.stderr)
                break
            batch = encoded[start : start + batch_size]
            if temperature > 0:
                torch.manual_seed(seed + zlib.crc32(batch[0][0].id.encode()))
            recorder = None
            if teacher_cache is not None:
                recorder = TopKRecorder(int(teacher_cache.meta["k"]), float(teacher_cache.meta["temperature"]),
                                         len(batch), max_new_tokens)
            features = None
            if feature_cache is not None:
                features = FeatureRecorder(feature_cache.meta["layers"], context, len(batch), max_new_tokens)
            with decode_attention_for(target) if decode_attention else nullcontext():
                generated = decode_batch(target, [ids for _, ids in batch], max_new_tokens=max_new_tokens, pad=pad,
                                         eos=eos, temperature=temperature, recorder=recorder, features=features)
            answers = []
            for row in range(len(batch)):
                answer = generated[row].tolist()
                answers.append(answer[: answer.index(eos) + 1] if eos in answer else answer)
            name = f"gen-{zlib.crc32('|'.join(p.id for p, _ in batch).encode()):08x}"
            if recorder is not None:
                entries = {}
                for row, ((p, ids), answer) in enumerate(zip(batch, answers)):
                    entries[p.id] = {"input_ids": torch.tensor(ids + answer, dtype=torch.int32),
                                     **recorder.rows(row, len(answer))}
                teacher_cache.write_shard(name, entries)
            if features is not None:
                entries = {}
                for row, ((p, ids), answer) in enumerate(zip(batch, answers)):
                    start = feature_start([False] * len(ids) + [True] * len(answer), context)
                    entries[p.id] = {"input_ids": torch.tensor(ids + answer, dtype=torch.int32),
                                     "start": torch.tensor(start, dtype=torch.int64),
                                     "features": features.rows(row, len(answer)).to(FEATURE_DTYPE)}
                feature_cache.write_shard(name, entries)
            for row, (p, ids) in enumerate(batch):
                answer = generated[row].tolist()
                finish = "length"
                if eos in answer:
                    answer = answer[: answer.index(eos) + 1]
                    finish = "eos"
                record = {
                    "id": p.id, "prompt": as_messages(p.messages), "prompt_ids": ids,
                    "response_ids": answer, "response": tokenizer.decode(answer, skip_special_tokens=True),
                    "finish": finish, "temperature": temperature,
                }
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
                done[p.id] = record
                new_tokens += len(answer)
            out.flush()
            os.fsync(out.fileno())
            bar.update(len(batch))
            bar.set_postfix(tokens=new_tokens)
    bar.close()
    return done


# --------------------------------------------------------------------------------------------
# Training batches


def read_examples(path: str, kind: str, tokenizer: PreTrainedTokenizerBase, max_len: int,
                  limit: int | None = None) -> list[Example]:
    """JSONL records into training examples; a bad line fails naming the file and line."""
    out = []
    with open(path, encoding="utf-8") as f:
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
