"""`make_drafter`: the drafter a command line asks for; above the drafter modules, so none imports it back."""

from __future__ import annotations

from transformers import PreTrainedModel

from specdistill.acceptance import NGRAM_WINDOW
from specdistill.modeling import models
from specdistill.modeling.eagle3_io import is_eagle3_dir, load_eagle3
from specdistill.modeling.models import resolve_model_dir
from specdistill.modeling.vocab import DraftVocab
from specdistill.speculative.drafters import Drafter, ModelDrafter, NgramDrafter, SelfSpecDrafter
from specdistill.speculative.eagle import EagleDrafter
from specdistill.speculative.hybrid import HYBRID_THRESHOLD, HybridDrafter
from specdistill.speculative.suffix_corpus import load_suffix_drafter


def make_drafter(
    target: PreTrainedModel,
    *,
    draft: str | None = None,
    self_spec: int | None = None,
    ngram: bool = False,
    ngram_min: int = NGRAM_WINDOW[0],
    ngram_max: int = NGRAM_WINDOW[1],
    tree_width: int = 1,
    suffix: str | None = None,
    target_fingerprint: str | None = None,
    hybrid_threshold: float | None = None,
    target_tokenizer: str | None = None,
) -> Drafter | None:
    """At most one of a draft model or EAGLE-3 head, an early-exit layer, or n-gram lookup (None:
    target-only decoding). `suffix` (a corpus file, checked against `target_fingerprint` and
    `target_tokenizer` when given) alone is the suffix drafter; beside a model it makes the hybrid."""
    chosen = [name for name, on in (("draft", draft), ("self_spec", self_spec is not None), ("ngram", ngram)) if on]
    if len(chosen) > 1 or (suffix and ngram):
        raise ValueError(f"choose one drafting method, got {' and '.join(chosen + (['suffix'] if suffix else []))}")
    if suffix:
        model = make_drafter(target, draft=draft, self_spec=self_spec, tree_width=tree_width) if chosen else None
        corpus = load_suffix_drafter(suffix, target_fingerprint, target_tokenizer,
                                     tree_width=1 if model is not None else tree_width, vocab_size=target.config.vocab_size)
        if model is None:
            return corpus
        return HybridDrafter(model, corpus, HYBRID_THRESHOLD if hybrid_threshold is None else hybrid_threshold)
    if self_spec is not None:
        return SelfSpecDrafter(target, self_spec, tree_width=tree_width)
    if ngram:
        return NgramDrafter(ngram_min, ngram_max)
    if draft:
        path = resolve_model_dir(draft)
        if is_eagle3_dir(path):  # an EAGLE-3 head, in the target's dtype with the target's embeddings
            return EagleDrafter(load_eagle3(path, target).head, target, name=f"draft:{path.name}", tree_width=tree_width)
        weights = next(target.parameters())
        loaded = models.load_model(path, dtype=weights.dtype, device=weights.device)  # the draft runs as the target does
        return ModelDrafter(
            loaded.model, target.config.vocab_size, DraftVocab.load(loaded.path), name=f"draft:{loaded.path.name}",
            tree_width=tree_width,
        )
    return None
