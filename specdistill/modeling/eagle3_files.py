"""What a saved EAGLE-3 head's directory says without loading it (no torch): whether it is a head, the target
layers it reads, and the meta file every draft carries. Deciding a spec's kind, `serving show` and registry
tags read only this."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from specdistill import paths

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS_FILE = "model.safetensors"
META_FILE = "specdistill_draft.json"  # every draft's meta file: heads and layer drafts (`drafts.save_draft`) alike

# The kinds of draft a directory holds, one name each wherever a kind is written: training's `train.kind`
# (`distill.distill_recipe.DraftKind`), the drafter spec (`speculative.kinds`), serving.json's `draft_kind`, the registry's
# `draft_kind` tag, `draft init --kind`. The names are vLLM's `method`s for them.
DRAFT_MODEL = "draft_model"  # a layer draft: a small LM built from some of the target's layers, its tokenizer
EAGLE3 = "eagle3"  # an EAGLE-3 head over the target's hidden states
# Read only, never written: the layer draft's name in records, configs and serving.json written before
# (`train.kind: layers`, `draft_kind: layers`, a result's and a checkpoint config's `kind`).
OLD_KIND_NAMES = {"layers": DRAFT_MODEL}


def kind_name(name: Any) -> Any:
    """A draft kind's one name, from the name a record or config gives (an old one read as its new); what is
    not a name is given back for the reader to refuse."""
    return OLD_KIND_NAMES.get(name, name) if isinstance(name, str) else name


def read_config(directory: str | os.PathLike) -> dict | None:
    path = Path(directory) / "config.json"
    try:
        return paths.read_json(path, "model config")
    except (OSError, ValueError):
        return None


def is_eagle3_dir(directory: str | os.PathLike) -> bool:
    config = read_config(directory)
    return bool(config) and EAGLE3_ARCHITECTURE in (config.get("architectures") or [])


def aux_layers_of(directory: str | os.PathLike) -> list[int] | None:
    """The target layers a saved head reads (`eagle_aux_hidden_state_layer_ids`), without loading it."""
    config = read_config(directory) or {}
    layers = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return list(layers) if layers else None
