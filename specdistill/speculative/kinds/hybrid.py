"""`hybrid:DIR,CORPUS[,THRESHOLD]`: the suffix drafter where its match is confident, a model drafter elsewhere.
Measured, never served: no serving engine runs our distilled draft with the suffix drafter beside it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specdistill.speculative.specs import DrafterSpec, DrafterSpecError, Kind, TargetKey, hybrid_model, hybrid_parts, register_kind

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from specdistill.speculative.drafters import Drafter


def _ok(arg: str) -> bool:
    try:
        return bool(hybrid_parts(arg))
    except DrafterSpecError:
        return False


def build(target: PreTrainedModel, spec: DrafterSpec, key: TargetKey) -> Drafter:
    """The model half built by its own kind (a head drafts the spec's tree), the suffix half as a chain."""
    from specdistill.speculative.hybrid import HYBRID_THRESHOLD, HybridDrafter  # lazy: keeps torch off `serving show`

    _, corpus, threshold = hybrid_parts(spec.arg)
    model = hybrid_model(spec.arg).with_(tree_width=spec.tree_width).build(target, key)
    lookup = DrafterSpec("suffix", corpus).build(target, key)
    return HybridDrafter(model, lookup, HYBRID_THRESHOLD if threshold is None else threshold)


HYBRID = register_kind(Kind("hybrid", "hybrid", "hybrid:DIR,CORPUS[,THRESHOLD]", _ok, build, served=False, llamacpp=False))
