"""What a saved EAGLE-3 head's directory says without loading it (no torch): whether it is a head, the target
layers it reads, and the meta file every draft carries. Deciding a spec's kind, `serving show` and registry
tags read only this."""

from __future__ import annotations

import os
from pathlib import Path

from specdistill import paths

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS_FILE = "model.safetensors"
META_FILE = "specdistill_draft.json"  # every draft's meta file: heads and layer drafts (`drafts.save_draft`) alike


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
