"""`eagle3:DIR`: an EAGLE-3 head, one decoder layer over the target's features from three of its layers,
drafting with the target's embeddings (vLLM `method: eagle3`, SGLang `EAGLE3`, llama.cpp `draft-eagle3`).

Everything that tells a head from a layer draft is here: which directories are heads (a `draft_model:DIR` spec
naming one, or a `draft:DIR` record written before this kind existed, reads as `eagle3:DIR`), how it is built (and carried over to
a target whose tokenizer changed), the engines' settings (served as a tree where the engine verifies one),
the γ it is first measured at, and the lineage tags a registered head carries (the target layers it reads)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdistill import paths
from specdistill.modeling.eagle3_files import META_FILE, aux_layers_of, is_eagle3_dir, read_config
from specdistill.speculative.kinds.draft_model import NEEDS_DIR, model_sglang, model_vllm
from specdistill.speculative.specs import DRAFT_MODEL, DrafterSpec, Kind, TargetKey, register_kind

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from specdistill.speculative.drafters import Drafter

NAME = "eagle3"
IMPORT_LINEAGE = ("imported_from", "source_sha256", "source_format")  # the meta `draft import` writes


def is_head(directory: str | os.PathLike) -> bool:
    """A local directory whose config names the EAGLE-3 architecture (a reference is not looked up)."""
    return Path(directory).is_dir() and is_eagle3_dir(directory)


def feature_layers(directory: str | os.PathLike) -> list[int] | None:
    """The target layers a head reads (`eagle_aux_hidden_state_layer_ids`), without loading it."""
    return aux_layers_of(directory)


def build(target: PreTrainedModel, spec: DrafterSpec, key: TargetKey) -> Drafter:
    """The head in the target's dtype with the target's embeddings, drafting the spec's tree width."""
    from specdistill.modeling.eagle3_io import load_eagle3  # lazy: keeps torch off `serving show`
    from specdistill.modeling.models import resolve_model_dir  # lazy: keeps torch off `serving show`
    from specdistill.speculative.eagle import EagleDrafter  # lazy: keeps torch off `serving show`

    path = resolve_model_dir(spec.arg)
    return EagleDrafter(load_eagle3(path, target).head, target, name=f"{NAME}:{path.name}", tree_width=spec.tree_width)


def mismatch(target: PreTrainedModel, spec: DrafterSpec, tokenizer: Any) -> str:
    """Why the target cannot read the head's token ids as they are ("": it can), from its tokenizer and config."""
    from transformers import AutoTokenizer  # lazy: keeps torch off `serving show`

    from specdistill.modeling.vocab import check_vocab, vocab_mismatch  # lazy: keeps torch off `serving show`

    head_tokenizer = AutoTokenizer.from_pretrained(spec.arg)
    return vocab_mismatch(check_vocab(tokenizer, head_tokenizer), read_config(spec.arg)["vocab_size"], target.config.vocab_size)


def carry(target: PreTrainedModel, spec: DrafterSpec, tokenizer: Any) -> tuple[Drafter, str]:
    """The head with the target's embeddings (always the target's), so a tokenizer change only carries its draft
    vocabulary (d2t/t2d, lm_head rows) over, by token string."""
    from specdistill.modeling.eagle3_io import load_eagle3  # lazy: keeps torch off `serving show`
    from specdistill.modeling.models import resolve_model_dir  # lazy: keeps torch off `serving show`
    from specdistill.speculative.eagle import EagleDrafter  # lazy: keeps torch off `serving show`

    path = resolve_model_dir(spec.arg)
    loaded = load_eagle3(path, target, target_tokenizer=tokenizer)
    return EagleDrafter(loaded.head, target, name=f"{NAME}:{path.name}", tree_width=spec.tree_width), loaded.reason


def first_gamma(spec: DrafterSpec, gamma: int) -> int:
    """No deeper than the draft positions the head was trained to propose (`unroll_steps` in its meta: a
    1-step head's 2nd position is untrained)."""
    meta = Path(spec.arg) / META_FILE
    if not meta.is_file():
        return gamma
    steps = paths.read_json(meta, "draft meta").get("unroll_steps")
    return min(gamma, steps) if isinstance(steps, int) and steps >= 1 else gamma


def tags(draft_dir: str) -> dict[str, str]:
    """A registered head's lineage: the target layers it reads (it is valid only on a target whose features it
    was trained on), its draft vocabulary, and for a head brought from elsewhere (`draft import`) where it
    came from and the hash of what was read."""
    meta_path = Path(draft_dir) / META_FILE
    meta = paths.read_json(meta_path, "draft meta") if meta_path.is_file() else {}
    imported = {key: str(meta[key]) for key in IMPORT_LINEAGE if meta.get(key)}
    return {"feature_layers": ",".join(map(str, feature_layers(draft_dir))),
            "draft_vocab_size": str(read_config(draft_dir).get("draft_vocab_size")), **imported}


def _vllm(c: Any) -> dict[str, Any]:
    return model_vllm(c, method="eagle3")


def _sglang(c: Any) -> list[str]:
    return model_sglang(c, algorithm="EAGLE3")


EAGLE3 = register_kind(Kind(NAME, "draft", "eagle3:DIR", bool, build, vllm=_vllm, sglang=_sglang, needs=NEEDS_DIR,
                            claims=(DRAFT_MODEL, is_head), draft_dir=True, label="EAGLE-3 head", on_target=True,
                            feature_layers=feature_layers, tree=True, first_gamma=first_gamma, tags=tags,
                            mismatch=mismatch, carry=carry))
