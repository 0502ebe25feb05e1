"""EAGLE-3 heads in the field's two on-disk formats, read into and written from the project's head.

- **speculators** (vLLM's `speculators` library, 0.9): config.json with `speculators_model_type: eagle3`,
  a `transformer_layer_config` (the decoder layer's Llama config, `vocab_size` the target's), the
  EAGLE-3 fields at top level (`draft_vocab_size`, `target_hidden_size`,
  `eagle_aux_hidden_state_layer_ids`, the Eagle 3.1 switches `norm_before_residual`, `norm_before_fc`,
  `fc_norm`, `norm_output`) and `speculators_config` (algorithm, greedy proposal with
  `speculative_tokens`, the verifier's `name_or_path` and `architectures`). Weights
  (`speculators/models/eagle3/core.py`, `Eagle3DraftModel`): `fc`, `layers.N.*`, `norm`, `lm_head`,
  `embed_tokens` (the target's, saved with the head), `d2t`/`t2d` only when the draft vocabulary is
  smaller than the target's; `input_norm` / `fc_norm.*` with the 3.1 switches (names the head keeps).
- **EAGLE-3 / SpecForge** (what vLLM's `eagle3` method and SGLang load, and what `eagle3_io` writes):
  `architectures: [LlamaForCausalLMEagle3]`, `midlayer.*` for the one layer; SpecForge may add
  `embed_tokens`, may omit `t2d` and, with a full vocabulary, `d2t`, and may omit `eagle_config`. The 3.1
  switches sit at top level, as vLLM's `llama_eagle3.py` reads them (`norm_before_fc` also inside
  `eagle_config`, as NVIDIA's checkpoints put it and vLLM reads it first).

Both map onto one head: `layers.0.` is `midlayer.`; `d2t` holds offsets (target id = draft id + d2t).
Whatever the head does not implement is refused by name, never dropped.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig

from specdistill import paths
from specdistill.modeling.eagle3 import Eagle3ShapeError, default_aux_layers, norm_options
from specdistill.modeling.eagle3_files import EAGLE3_ARCHITECTURE, META_FILE, read_config

SPECULATORS = "speculators"
EAGLE3_LAYOUT = "eagle3"
FORMATS = (EAGLE3_LAYOUT, SPECULATORS)
SPECULATORS_VERSION = "0.9.0"  # the config layout written (speculators' own classes validate it in the tests)
SPECULATORS_ARCHITECTURE = "Eagle3DraftModel"  # what speculators' save_pretrained writes
# switches other heads' configs set that the head does not implement: refused by name when true
UNIMPLEMENTED_SWITCHES = {
    "qk_norm": "RMS norms on the attention's queries and keys",
}
LAYER_KEYS_COPIED = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps")


class HeadFormatError(Eagle3ShapeError):
    """A checkpoint that is not an EAGLE-3 head in a format read here, or asks for what the head lacks."""


@dataclass
class ForeignHead:
    """A head read from disk, in the project's names: its Llama config (with the EAGLE-3 fields), its
    tensors (`midlayer.*`, no embeddings), the embeddings it carried (to be checked against the target's)."""

    source_format: str
    config: LlamaConfig
    tensors: dict[str, torch.Tensor]
    embed_tokens: torch.Tensor | None
    verifier: dict = field(default_factory=dict)  # name_or_path / architectures, when the file names them
    speculative_tokens: int | None = None
    meta: dict = field(default_factory=dict)  # a specdistill meta file found beside it


def source_format(directory: str | os.PathLike) -> str:
    """`speculators` or `eagle3` by config.json; anything else is refused in one sentence."""
    directory = Path(directory)
    config = read_config(directory)
    if config is None:
        raise HeadFormatError(f"{directory}: no readable config.json, so it is not a head checkpoint")
    if "speculators_model_type" in config:
        kind = config["speculators_model_type"]
        if kind != "eagle3":
            raise HeadFormatError(f"{directory}/config.json: speculators model type {kind!r} is not an EAGLE-3 head "
                                  "(only speculators_model_type 'eagle3' is imported)")
        return SPECULATORS
    if EAGLE3_ARCHITECTURE in (config.get("architectures") or []):
        return EAGLE3_LAYOUT
    raise HeadFormatError(f"{directory}/config.json names neither speculators_model_type nor the architecture "
                          f"{EAGLE3_ARCHITECTURE}, so it is not an EAGLE-3 head in a known format")


def source_sha256(directory: str | os.PathLike) -> str:
    """One hash over the checkpoint's config and weights (name and content of each file, in name order)."""
    directory = Path(directory)
    digest = hashlib.sha256()
    for path in sorted([directory / "config.json", *directory.glob("*.safetensors")]):
        digest.update(path.name.encode() + b"\0" + paths.file_sha256(path).encode() + b"\n")
    return digest.hexdigest()


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt"))
        hint = f" ({', '.join(others)} are pickles, not read: safetensors only)" if others else ""
        raise HeadFormatError(f"{directory}: no *.safetensors weights{hint}")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            tensors.update(load_file(str(path)))
        except Exception as exc:
            raise HeadFormatError(f"cannot read head weights {path}: {exc}") from exc
    return tensors


def _refuse_switches(config: dict, where: str) -> None:
    for name, what in UNIMPLEMENTED_SWITCHES.items():
        if config.get(name):
            raise HeadFormatError(f"{where}: `{name}: true` ({what}) is not implemented by specdistill's "
                                  "EAGLE-3 head, so the checkpoint is refused rather than run without it")


def _refuse_layer(layer: dict, where: str) -> None:
    """The decoder layer options a Llama-style single-layer head does not have."""
    if (layer.get("model_type") or "llama") != "llama":
        raise HeadFormatError(f"{where}: a {layer['model_type']!r} decoder layer is not implemented by specdistill's "
                              "EAGLE-3 head (a Llama decoder layer only)")
    layers = layer.get("num_hidden_layers", 1)
    if layers != 1:
        raise HeadFormatError(f"{where}: num_hidden_layers {layers}: specdistill's EAGLE-3 head has exactly one "
                              "decoder layer, so a deeper head is refused")
    for bias in ("attention_bias", "mlp_bias"):
        if layer.get(bias):
            raise HeadFormatError(f"{where}: `{bias}: true` is not implemented by specdistill's EAGLE-3 head")
    if any(t != "full_attention" for t in layer.get("layer_types") or []) or layer.get("use_sliding_window"):
        raise HeadFormatError(f"{where}: sliding-window attention is not implemented by specdistill's EAGLE-3 head")


def _rope(layer: dict) -> dict:
    rope = layer.get("rope_parameters")
    if rope:
        if "sliding_attention" in rope or "full_attention" in rope:
            rope = rope.get("full_attention") or rope["sliding_attention"]
        return dict(rope)
    rope = {"rope_type": "default", "rope_theta": float(layer.get("rope_theta", 10000.0))}
    scaling = layer.get("rope_scaling")
    if scaling:
        rope.update({k: v for k, v in scaling.items() if k != "type"})
        rope["rope_type"] = scaling.get("rope_type") or scaling.get("type") or "default"
    return rope


def _norm_switches(config: dict, where: str) -> dict[str, bool]:
    """The Eagle 3.1 switches a checkpoint sets (`norm_before_fc` from `eagle_config` first, as vLLM reads it)."""
    options = norm_options(config)
    nested = (config.get("eagle_config") or {}).get("norm_before_fc")
    if nested is not None:
        options["norm_before_fc"] = bool(nested)
    if options["norm_before_fc"] and options["fc_norm"]:
        raise HeadFormatError(f"{where}: norm_before_fc and fc_norm are both set, and they are exclusive (one norm "
                              "over the concatenated target features, or one per feature layer)")
    return options


def head_config(layer: dict, draft_vocab_size: int, target_hidden_size: int, aux_layers: list[int],
                options: dict[str, bool] | None = None) -> LlamaConfig:
    """The project's head config from a decoder layer's settings plus the EAGLE-3 fields; of the Eagle 3.1
    switches only the set ones are written, so a head without them has today's config.json."""
    kept = {k: layer[k] for k in LAYER_KEYS_COPIED if layer.get(k) is not None}
    config = LlamaConfig(**kept, num_hidden_layers=1, rope_parameters=_rope(layer), tie_word_embeddings=False,
                         bos_token_id=layer.get("bos_token_id"), eos_token_id=layer.get("eos_token_id"),
                         pad_token_id=layer.get("pad_token_id"))
    config.architectures = [EAGLE3_ARCHITECTURE]
    config.draft_vocab_size = int(draft_vocab_size)
    config.target_hidden_size = int(target_hidden_size)
    config.eagle_config = {"eagle_aux_hidden_state_layer_ids": list(aux_layers), "use_aux_hidden_state": True}
    for name, on in (options or {}).items():
        if on:
            setattr(config, name, True)
    return config


def read_head(directory: str | os.PathLike, target_layers: int) -> ForeignHead:
    """A head in either format, its options checked (refused by name) and its names made the project's.
    `target_layers` (the target's layer count) gives the feature layers a config leaves out, as vLLM,
    SGLang and speculators default them."""
    directory = Path(directory)
    kind = source_format(directory)
    raw = read_config(directory)
    where = f"{directory}/config.json"
    meta_path = directory / META_FILE
    meta = paths.read_json(meta_path, "draft meta") if meta_path.is_file() else {}
    if kind == SPECULATORS:
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise HeadFormatError(f"{where}: speculators config without a transformer_layer_config")
        _refuse_switches(raw, where)
        _refuse_layer(layer, where + " transformer_layer_config")
        options = _norm_switches(raw, where)
        spec = raw.get("speculators_config") or {}
        if spec.get("algorithm", "eagle3") != "eagle3":
            raise HeadFormatError(f"{where}: speculators algorithm {spec.get('algorithm')!r} is not EAGLE-3")
        proposals = spec.get("proposal_methods") or []
        tokens = next((p.get("speculative_tokens") for p in proposals if p.get("proposal_type") == "greedy"), None)
        aux = raw.get("eagle_aux_hidden_state_layer_ids")
        draft_vocab = raw.get("draft_vocab_size") or layer.get("vocab_size")
        target_hidden = raw.get("target_hidden_size") or layer.get("hidden_size")
        verifier = dict(spec.get("verifier") or {})
        prefix = "layers.0."
    else:
        layer = raw
        _refuse_switches(raw, where)
        _refuse_layer(raw, where)
        options = _norm_switches(raw, where)
        aux = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        draft_vocab = raw.get("draft_vocab_size") or raw.get("vocab_size")
        target_hidden = raw.get("target_hidden_size") or raw.get("hidden_size")
        tokens, verifier, prefix = None, {}, "midlayer."
    aux = list(aux) if aux else default_aux_layers(target_layers)
    if len(aux) != 3:
        raise HeadFormatError(f"{where}: the head reads {len(aux)} target layers {aux}; specdistill's EAGLE-3 head "
                              "reads exactly three")
    config = head_config(layer, draft_vocab, target_hidden, aux, options)
    tensors = _weights(directory)
    embed = tensors.pop("embed_tokens.weight", None)
    extra = [k for k in tensors if k.startswith("verifier_")]
    if extra:
        raise HeadFormatError(f"{directory}: weights {extra[:3]} belong to options specdistill's EAGLE-3 head does not "
                              "implement, so the checkpoint is refused rather than run without them")
    renamed = {}
    for name, tensor in tensors.items():
        if name.startswith(prefix):
            name = "midlayer." + name[len(prefix):]
        elif name.startswith(("layers.", "midlayer.")):
            raise HeadFormatError(f"{directory}: weight {name} is not of the head's one decoder layer ({prefix}*)")
        renamed[name] = tensor
    full = config.vocab_size
    if "d2t" not in renamed:
        if config.draft_vocab_size != full:
            raise HeadFormatError(f"{directory}: no d2t map, yet the draft vocabulary ({config.draft_vocab_size}) "
                                  f"is smaller than the target's ({full})")
        renamed["d2t"] = torch.zeros(full, dtype=torch.long)
    renamed["d2t"] = renamed["d2t"].to(torch.long)
    if "t2d" not in renamed:  # SpecForge may leave it out: it is the d2t map's image
        t2d = torch.zeros(full, dtype=torch.bool)
        ids = renamed["d2t"] + torch.arange(renamed["d2t"].numel())
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= full):
            raise HeadFormatError(f"{directory}: d2t maps draft tokens outside the target vocabulary of {full}")
        t2d[ids] = True
        renamed["t2d"] = t2d
    renamed["t2d"] = renamed["t2d"].to(torch.bool)
    return ForeignHead(kind, config, renamed, embed, verifier, tokens, meta)


def speculators_config(config: LlamaConfig, *, verifier: str | None, verifier_architectures: list[str],
                       speculative_tokens: int, dtype: str) -> dict:
    """config.json in speculators' layout for the project's head (its Eagle3SpeculatorConfig validates it)."""
    rope = dict(getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    layer = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
             **{k: getattr(config, k) for k in LAYER_KEYS_COPIED}, "attention_bias": False, "mlp_bias": False,
             "rope_parameters": rope, "tie_word_embeddings": False, "bos_token_id": config.bos_token_id,
             "eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id}
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(config.eagle_config["eagle_aux_hidden_state_layer_ids"]),
        **norm_options(config),
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "dtype": dtype,
        "torch_dtype": dtype,
        "tie_word_embeddings": False,
    }


def speculators_tensors(tensors: dict[str, torch.Tensor], vocab_size: int, draft_vocab_size: int) -> dict[str, torch.Tensor]:
    """The project's head tensors under speculators' names: `layers.0.*`; no embeddings (vLLM and speculators
    take the target's); d2t/t2d only for a reduced draft vocabulary, as speculators keeps them."""
    out = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in tensors.items()}
    if draft_vocab_size == vocab_size:
        out.pop("d2t", None)
        out.pop("t2d", None)
    return out


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, default=str))
