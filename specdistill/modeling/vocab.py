"""Vocabulary alignment between a draft and its target.

Verification compares token ids, so a draft must tokenize exactly as its target does or the target
rejects nearly everything. This module reports how two tokenizers differ (`check_vocab`), rebuilds a
draft's embedding and LM head over the target's vocabulary (`transplant_vocab`), and builds the
reduced draft vocabulary of FR-Spec / EAGLE-3 (`DraftVocab`); `vocab_mismatch` says whether a draft's
ids can be verified as they are (`drafts.align_draft` transplants when they cannot).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

import torch
from safetensors.torch import load_file, save
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdistill import paths

# The reduced-vocabulary map lives in a subdirectory: serving engines load every `*.safetensors` file
# beside a checkpoint's weights as weights (vLLM's `draft_model` then fails on an unknown `d2t`).
DRAFT_VOCAB_FILE = "draft_vocab/draft_vocab.safetensors"
LEGACY_DRAFT_VOCAB_FILE = "draft_vocab.safetensors"  # where drafts saved before kept it; still read


def draft_vocab_path(directory: str | Path) -> Path | None:
    """The draft vocabulary map of a checkpoint directory (its current place, else the legacy one), or None."""
    for name in (DRAFT_VOCAB_FILE, LEGACY_DRAFT_VOCAB_FILE):
        if (Path(directory) / name).is_file():
            return Path(directory) / name
    return None


# Strings that show segmentation differences a user cares about: code, finance, chat scaffolding.
PROBE_STRINGS = [
    "Hello, how can I help you today?",
    "def fibonacci(n: int) -> int:\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "import numpy as np\nimport torch.nn.functional as F",
    "QuantLib CalcBlackScholesVega implied volatility",
    "The mitochondria is the powerhouse of the cell.",
    "  indented\tline with tabs\n\n",
    "naïve café — 東京 🚀",
]


class VocabAlignmentError(ValueError):
    """Two models whose vocabularies or shapes cannot be aligned; the message names what differs."""


@dataclass
class VocabReport:
    target_size: int
    draft_size: int
    shared_tokens: int
    id_mismatches: int
    only_in_target: int
    only_in_draft: int
    id_mismatch_examples: list[tuple[str, int, int]] = field(default_factory=list)
    only_in_target_examples: list[str] = field(default_factory=list)
    special_tokens: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)
    special_tokens_differ: list[str] = field(default_factory=list)
    chat_template_identical: bool = True
    chat_template_diff: str = ""
    segmentation_differences: list[dict] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return (
            self.target_size == self.draft_size
            and self.id_mismatches == 0
            and self.only_in_target == 0
            and self.only_in_draft == 0
            and not self.special_tokens_differ
            and self.chat_template_identical
            and not self.segmentation_differences
        )

    def to_dict(self) -> dict:
        return {**asdict(self), "identical": self.identical}

    def render(self) -> str:
        lines = [
            f"vocabulary size      target {self.target_size:>7}   draft {self.draft_size:>7}",
            f"shared tokens        {self.shared_tokens}",
            f"same string, new id  {self.id_mismatches}",
            f"only in target       {self.only_in_target}",
            f"only in draft        {self.only_in_draft}",
        ]
        lines += [f"  id differs: {tok!r} target {tid} draft {did}" for tok, tid, did in self.id_mismatch_examples[:5]]
        lines += [f"  target-only token: {tok!r}" for tok in self.only_in_target_examples[:5]]
        lines.append("special tokens       " + ("identical" if not self.special_tokens_differ else "DIFFER"))
        for name in self.special_tokens_differ:
            t, d = self.special_tokens[name]
            lines.append(f"  {name}: target {t!r} draft {d!r}")
        lines.append("chat template        " + ("identical" if self.chat_template_identical else "DIFFERS"))
        if self.chat_template_diff:
            lines.append("  " + self.chat_template_diff)
        lines.append(f"segment differently  {len(self.segmentation_differences)} probe strings")
        lines += [f"  {d['text']!r}: target {d['target']} | draft {d['draft']}" for d in self.segmentation_differences[:6]]
        lines.append("verdict              " + ("IDENTICAL" if self.identical else "NOT ALIGNED"))
        return "\n".join(lines)


def _special_tokens(tok: PreTrainedTokenizerBase) -> dict[str, str | None]:
    names = ("bos_token", "eos_token", "unk_token", "pad_token")
    out = {name: getattr(tok, name, None) for name in names}
    out["additional_special_tokens"] = ",".join(sorted(tok.all_special_tokens))
    return out


def _render_template(tok: PreTrainedTokenizerBase) -> str | None:
    if not getattr(tok, "chat_template", None):
        return None
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
    ]
    try:
        return tok.apply_chat_template(messages, tokenize=False)
    except Exception as exc:  # a template may refuse a system turn
        return f"<template error: {exc}>"


MAX_EXAMPLES = 20


def check_vocab(target_tok: PreTrainedTokenizerBase, draft_tok: PreTrainedTokenizerBase) -> VocabReport:
    """Compare two tokenizers the way verification will see them: ids, specials, template, segmentation."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    shared = tv.keys() & dv.keys()
    mismatched = sorted((t for t in shared if tv[t] != dv[t]), key=lambda t: tv[t])
    only_t = sorted(tv.keys() - dv.keys(), key=lambda t: tv[t])
    only_d = dv.keys() - tv.keys()

    ts, ds = _special_tokens(target_tok), _special_tokens(draft_tok)
    specials = {k: (ts[k], ds.get(k)) for k in ts}
    specials_differ = [k for k, (a, b) in specials.items() if a != b]

    t_render, d_render = _render_template(target_tok), _render_template(draft_tok)
    template_same = (target_tok.chat_template or "") == (draft_tok.chat_template or "")
    template_diff = "" if template_same else f"target renders {t_render!r}; draft renders {d_render!r}"

    probes = PROBE_STRINGS + [target_tok.convert_tokens_to_string([t]) for t in only_t if len(t) > 3][:10]
    seg = []
    for text in probes:
        a = target_tok.tokenize(text)
        b = draft_tok.tokenize(text)
        if a != b:
            seg.append({"text": text, "target": a, "draft": b})

    return VocabReport(
        target_size=len(target_tok),
        draft_size=len(draft_tok),
        shared_tokens=len(shared),
        id_mismatches=len(mismatched),
        only_in_target=len(only_t),
        only_in_draft=len(only_d),
        id_mismatch_examples=[(t, tv[t], dv[t]) for t in mismatched[:MAX_EXAMPLES]],
        only_in_target_examples=only_t[:MAX_EXAMPLES],
        special_tokens=specials,
        special_tokens_differ=specials_differ,
        chat_template_identical=template_same,
        chat_template_diff=template_diff,
        segmentation_differences=seg,
    )


def transplant_vocab(
    draft: PreTrainedModel,
    draft_tok: PreTrainedTokenizerBase,
    target_tok: PreTrainedTokenizerBase,
) -> PreTrainedModel:
    """Rebuild the draft's embedding and LM head over the target's vocabulary, matching by string.

    A token the draft already has keeps its row; a new token starts as the mean of the draft's rows
    for the pieces the draft splits it into (the mean of all rows if it has no pieces).
    """
    old_in = draft.get_input_embeddings().weight.detach()
    old_out_layer = draft.get_output_embeddings()
    tied = bool(getattr(draft.config, "tie_word_embeddings", False))
    old_out = None if (tied or old_out_layer is None) else old_out_layer.weight.detach()
    hidden = old_in.shape[1]
    dv = draft_tok.get_vocab()
    tv = target_tok.get_vocab()
    new_size = max(len(target_tok), max(tv.values()) + 1)

    new_in = old_in.mean(0, keepdim=True).repeat(new_size, 1)
    new_out = None if old_out is None else old_out.mean(0, keepdim=True).repeat(new_size, 1)
    for token, tid in tv.items():
        did = dv.get(token)
        if did is not None and did < old_in.shape[0]:
            pieces = [did]
        else:
            text = target_tok.convert_tokens_to_string([token])
            pieces = [p for p in draft_tok.encode(text, add_special_tokens=False) if p < old_in.shape[0]]
        if pieces:
            new_in[tid] = old_in[pieces].mean(0)
            if new_out is not None:
                new_out[tid] = old_out[pieces].mean(0)

    embedding = torch.nn.Embedding(new_size, hidden, dtype=old_in.dtype)
    embedding.weight.data.copy_(new_in)
    draft.set_input_embeddings(embedding)
    head = torch.nn.Linear(hidden, new_size, bias=False, dtype=old_in.dtype)
    head.weight.data.copy_(new_in if new_out is None else new_out)
    draft.set_output_embeddings(head)
    draft.config.vocab_size = new_size
    if tied:
        draft.tie_weights()
    for config in (draft.config, getattr(draft, "generation_config", None)):
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if config is not None:
                setattr(config, name, getattr(target_tok, name, None))
    return draft


def vocab_mismatch(report: VocabReport, draft_vocab_size: int | None = None, target_vocab_size: int | None = None) -> str:
    """Why the target cannot verify a draft's token ids as they are, or "" when it can.

    Ids are what verification compares: a mismatch is a different vocabulary size (of the models,
    when given) or a token string with another id or missing on one side. Special-token names, chat
    templates and segmentation quirks with the same ids are in the report, not a mismatch.
    """
    if draft_vocab_size is not None and target_vocab_size is not None and draft_vocab_size != target_vocab_size:
        return f"vocabulary sizes differ: target {target_vocab_size}, draft {draft_vocab_size}"
    if report.id_mismatches or report.only_in_target or report.only_in_draft:
        return (f"tokenizers differ: {report.only_in_target} tokens only in the target, "
                f"{report.only_in_draft} only in the draft, {report.id_mismatches} with other ids")
    return ""


@dataclass
class DraftVocab:
    """The N target tokens a draft may propose (FR-Spec / EAGLE-3's reduced draft vocabulary).

    `token_ids[i]` is the target id of draft token i. Saved in EAGLE-3's convention, which vLLM
    reads: `d2t[i] = token_ids[i] - i` (an offset) and `t2d` a boolean mask over the target vocab.
    """

    token_ids: torch.Tensor  # LongTensor [N], sorted ascending
    target_vocab_size: int

    def __post_init__(self):
        self.token_ids = torch.as_tensor(self.token_ids, dtype=torch.long).sort().values
        if self.token_ids.numel() == 0:
            raise VocabAlignmentError("a draft vocabulary needs at least one token")
        if int(self.token_ids[-1]) >= self.target_vocab_size or int(self.token_ids[0]) < 0:
            raise VocabAlignmentError(
                f"draft vocabulary has ids outside the target vocabulary of {self.target_vocab_size}"
            )
        if self.token_ids.unique().numel() != self.token_ids.numel():
            raise VocabAlignmentError("draft vocabulary has duplicate token ids")

    @property
    def size(self) -> int:
        return self.token_ids.numel()

    @property
    def d2t(self) -> torch.Tensor:
        return self.token_ids - torch.arange(self.size)

    @property
    def t2d(self) -> torch.Tensor:
        mask = torch.zeros(self.target_vocab_size, dtype=torch.bool)
        mask[self.token_ids] = True
        return mask

    @cached_property
    def _target_to_draft(self) -> torch.Tensor:
        lookup = torch.full((self.target_vocab_size,), -1, dtype=torch.long)
        lookup[self.token_ids] = torch.arange(self.size)
        return lookup

    def to_draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """The draft id of each target id, or -1 where the draft vocabulary lacks the token."""
        return self._target_to_draft.to(target_ids.device)[target_ids.long()]

    def logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Draft logits over the N kept tokens only: the cheap head that makes drafting fast."""
        w = lm_head_weight.index_select(0, self.token_ids.to(lm_head_weight.device))
        return hidden @ w.T

    def to_full(self, probs: torch.Tensor) -> torch.Tensor:
        full = probs.new_zeros(*probs.shape[:-1], self.target_vocab_size)
        full.index_copy_(-1, self.token_ids.to(probs.device), probs)
        return full

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.token_ids.to(draft_ids.device)[draft_ids]

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / DRAFT_VOCAB_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        data = save({"d2t": self.d2t.contiguous(), "t2d": self.t2d.contiguous()})
        return paths.atomic_write_bytes(path, data, mode=paths.PUBLIC_FILE_MODE)  # never through a link at its name

    @classmethod
    def load(cls, directory: str | Path) -> DraftVocab | None:
        path = draft_vocab_path(directory)
        if path is None:
            return None
        try:
            tensors = load_file(str(path))
            d2t, t2d = tensors["d2t"], tensors["t2d"]
        except Exception as exc:
            raise VocabAlignmentError(f"corrupt draft vocabulary file {path}: {exc}") from exc
        token_ids = d2t + torch.arange(d2t.numel())
        vocab = cls(token_ids, t2d.numel())
        if not torch.equal(vocab.t2d, t2d.bool()):
            raise VocabAlignmentError(f"{path}: d2t and t2d disagree")
        return vocab


def token_frequencies(tokenizer: PreTrainedTokenizerBase, texts: Iterable[str]) -> Counter:
    counts: Counter = Counter()
    for text in texts:
        counts.update(tokenizer.encode(text, add_special_tokens=False))
    return counts


def build_draft_vocab(
    counts: Counter,
    size: int,
    target_vocab_size: int,
    always_include: Iterable[int] = (),
) -> DraftVocab:
    """The `size` most frequent tokens in traffic, plus the ones the draft must always be able to say (EOS)."""
    must = [int(t) for t in always_include if t is not None]
    if size < len(must) + 1:
        raise VocabAlignmentError(f"draft vocabulary size {size} is too small")
    if size > target_vocab_size:
        raise VocabAlignmentError(f"draft vocabulary size {size} exceeds the target's {target_vocab_size}")
    chosen = dict.fromkeys(must)
    for tid, _ in counts.most_common():
        if len(chosen) >= size:
            break
        if 0 <= tid < target_vocab_size:
            chosen.setdefault(tid)
    fill = 0  # traffic too small to fill the budget: take the lowest ids (bytes and common merges)
    while len(chosen) < size:
        chosen.setdefault(fill)
        fill += 1
    return DraftVocab(torch.tensor(list(chosen)), target_vocab_size)


def remap_draft_vocab(vocab: DraftVocab, old_tok: PreTrainedTokenizerBase, new_tok: PreTrainedTokenizerBase) -> DraftVocab:
    """Carry a reduced draft vocabulary over to a new target tokenizer, token by string.

    Tokens the new tokenizer lacks are dropped; the new tokenizer's own added tokens (domain words
    a target update introduced) and EOS join, so the draft can propose them.
    """
    new_vocab = new_tok.get_vocab()
    kept = []
    for old_id in vocab.token_ids.tolist():
        new_id = new_vocab.get(old_tok.convert_ids_to_tokens(old_id))
        if new_id is not None:
            kept.append(new_id)
    added = list(getattr(new_tok, "added_tokens_encoder", {}).values())
    kept += [t for t in added + [new_tok.eos_token_id] if t is not None]
    return DraftVocab(torch.tensor(sorted(set(kept))), max(len(new_tok), max(new_vocab.values()) + 1))
