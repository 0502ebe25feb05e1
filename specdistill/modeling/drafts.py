"""Drafts built from their target: a few of its decoder layers, its embeddings, final norm and head.

A draft that starts from the target's own layers already shares its tokenizer and its residual
stream, which is why it needs far less distillation than an unrelated small model. The result is
an ordinary HF checkpoint directory that `AutoModelForCausalLM.from_pretrained`, vLLM's
`draft_model` method and transformers' `assistant_model=` load as they are.
"""

from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from specdistill import hardware, paths
from specdistill.modeling.attention import decode_attention_for
from specdistill.modeling.eagle3 import Eagle3Cache, Eagle3Draft
from specdistill.modeling.eagle3_files import META_FILE
from specdistill.modeling.kv_cache import preallocated_cache
from specdistill.modeling.lean import decode_forward
from specdistill.modeling.vocab import (
    DraftVocab,
    VocabReport,
    check_vocab,
    remap_draft_vocab,
    transplant_vocab,
    vocab_mismatch,
)


def parse_layers(spec: str | list[int], num_layers: int) -> list[int]:
    """Which target layers a draft keeps.

    `0,1,2,29` an explicit list; `evenly:K` K layers evenly spaced from first to last;
    `first:K` the first K-1 layers plus the last. Negative indices count from the end.
    """
    if isinstance(spec, (list, tuple)):
        layers = [int(x) for x in spec]
    else:
        spec = spec.strip()
        if spec.startswith("evenly:") or spec.startswith("first:"):
            kind, k = spec.split(":", 1)
            k = int(k)
            if not 1 <= k <= num_layers:
                raise ValueError(f"layer spec {spec!r}: K must be in 1..{num_layers}")
            if kind == "evenly":
                layers = [round(i * (num_layers - 1) / max(k - 1, 1)) for i in range(k)] if k > 1 else [num_layers - 1]
            else:
                layers = list(range(k - 1)) + [num_layers - 1]
        else:
            try:
                layers = [int(x) for x in spec.split(",") if x.strip()]
            except ValueError as exc:
                raise ValueError(f"layer spec {spec!r}: expected '0,1,2,29', 'evenly:K' or 'first:K'") from exc
    layers = [i + num_layers if i < 0 else i for i in layers]
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad or not layers:
        raise ValueError(f"layer spec {spec!r}: layers {bad or '[]'} outside the target's 0..{num_layers - 1}")
    if len(set(layers)) != len(layers) or layers != sorted(layers):
        raise ValueError(f"layer spec {spec!r}: layers must be distinct and increasing")
    return layers


def init_draft_from_target(target: PreTrainedModel, layers: list[int]) -> PreTrainedModel:
    """A new model with the target's embeddings, final norm, LM head and the chosen decoder layers."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in layers]
    draft = AutoModelForCausalLM.from_config(config, dtype=target.dtype)
    src = target.state_dict()
    dst = {}
    for name in draft.state_dict():
        if ".layers." in name:
            prefix, rest = name.split(".layers.", 1)
            j, tail = rest.split(".", 1)
            dst[name] = src[f"{prefix}.layers.{layers[int(j)]}.{tail}"]
        else:
            dst[name] = src[name]
    draft.load_state_dict(dst, strict=True)
    if getattr(config, "tie_word_embeddings", False):
        draft.tie_weights()
    draft.eval()
    return draft


@dataclass
class AlignedDraft:
    model: PreTrainedModel
    draft_vocab: DraftVocab | None
    transplanted: bool
    reason: str  # why it was transplanted ("" when the draft's ids already were the target's)
    report: VocabReport


def align_draft(
    model: PreTrainedModel,
    draft_tok: PreTrainedTokenizerBase,
    target_tok: PreTrainedTokenizerBase,
    draft_vocab: DraftVocab | None = None,
    *,
    target_vocab_size: int | None = None,
    copy_model: bool = True,
) -> AlignedDraft:
    """A draft made verifiable by a target: as it is when the target reads its token ids as they are
    (`vocab_mismatch`), else transplanted with its reduced vocabulary carried over. `copy_model=False`
    transplants the given model in place."""
    report = check_vocab(target_tok, draft_tok)
    reason = vocab_mismatch(report, model.config.vocab_size, target_vocab_size)
    if not reason:
        return AlignedDraft(model, draft_vocab, False, "", report)
    if copy_model:
        model = copy.deepcopy(model)
    transplant_vocab(model, draft_tok, target_tok)
    if draft_vocab is not None:
        draft_vocab = remap_draft_vocab(draft_vocab, draft_tok, target_tok)
    return AlignedDraft(model, draft_vocab, True, reason, report)


def save_draft(
    draft: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str | os.PathLike,
    *,
    draft_vocab: DraftVocab | None = None,
    meta: dict | None = None,
    force: bool = True,
) -> Path:
    """Write an HF checkpoint directory (config, safetensors, tokenizer) atomically (`paths.atomic_dir`)."""
    out_dir = Path(out_dir)
    with paths.atomic_dir(out_dir, DRAFT_OUTPUT, force=force) as tmp:
        draft.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if draft_vocab is not None:
            draft_vocab.save(tmp)
        (tmp / META_FILE).write_text(json.dumps(meta or {}, indent=2, default=str))
    return out_dir


DRAFT_OUTPUT = "draft"  # the output kind of every draft writer (layers, transplanted, EAGLE-3 head)


def load_draft_meta(directory: str | os.PathLike) -> dict:
    path = Path(directory) / META_FILE
    return paths.read_json(path, "draft metadata") if path.is_file() else {}


def early_exit_dir(fingerprint: str, exit_layer: int) -> Path:
    return paths.ensure(paths.home() / "fallback") / f"early-exit-{fingerprint}-{exit_layer}"


def export_early_exit_draft(target, exit_layer: int, out_dir: str | os.PathLike | None = None) -> Path:
    """Self-speculation as a servable draft checkpoint: the target's layers 0..k-1 with its embeddings,
    final norm and head, so vLLM's `draft_model` method (and SGLang STANDALONE) can serve it. Proposes
    exactly what `SelfSpecDrafter(target, k)` proposes. `target` is a `models.LoadedModel`."""
    n = target.config.num_hidden_layers
    if not 1 <= exit_layer < n:
        raise ValueError(f"exit layer must be in 1..{n - 1}, got {exit_layer}")
    out_dir = out_dir if out_dir is not None else early_exit_dir(target.fingerprint, exit_layer)
    draft = init_draft_from_target(target.model, list(range(exit_layer)))
    meta = {"kind": "early_exit", "exit_layer": exit_layer, "target_fingerprint": target.fingerprint,
            "target_dir": str(target.path)}
    return save_draft(draft, target.tokenizer, out_dir, meta=meta)


def measure_cost_ratio(
    target: PreTrainedModel,
    draft: PreTrainedModel | Eagle3Draft,
    *,
    draft_vocab: DraftVocab | None = None,
    context: int = 64,
    repeats: int = 15,
) -> float:
    """c = draft cost / target cost of one decode step (one token, KV cache of `context` tokens).

    For an EAGLE-3 head a step is fc over one position's target features, its layer with a cache of
    `context` entries, and its head over the draft vocabulary (the later steps of a round skip fc,
    so this is an upper bound). Measured side by side, interleaved, median of repeats: the machine
    is shared and noisy.
    """
    vocab_size = target.config.vocab_size
    ids = torch.randint(0, vocab_size, (1, context))
    step = torch.randint(0, vocab_size, (1, 1))

    def decode_target(cache):
        decode_forward(target, step, cache, sync=True)

    def decode_draft(cache):
        out = decode_forward(draft, step, cache, head=draft_vocab is None, sync=draft_vocab is None)
        if draft_vocab is not None:
            hardware.synchronize(draft_vocab.logits(out[:, -1], draft.get_output_embeddings().weight).device)

    def timed(fn, cache) -> float:
        extra = cache.get_seq_length() - context
        if extra:
            cache.crop(-extra)
        start = time.perf_counter()
        fn(cache)
        return time.perf_counter() - start

    # the decoding loop's steps: its attention, its forward, a preallocated cache for the target
    with decode_attention_for(target, None if isinstance(draft, Eagle3Draft) else draft):
        if isinstance(draft, Eagle3Draft):
            decode_draft, d_cache = _eagle3_step(draft, ids, step)
        else:
            d_cache = DynamicCache(config=draft.config)
            decode_forward(draft, ids, d_cache)
        t_cache = preallocated_cache(target, 1, context + 1)
        decode_forward(target, ids, t_cache)
        for _ in range(2):  # warm-up
            timed(decode_target, t_cache), timed(decode_draft, d_cache)
        ratios = []
        for _ in range(repeats):
            t = timed(decode_target, t_cache)
            d = timed(decode_draft, d_cache)
            ratios.append(d / t)
    ratios.sort()
    return ratios[len(ratios) // 2]


class _HeadCache(Eagle3Cache):
    """An Eagle3Cache with the two calls `measure_cost_ratio` makes on an HF cache."""

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, length: int) -> None:  # HF convention: a negative length drops that many entries
        super().crop(self.length + length if length < 0 else length)


def _eagle3_step(head: Eagle3Draft, ids: torch.Tensor, step: torch.Tensor):
    dtype = head.fc.weight.dtype
    context = ids.shape[1]
    cache = _HeadCache()
    features = torch.randn(1, context, 3 * head.config.target_hidden_size, dtype=dtype, device=head.fc.weight.device)
    head(ids, head.project(features), torch.arange(context)[None], cache)
    feature = features[:, -1:]
    position = torch.tensor([[context]])

    def decode(cache):
        hardware.synchronize(head.logits(head(step, head.project(feature), position, cache)).device)

    return decode, cache
