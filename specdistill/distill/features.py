"""Target features for EAGLE-3 heads: the inputs of three target decoder layers, stored in bf16 shards.

The answer pass records them on the way (`pipeline.stages.answers.harness.generate_answers(feature_cache=...)`),
so it is the only target pass the training data needs. Answers from elsewhere get one teacher-forced pass
(about one prefill each, `build_feature_cache`), which can also write the top-k teacher rows.

Stored positions: for a sequence of length L whose first answer token sits at p, start..L-2 with
start = p-1-prompt_context (clamped at 0; None keeps the whole prompt), so the head's attention sees the
prompt as when drafting. Position t pairs with token t+1, so L-1 has no use.

A cache records the target fingerprint, layer ids, data hash, prompt context and dtype; opening it for
another target or layer set fails naming the mismatch, and each entry's token ids refuse other data.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import zlib
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import PreTrainedModel

from specdistill.distill.losses import topk_rows
from specdistill.distill.night_files import FEATURE_META
from specdistill.distill.teacher import (
    ShardCache,
    TeacherCache,
    data_hash,
    pad_batch,
    teacher_positions,
    vocab_key,
)
from specdistill.modeling.feature_hooks import FeatureHooks
from specdistill.modeling.vocab import DraftVocab

FEATURE_DTYPE = torch.bfloat16


class StaleFeatureCacheError(ValueError):
    """A feature cache written for another target, layer set, prompt context or data."""


class FeatureCacheTooLargeError(ValueError):
    """The feature cache a run would write does not fit its configured disk budget."""


def feature_start(assistant_mask: Sequence[bool], prompt_context: int | None) -> int:
    """First stored position: the last prompt position minus `prompt_context` (None: 0, the whole prompt)."""
    first_answer = next((t for t in range(1, len(assistant_mask)) if assistant_mask[t]), len(assistant_mask))
    if prompt_context is None:
        return 0
    return max(0, first_answer - 1 - prompt_context)


def bytes_per_token(hidden_size: int, n_layers: int = 3) -> int:
    """Disk bytes of one position's features: n_layers · hidden · 2 (bf16)."""
    return n_layers * hidden_size * torch.finfo(FEATURE_DTYPE).bits // 8


def check_budget(examples: Sequence, hidden_size: int, prompt_context: int | None, max_bytes: float | None,
                 n_layers: int = 3) -> tuple[int, int]:
    """(positions, bytes) the cache will hold; fails before any work when over `max_bytes`."""
    positions = sum(max(0, len(ex.input_ids) - 1 - feature_start(ex.assistant_mask, prompt_context))
                    for ex in examples)
    per = bytes_per_token(hidden_size, n_layers)
    size = positions * per
    if max_bytes is not None and size > max_bytes:
        raise FeatureCacheTooLargeError(
            f"feature cache needs {size / 1e9:.3f} GB ({positions} positions x {per} bytes: {n_layers} layers x "
            f"{hidden_size} x bf16) for {len(examples)} sequences, over the budget of {max_bytes / 1e9:.3f} GB: "
            f"raise the budget, store less prompt context, or train on fewer sequences")
    return positions, size


def choose_features(setting: str, examples: Sequence, hidden_size: int, prompt_context: int | None,
                    max_gb: float | None, n_layers: int = 3) -> tuple[str, str]:
    """`eagle3.features` resolved to cache or online, and why in one line. `auto`: online exactly when the
    cache these examples need would exceed `eagle3.feature_max_gb` (the budget that refuses a cache)."""
    if setting != "auto":
        return setting, f"eagle3.features={setting}"
    positions, size = check_budget(examples, hidden_size, prompt_context, None, n_layers)
    over = max_gb is not None and size > max_gb * 1e9
    return ("online" if over else "cache",
            f"auto: a feature cache of {size / 1e9:.3f} GB ({positions} positions) is "
            f"{'over' if over else 'within'} eagle3.feature_max_gb={max_gb}")


class FeatureCache(ShardCache):
    """Shards of per sequence its token ids, first stored position and features."""

    META = FEATURE_META
    WHAT = "feature cache"
    Stale = StaleFeatureCacheError

    @classmethod
    def create(cls, directory, *, fingerprint: str, layers: list[int], data: str, prompt_context: int | None) -> FeatureCache:
        key = {"fingerprint": fingerprint, "layers": list(layers), "data": data, "prompt_context": prompt_context}
        return cls._create(directory, {**key, "dtype": "bfloat16"}, key)

    @classmethod
    def open(cls, directory, *, fingerprint: str, layers: list[int], data: str | None = None,
             prompt_context: int | None | str = "any") -> FeatureCache:
        wanted = {"fingerprint": fingerprint, "layers": list(layers), "data": data}
        if prompt_context != "any":
            wanted["prompt_context"] = prompt_context
        return cls._open(directory, wanted)

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.dir.glob("shard-*.safetensors"))


def entry_features(entry: dict[str, torch.Tensor] | None, ex_id: str, input_ids: Sequence[int], start: int) -> torch.Tensor:
    """The features `[len - 1 - start, F]` of this sequence from its cache entry, checked: the entry must
    have been written for these token ids (or a longer sequence they begin: the answer pass stores
    whole answers, training may truncate them) from the expected first position."""
    if entry is None:
        raise StaleFeatureCacheError(f"feature cache has no entry for example {ex_id!r}")
    cached = entry["input_ids"].tolist()
    if cached[: len(input_ids)] != list(input_ids):
        raise StaleFeatureCacheError(f"feature cache entry {ex_id!r} was written for other token ids")
    rows = len(input_ids) - 1 - start
    if int(entry["start"]) != start or entry["features"].shape[0] != len(cached) - 1 - start:
        raise StaleFeatureCacheError(
            f"feature cache entry {ex_id!r} stores positions from {int(entry['start'])} "
            f"({entry['features'].shape[0]} rows), this run needs them from {start}")
    return entry["features"][:rows]


class _Done(Exception):
    """Raised in the last feature layer's pre-hook: the layers above it are not needed."""


class OnlineFeatures:
    """`eagle3.features: online`: the target's feature pass inside each training batch, nothing on disk.

    Returns the batch's (`Eagle3Example`s) features [B, T, 3·H] as `collate_eagle3` lays out cached ones,
    in bf16, from the forward a cache build runs; the target stops at the last feature layer."""

    def __init__(self, target: PreTrainedModel, layers: list[int], dtype: torch.dtype):
        self.target = target if target.dtype == dtype else copy.deepcopy(target).to(dtype)
        self.target.eval().requires_grad_(False)
        self.hooks = FeatureHooks(self.target, layers)
        self.target.model.layers[max(layers)].register_forward_pre_hook(self._stop)

    @staticmethod
    def _stop(module, args):
        raise _Done

    @torch.no_grad()  # not inference mode: the features enter the head's autograd graph as inputs
    def __call__(self, examples: Sequence) -> torch.Tensor:
        input_ids, attention = pad_batch([ex.ids.tolist() for ex in examples])
        with contextlib.suppress(_Done):
            self.target.model(input_ids=input_ids.to(self.target.device), attention_mask=attention.to(self.target.device))
        features = self.hooks.take()
        out = torch.zeros(len(examples), max(ex.entries for ex in examples), features.shape[-1], dtype=FEATURE_DTYPE)
        for row, ex in enumerate(examples):
            out[row, : ex.entries] = features[row, ex.start : ex.start + ex.entries].to("cpu", FEATURE_DTYPE)
        return out


@torch.inference_mode()
def build_feature_cache(
    target: PreTrainedModel,
    examples: Sequence,
    directory: str | os.PathLike,
    *,
    fingerprint: str,
    layers: list[int],
    prompt_context: int | None = None,
    max_bytes: float | None = None,
    teacher_dir: str | os.PathLike | None = None,
    k: int = 32,
    temperature: float = 1.0,
    draft_vocab: DraftVocab | None = None,
    batch_size: int = 8,
    progress: bool = True,
    extend: bool = False,
) -> FeatureCache | None:
    """Run the target once over the examples and store the feature layers' inputs (bf16); with
    `teacher_dir`, the same forward also writes the top-k teacher rows there. Resumable per shard;
    the disk budget is checked before the first forward. With `extend`, an existing cache of the
    same target, layers and prompt context (the answer pass's) gets just the examples it lacks."""
    directory = None if directory is None else Path(directory)  # None: the teacher rows only (`features: online`)
    existing = extend and directory is not None and (directory / FEATURE_META).is_file()
    cache = None
    if existing:
        if teacher_dir is not None:
            raise ValueError("extend a feature cache without a teacher: its examples' teacher rows exist already")
        cache = FeatureCache.open(directory, fingerprint=fingerprint, layers=layers, prompt_context=prompt_context)
        have = cache.ids()
        examples = [ex for ex in examples if str(ex.id) not in have]
    check_budget(examples, target.config.hidden_size, prompt_context, None if directory is None else max_bytes, len(layers))
    data = data_hash(examples)
    if not existing and directory is not None:
        cache = FeatureCache.create(directory, fingerprint=fingerprint, layers=layers, data=data, prompt_context=prompt_context)
    teacher = None
    if teacher_dir is not None:
        teacher = TeacherCache.create(teacher_dir, fingerprint=fingerprint, k=k, temperature=temperature,
                                      vocab=vocab_key(draft_vocab), data=data)
    head = target.get_output_embeddings().weight
    bar = tqdm(total=len(examples), desc="target features" if layers else "teacher cache", unit="seq",
               disable=not progress, file=sys.stderr)
    with FeatureHooks(target, layers) if cache is not None else contextlib.nullcontext() as hooks:
        for begin in range(0, len(examples), batch_size):
            batch = examples[begin : begin + batch_size]
            # extending: named by content, since the examples still missing shift on a resume
            name = f"x{zlib.crc32('|'.join(str(ex.id) for ex in batch).encode()):08x}" if existing else f"{begin:07d}"
            if (cache is None or cache.has_shard(name)) and (teacher is None or teacher.has_shard(name)):
                bar.update(len(batch))
                continue
            input_ids, attention = pad_batch([ex.input_ids for ex in batch])
            hidden = target.model(input_ids=input_ids.to(target.device), attention_mask=attention.to(target.device)).last_hidden_state
            features = hooks.take() if cache is not None else None
            entries, rows = {}, {}
            for row, ex in enumerate(batch):
                ids = torch.tensor(ex.input_ids, dtype=torch.int32)
                if features is not None:
                    start = feature_start(ex.assistant_mask, prompt_context)
                    entries[str(ex.id)] = {"input_ids": ids, "start": torch.tensor(start, dtype=torch.int64),
                                           "features": features[row, start : len(ex.input_ids) - 1].to("cpu", FEATURE_DTYPE)}
                if teacher is not None:
                    h = hidden[row, torch.tensor(teacher_positions(ex.assistant_mask), dtype=torch.long, device=hidden.device)]
                    logits = draft_vocab.logits(h, head) if draft_vocab is not None else h @ head.T
                    top, idx, res = (t.cpu() for t in topk_rows(logits, k, temperature))  # shards are written from the CPU
                    rows[str(ex.id)] = {"input_ids": ids, "logprobs": top, "indices": idx, "residual": res}
            if teacher is not None:
                teacher.write_shard(name, rows)
            if cache is not None:
                cache.write_shard(name, entries)
            bar.update(len(batch))
    bar.close()
    return cache


def build_cache(target: PreTrainedModel, examples: Sequence, directory: str | os.PathLike, *, fingerprint: str,
                k: int = 32, temperature: float = 1.0, draft_vocab: DraftVocab | None = None, batch_size: int = 8,
                progress: bool = True) -> TeacherCache:
    """The teacher rows alone: run the target once over the examples and store its top-k rows (in the
    draft's vocabulary space when a reduced vocabulary is given, so the cached residual is exact there)."""
    build_feature_cache(target, examples, None, fingerprint=fingerprint, layers=[], teacher_dir=directory, k=k,
                        temperature=temperature, draft_vocab=draft_vocab, batch_size=batch_size, progress=progress)
    return TeacherCache.open(directory, fingerprint=fingerprint)
