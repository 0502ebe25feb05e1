"""`self-spec:K`: self-speculation, the target's first K layers drafting (LayerSkip); served as those layers
exported as a draft checkpoint, so as a layer draft is."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specdistill.speculative.kinds.draft_model import NEEDS_DIR, model_sglang, model_vllm
from specdistill.speculative.specs import SELF_SPEC, DrafterSpec, Kind, TargetKey, register_kind

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from specdistill.speculative.drafters import Drafter


def build(target: PreTrainedModel, spec: DrafterSpec, key: TargetKey) -> Drafter:
    from specdistill.speculative.drafters import SelfSpecDrafter  # lazy: keeps torch off `serving show`

    return SelfSpecDrafter(target, spec.exit_layer, tree_width=spec.tree_width)


SELF_SPECULATION = register_kind(Kind(SELF_SPEC, SELF_SPEC, f"{SELF_SPEC}:K", str.isdigit, build,
                                      serving=lambda s: {"exit_layer": s.exit_layer}, aliases=("self_spec",),
                                      vllm=model_vllm, sglang=model_sglang, needs=NEEDS_DIR))
