"""Target-generated training data: the target answers the logged prompts (sequence-level distillation).

A draft learns the target's own output distribution far faster from the target's answers than from
the human-written ones in the logs (DistillSpec). Generation is batched with left padding, greedy
or sampled, through an own decode loop (`decode_batch`: no cache re-concatenation, no steps for
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
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase

from specdistill.data.prompts import as_messages, encode_chat
from specdistill.distill.teacher import TeacherCache, pad_batch, topk_rows
from specdistill.modeling.attention import batched_decode_attention
from specdistill.modeling.kv_cache import preallocated_cache, select_rows, write_rows


@dataclass
class Prompt:
    id: str
    messages: list[dict]  # [{"role", "content"}], ending before the answer to generate


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


class _TopKRecorder:
    """Keeps the target's top-k log-probs at every generated step: the offline teacher for free,
    since these are exactly the target's distributions at the answer positions."""

    def __init__(self, k: int, temperature: float, rows: int, steps: int):
        self.k, self.temperature = k, temperature
        self.logprobs = torch.zeros((rows, steps, k))
        self.indices = torch.zeros((rows, steps, k), dtype=torch.int32)
        self.residual = torch.zeros((rows, steps))

    def record(self, step: int, rows: torch.Tensor, logits: torch.Tensor) -> None:
        """`logits[i]` is the distribution of batch row `rows[i]` at answer token `step`."""
        top, idx, res = topk_rows(logits, self.k, self.temperature)
        self.logprobs[rows, step], self.indices[rows, step], self.residual[rows, step] = top, idx, res

    def rows(self, row: int, n: int) -> dict[str, torch.Tensor]:
        return {"logprobs": self.logprobs[row, :n], "indices": self.indices[row, :n], "residual": self.residual[row, :n]}


def left_pad(prompts: Sequence[Sequence[int]], pad: int, room: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids `[rows, width]` left-padded so every answer starts at the same column, and the attention
    mask with `room` more (zero) columns for the answer tokens."""
    width = max(len(ids) for ids in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention = torch.zeros((len(prompts), width + room), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attention[row, width - len(ids): width] = 1
    return input_ids, attention


def prefill_groups(lengths: Sequence[int], waste: float = 0.15) -> list[list[int]]:
    """Row indices in groups of similar prompt length, so left padding adds at most `waste` to a group's prefill.

    One padded prefill of a whole batch spends most of its time on padding when one prompt is much
    longer than the rest (ShareGPT: a batch of 47- to 145-token prompts is half padding), and a
    prefill costs tens of decode steps; one prefill per row wastes the matmuls' efficiency instead.
    """
    groups: list[list[int]] = []
    group: list[int] = []
    tokens = 0
    for row in sorted(range(len(lengths)), key=lambda r: lengths[r]):
        if group and lengths[row] * (len(group) + 1) > (1 + waste) * (tokens + lengths[row]):
            groups.append(group)
            group, tokens = [], 0
        group.append(row)
        tokens += lengths[row]
    return [*groups, group] if group else groups


def _positions(attention: torch.Tensor) -> torch.Tensor:
    """Position ids counted from each row's first real token (left padding at 0), as `generate` sets them."""
    return (attention.cumsum(-1) - 1).clamp(min=0)


@torch.inference_mode()
def decode_batch(target: PreTrainedModel, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, pad: int, eos: int,
                 temperature: float = 0.0, recorder: _TopKRecorder | None = None) -> torch.Tensor:
    """Answers to a batch of prompts, `[rows, max_new_tokens]`, each row padded with `pad` after its EOS.

    `model.generate`'s loop without its waste: rows are left-padded (every answer starts at the same
    column, positions count from each row's first real token) but prefilled in groups of similar
    length (`prefill_groups`), the KV cache is written in place (`modeling.kv_cache`), and a row
    that produced EOS leaves the batch with its cache rows, so no step is spent on a finished
    answer. Rows never see each other, so greedy answers are `generate`'s (argmax over fp32 logits,
    ties to the lowest id) up to float rounding of the differently grouped matmuls. Sampling draws
    as `generate` does (softmax of logits / temperature, one multinomial over the rows still going).
    """
    rows, width = len(prompts), max(len(ids) for ids in prompts)
    _, attention = left_pad(prompts, pad, max_new_tokens)
    cache = preallocated_cache(target, rows, width + max_new_tokens)
    logits = None
    for group in prefill_groups([len(ids) for ids in prompts]):
        input_ids, group_attention = left_pad([prompts[r] for r in group], pad)
        prefill = DynamicCache(config=target.config)
        last = target(input_ids=input_ids, attention_mask=group_attention, position_ids=_positions(group_attention),
                      cache=prefill, use_cache=True, logits_to_keep=1).logits[:, -1]
        logits = last.new_empty((rows, last.shape[-1])) if logits is None else logits
        logits[group] = last
        write_rows(cache, torch.tensor(group), width, prefill)
    positions = _positions(attention[:, :width])[:, -1:]
    answers = torch.full((rows, max_new_tokens), pad, dtype=torch.long)
    going = torch.arange(rows)  # the batch rows still generating, in cache order
    length = width
    for step in range(max_new_tokens):
        logits = logits.float()
        if recorder is not None:
            recorder.record(step, going, logits)
        if temperature > 0:
            new = torch.multinomial(torch.softmax(logits / temperature, dim=-1), num_samples=1).squeeze(1)
        else:
            new = logits.argmax(dim=-1)
        answers[going, step] = new
        unfinished = new != eos
        if step + 1 == max_new_tokens or not bool(unfinished.any()):
            break
        attention[:, length] = 1
        length += 1
        positions = positions + 1
        if not bool(unfinished.all()):
            kept = unfinished.nonzero().squeeze(1)
            going, new, attention, positions = going[kept], new[kept], attention[kept], positions[kept]
            select_rows(cache, kept)
        logits = target(input_ids=new[:, None], attention_mask=attention[:, :length], position_ids=positions, cache=cache,
                        use_cache=True, logits_to_keep=1).logits[:, -1]
    return answers


class _RecordScores(LogitsProcessor):
    """`generate`'s hook into a `_TopKRecorder`: every step's scores of all rows."""

    def __init__(self, recorder: _TopKRecorder):
        self.recorder, self.step = recorder, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.recorder.record(self.step, torch.arange(scores.shape[0]), scores)
        self.step += 1
        return scores


@torch.inference_mode()
def generate_batch(target: PreTrainedModel, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, pad: int, eos: int,
                   temperature: float = 0.0, recorder: _TopKRecorder | None = None) -> torch.Tensor:
    """`decode_batch` through transformers' `model.generate`: the reference it is tested and benchmarked against."""
    input_ids, attention = left_pad(prompts, pad)
    kwargs = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
    if recorder is not None:
        kwargs["logits_processor"] = LogitsProcessorList([_RecordScores(recorder)])
    generated = target.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                                pad_token_id=pad, eos_token_id=eos, **kwargs)[:, input_ids.shape[1]:]
    return torch.nn.functional.pad(generated, (0, max_new_tokens - generated.shape[1]), value=pad)


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


def _repair_tail(path: Path) -> None:
    """Cut a partial last line so appends start on a fresh line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return
        cut = data.rfind(b"\n") + 1
        f.truncate(cut)


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
    decode_attention: bool = True,
) -> dict[str, dict]:
    """Answer every prompt with the target, appending one JSONL record per answer; returns all records.

    Prompts are sorted by length so a batch pads little; with sampling, each batch is seeded from
    `seed` and its first id, so a resumed run samples what an uninterrupted one would have.
    With `teacher_cache`, the target's top-k log-probs at every answer token (temperature 1, full
    vocabulary) go into it too, so no second target pass is needed for offline distillation.
    `decode_attention`: decode steps use `modeling.attention.decode_attention` instead of SDPA's
    CPU flash kernel (faster for a batch; the same answers up to numerical near-ties).
    """
    if teacher_cache is not None and temperature > 0:
        raise ValueError("record the teacher during greedy generation only; for sampled answers use teacher.build_cache")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _repair_tail(out_path)
    done = read_done(out_path)
    todo = [p for p in prompts if str(p.id) not in done]
    seen: set[str] = set()
    for p in todo:
        if p.id in seen:
            raise ValueError(f"duplicate prompt id {p.id!r}")
        seen.add(p.id)
    encoded = sorted(((p, encode_chat(tokenizer, p.messages)) for p in todo), key=lambda x: len(x[1]))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    bar = tqdm(total=len(encoded), desc="target answers", unit="prompt", disable=not progress, file=sys.stderr)
    new_tokens = 0
    with open(out_path, "a", encoding="utf-8") as out:
        for start in range(0, len(encoded), batch_size):
            batch = encoded[start : start + batch_size]
            if temperature > 0:
                torch.manual_seed(seed + zlib.crc32(batch[0][0].id.encode()))
            recorder = None
            if teacher_cache is not None:
                recorder = _TopKRecorder(int(teacher_cache.meta["k"]), float(teacher_cache.meta["temperature"]),
                                         len(batch), max_new_tokens)
            with batched_decode_attention(target) if decode_attention else nullcontext():
                generated = decode_batch(target, [ids for _, ids in batch], max_new_tokens=max_new_tokens, pad=pad,
                                         eos=eos, temperature=temperature, recorder=recorder)
            answers = []
            for row in range(len(batch)):
                answer = generated[row].tolist()
                answers.append(answer[: answer.index(eos) + 1] if eos in answer else answer)
            if recorder is not None:
                entries = {}
                for row, ((p, ids), answer) in enumerate(zip(batch, answers)):
                    entries[p.id] = {"input_ids": torch.tensor(ids + answer, dtype=torch.int32),
                                     **recorder.rows(row, len(answer))}
                name = f"gen-{zlib.crc32('|'.join(p.id for p, _ in batch).encode()):08x}"
                teacher_cache.write_shard(name, entries)
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
