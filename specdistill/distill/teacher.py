"""The teacher signal: the target's distribution at every assistant position.

Online, the target runs inside the training step (exact, but a 30-layer forward per batch). Offline, its
top-k log-probs, their ids and the residual mass are written once into shards, reused across epochs and
runs; a cache records the target fingerprint, k, temperature and vocabulary, and each entry its token ids,
so a cache from another target or for other data is refused, never silently trained on.

Row i of an example (ids x, assistant mask m) is p(· | x[:t_i]), for the t ≥ 1 with m[t] true, in order.
"""

from __future__ import annotations

import hashlib
import os
import sys
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel

from specdistill import paths
from specdistill.distill import shards
from specdistill.distill.losses import TopKTeacher
from specdistill.distill.night_files import CACHE_META
from specdistill.modeling.vocab import DraftVocab


class StaleTeacherCacheError(ValueError):
    """A cache written for another target, data, k, temperature or vocabulary."""


def vocab_key(draft_vocab: DraftVocab | None) -> str:
    if draft_vocab is None:
        return "full"
    digest = hashlib.sha256(draft_vocab.token_ids.numpy().tobytes()).hexdigest()[:12]
    return f"draft{draft_vocab.size}-{digest}"


def data_hash(examples: Iterable) -> str:
    h = hashlib.sha256()
    for ex in examples:
        h.update(str(ex.id).encode())
        h.update(torch.tensor(ex.input_ids, dtype=torch.int64).numpy().tobytes())
        h.update(bytes(bytearray(int(b) for b in ex.assistant_mask)))
    return h.hexdigest()[:16]


def teacher_positions(assistant_mask: Sequence[bool]) -> list[int]:
    """Logit positions whose next token is an assistant token."""
    return [t - 1 for t in range(1, len(assistant_mask)) if assistant_mask[t]]


class ShardCache:
    """A directory of checksummed safetensors shards (`distill.shards`), one entry per example id, under
    a JSON key file (`META`) naming what they were written for: writing resumes only into a cache of
    the same key, and a reader asking for another value of a key is refused (`Stale`), naming it."""

    META: typing.ClassVar[str]
    WHAT: typing.ClassVar[str]  # what messages call it
    Stale: typing.ClassVar[type[ValueError]]

    def __init__(self, directory: str | os.PathLike, meta: dict):
        self.dir = Path(directory)
        self.meta = meta

    @classmethod
    def _create(cls, directory, meta: dict, key: dict) -> typing.Self:
        """Open for writing under `meta`; an existing cache must carry `key` (then writing resumes)."""
        if (Path(directory) / cls.META).is_file():
            return cls._open(directory, key)
        # 0700: the cache holds answers to production traffic
        paths.atomic_write_json(paths.ensure_private(Path(directory)) / cls.META, meta)
        return cls(directory, meta)

    @classmethod
    def _open(cls, directory, wanted: dict) -> typing.Self:
        """Open for reading, refusing a cache written for another value of a key in `wanted` (None: any)."""
        directory = Path(directory)
        meta_path = directory / cls.META
        if not meta_path.is_file():
            raise FileNotFoundError(f"no {cls.WHAT} at {directory} ({cls.META} missing)")
        meta = paths.read_json(meta_path, "cache file")
        if not isinstance(meta, dict):
            raise ValueError(f"corrupt cache file {meta_path}: expected a JSON object")
        for key, value in wanted.items():
            if value is not None and meta.get(key) != value:
                raise cls.Stale(f"{cls.WHAT} {directory} was written for {key}={meta.get(key)!r}, "
                                f"this run needs {key}={value!r}: rebuild it")
        return cls(directory, meta)

    def write_shard(self, name: str, entries: dict[str, dict[str, torch.Tensor]]) -> Path:
        tensors = {f"{ex_id}/{key}": t for ex_id, rows in entries.items() for key, t in rows.items()}
        return shards.write_shard(self.dir / f"shard-{name}.safetensors", tensors)

    def has_shard(self, name: str) -> bool:
        return (self.dir / f"shard-{name}.safetensors").is_file()

    def ids(self) -> set[str]:
        """Ids in the shards' headers (cheap; a shard with an unreadable header is quarantined)."""
        keys = shards.header_keys(sorted(self.dir.glob(shards.SHARD_GLOB)))
        return {key[: -len("/input_ids")] for key in keys if key.endswith("/input_ids")}

    def __len__(self) -> int:
        return len(self.ids())

    def verified_ids(self) -> tuple[set[str], list[str]]:
        """Ids whose entries are in a shard that passes its checksum; bad shards are quarantined (and listed)."""
        return shards.verified_keys(self.dir, "input_ids")

    def load_all(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every entry in memory (teacher rows: a few MB per thousand answers at k=32), so epochs read no disk.
        Every shard is verified; a bad one is quarantined and named (`shards.CorruptShardError`)."""
        return shards.load_shards(self.dir)


class TeacherCache(ShardCache):
    """Shards of top-k teacher rows, keyed by target fingerprint, k, temperature, vocabulary and data."""

    META = CACHE_META
    WHAT = "teacher cache"
    Stale = StaleTeacherCacheError

    @classmethod
    def create(cls, directory, *, fingerprint: str, k: int, temperature: float, vocab: str, data: str = "") -> TeacherCache:
        meta = {"fingerprint": fingerprint, "k": k, "temperature": temperature, "vocab": vocab, "data": data}
        return cls._create(directory, meta, meta)

    @classmethod
    def open(cls, directory, *, fingerprint: str, k: int | None = None, temperature: float | None = None,
             vocab: str | None = None, data: str | None = None) -> TeacherCache:
        return cls._open(directory, {"fingerprint": fingerprint, "k": k, "temperature": temperature, "vocab": vocab,
                                     "data": data})

    @classmethod
    def for_training(cls, directory, *, fingerprint: str, temperature: float, draft_vocab: DraftVocab | None) -> TeacherCache:
        """The cache a training run reads: this target's, written at the loss's temperature, over the full
        vocabulary or this draft vocabulary."""
        cache = cls.open(directory, fingerprint=fingerprint)
        if cache.meta["temperature"] != temperature:
            raise ValueError(f"teacher cache {directory} holds temperature {cache.meta['temperature']}, "
                             f"loss.temperature is {temperature}")
        if cache.meta["vocab"] not in ("full", vocab_key(draft_vocab)):
            raise ValueError(f"teacher cache {directory} was written for vocabulary {cache.meta['vocab']}")
        return cache


def stale_reason(entry: dict[str, torch.Tensor], ex_id: str, input_ids: Sequence[int], n_rows: int) -> str | None:
    """Why a cache entry does not describe exactly this sequence (None when it does)."""
    if entry["input_ids"].tolist()[: len(input_ids)] != list(input_ids):
        return f"teacher cache entry {ex_id!r} was written for other token ids"
    if entry["logprobs"].shape[0] < n_rows:
        return f"teacher cache entry {ex_id!r} has {entry['logprobs'].shape[0]} rows, the example needs {n_rows}"
    return None


def check_entry(entry: dict[str, torch.Tensor], ex_id: str, input_ids: Sequence[int], n_rows: int) -> None:
    why = stale_reason(entry, ex_id, input_ids, n_rows)
    if why:
        raise StaleTeacherCacheError(why)


def drop_stale(examples: Sequence, rows: dict[str, dict[str, torch.Tensor]], source: str | os.PathLike) -> tuple[list, list[str]]:
    """The examples whose teacher entry describes exactly their tokens, and the ids of the others: a stale
    entry (another answer to the same prompt: reduced-precision greedy answers can differ between nights at
    near-ties) is dropped and counted, never fatal; a missing one is an error (the cache is other data's)."""
    kept, stale = [], []
    for ex in examples:
        entry = rows.get(str(ex.id))
        if entry is None:
            raise ValueError(f"teacher cache {source} has no entry for example {ex.id!r}")
        if stale_reason(entry, str(ex.id), ex.input_ids, len(teacher_positions(ex.assistant_mask))):
            stale.append(str(ex.id))
        else:
            kept.append(ex)
    if stale:
        print(f"teacher cache {source}: {len(stale)} of {len(examples)} examples dropped, their entries were "
              f"written for other token ids ({', '.join(stale[:5])}{', ...' if len(stale) > 5 else ''})",
              file=sys.stderr)
    if examples and not kept:
        raise StaleTeacherCacheError(f"teacher cache {source}: every entry was written for other token ids: rebuild it")
    return kept, stale


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right padding for training/teacher forwards (causal: padding after a sequence never affects it)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = torch.tensor(list(s), dtype=torch.long)
        attention[row, : len(s)] = 1
    return ids, attention


def to_draft_space(teacher: TopKTeacher, draft_vocab: DraftVocab) -> TopKTeacher:
    """A full-vocabulary top-k teacher seen by a reduced-vocabulary draft: entries outside the kept tokens
    are marked invalid, the rest and the residual renormalized. The residual then also holds the
    out-of-vocabulary mass below the top k, a small overestimate (the top k usually hold > 95%)."""
    mapped = draft_vocab.to_draft_ids(teacher.indices)
    valid = mapped >= 0
    logprobs = teacher.logprobs.masked_fill(~valid, float("-inf"))
    kept = logprobs.exp().sum(-1) + teacher.residual
    norm = kept.clamp_min(1e-12)
    fallback = mapped.masked_fill(~valid, 0).max(dim=-1, keepdim=True).values  # any valid id, for padding
    indices = torch.where(valid, mapped, fallback.expand_as(mapped))
    return TopKTeacher(logprobs - norm.log().unsqueeze(-1), indices, teacher.residual / norm, valid)


class OnlineTeacher:
    """The target's forward pass inside the training step; returns logits at the requested positions."""

    def __init__(self, target: PreTrainedModel, draft_vocab: DraftVocab | None = None, with_hidden: bool = False):
        self.target = target.eval().requires_grad_(False)
        self.draft_vocab = draft_vocab
        self.with_hidden = with_hidden

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor):
        """positions: bool [B, T]; returns (logits [N, V'], last hidden [N, H] or None)."""
        hidden = self.target.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[positions]
        head = self.target.get_output_embeddings().weight
        logits = self.draft_vocab.logits(hidden, head) if self.draft_vocab is not None else hidden @ head.T
        return logits, (hidden if self.with_hidden else None)
