"""EAGLE-3 heads on disk, in the layout vLLM and SGLang load, and back.

What the serving engines read (checked against their loaders and published checkpoints):
- vLLM `vllm/model_executor/models/llama_eagle3.py` (vllm-project/vllm): `Eagle3LlamaForCausalLM.load_weights`
  renames `d2t` to `draft_id_to_target_id`, skips `t2d`, maps `midlayer.` to `layers.0.`, prefixes every
  name but `lm_head` with `model.`, sizes `fc` from `target_hidden_size * 3` and `lm_head` from
  `draft_vocab_size`, and reads `eagle_config.use_aux_hidden_state`. A checkpoint without
  `embed_tokens` is fine: `vllm/v1/spec_decode/eagle.py` then shares the target's embedding
  ("Detected EAGLE model without its own embed_tokens in the checkpoint").
- SGLang `python/sglang/srt/models/llama_eagle3.py` (sgl-project/sglang): the same names without a
  prefix (`fc`, `midlayer.*`, `norm`, `lm_head`), `d2t` as the hot-token map (`d2t + arange`), `t2d`
  skipped, and `tie_word_embeddings: true` would make it use the embedding as the head, so it is false.
- Eagle 3.1 (`modeling.eagle3.NORM_OPTIONS`): vLLM's `llama_eagle3.py` (since vllm-project/vllm#42764,
  May 2026) reads `norm_before_residual`, `norm_before_fc`, `fc_norm` and `norm_output` from this config.json
  at top level and loads `input_norm.weight` / `fc_norm.N.weight` as `model.*`, so a head's set switches and
  their weights are written here as they are. SGLang's `llama_eagle3.py` (sgl-project/sglang at 03d5a77, the version read)
  reads none of them: such a head is for vLLM (or speculators' format), not SGLang.
- Published configs (SpecForge `configs/llama3-8B-eagle3.json` and `llama3-70B-ealge3.json`, the
  yuhuili/EAGLE3-LLaMA3.1-Instruct-8B layout) carry top-level `rope_theta` and `torch_dtype` as
  transformers 4 wrote them; `eagle_config` as in SpecForge's tests.

The head's token embeddings are never saved: they always come from the target, here and there.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, LlamaConfig, PreTrainedModel, PreTrainedTokenizerBase

from specdistill import paths
from specdistill.modeling.eagle3 import Eagle3Draft, Eagle3ShapeError, check_fits
from specdistill.modeling.eagle3_files import (  # noqa: F401  (its names are read from here too)
    EAGLE3_ARCHITECTURE,
    META_FILE,
    WEIGHTS_FILE,
    aux_layers_of,
    is_eagle3_dir,
    read_config,
)
from specdistill.modeling.vocab import DraftVocab, check_vocab, remap_draft_vocab, vocab_mismatch

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float64: "float64"}


def export_config(head: Eagle3Draft) -> dict:
    """config.json: the head's Llama config plus the fields older readers take at top level."""
    config = head.config.to_diff_dict()
    config.pop("dtype", None)
    rope = dict(getattr(head.config, "rope_parameters", None) or {})
    config["rope_theta"] = float(rope.get("rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    config["torch_dtype"] = DTYPE_NAMES.get(head.fc.weight.dtype, "float32")
    config["tie_word_embeddings"] = False
    return config


def head_tensors(head: Eagle3Draft) -> dict[str, torch.Tensor]:
    """The saved tensors: fc, midlayer.*, norm, lm_head, d2t (int64), t2d (bool); no embeddings."""
    return {name: t.detach().contiguous() for name, t in head.state_dict().items() if not name.startswith("embed_tokens.")}


def save_eagle3(
    head: Eagle3Draft,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str | os.PathLike,
    meta: dict | None = None,
    *,
    force: bool = True,
) -> Path:
    out_dir = Path(out_dir)
    meta = {"kind": "eagle3", "aux_layers": head.aux_layers, "draft_vocab": head.config.draft_vocab_size, **(meta or {})}
    with paths.atomic_dir(out_dir, "draft", force=force) as tmp:
        (tmp / "config.json").write_text(json.dumps(export_config(head), indent=2))
        save_file(head_tensors(head), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, default=str))
    return out_dir


@dataclass
class LoadedEagle3:
    head: Eagle3Draft
    tokenizer: PreTrainedTokenizerBase
    path: Path
    meta: dict
    transplanted: bool = False
    reason: str = ""  # why the draft vocabulary was carried over to the target's tokenizer


def load_eagle3(
    directory: str | os.PathLike,
    target: PreTrainedModel,
    *,
    target_tokenizer: PreTrainedTokenizerBase | None = None,
    feature_layers: list[int] | None = None,
) -> LoadedEagle3:
    """The head in `directory`, paired with `target` (its embeddings), in the target's dtype and on its
    device; checked (`check_fits`) before any weight is read. With `target_tokenizer`, a head saved for
    another tokenizer (a target update that added tokens) has its draft vocabulary carried over."""
    directory = Path(directory)
    config_dict = read_config(directory)
    if not config_dict or EAGLE3_ARCHITECTURE not in (config_dict.get("architectures") or []):
        raise Eagle3ShapeError(f"{directory} is not an EAGLE-3 head (config.json must name {EAGLE3_ARCHITECTURE})")
    meta_path = directory / META_FILE
    meta = paths.read_json(meta_path, "EAGLE-3 head metadata") if meta_path.is_file() else {}
    tokenizer = AutoTokenizer.from_pretrained(directory)
    reason = ""
    if target_tokenizer is not None:
        reason = vocab_mismatch(check_vocab(target_tokenizer, tokenizer), config_dict.get("vocab_size"), target.config.vocab_size)
    check_fits(config_dict, target.config, where=str(directory), feature_layers=feature_layers,
               check_vocab_size=not reason)
    weights = directory / WEIGHTS_FILE
    try:
        tensors = load_file(str(weights))
    except Exception as exc:
        raise Eagle3ShapeError(f"cannot read EAGLE-3 weights {weights}: {exc}") from exc
    copy_only = ("rope_theta", "rope_scaling", "torch_dtype")  # written for other readers; rope_parameters rules
    config = LlamaConfig.from_dict({k: v for k, v in config_dict.items() if k not in copy_only})
    if reason:
        config, tensors = transplant_head_vocab(config, tensors, tokenizer, target_tokenizer, target)
        tokenizer = target_tokenizer
    head = Eagle3Draft(config, target.get_input_embeddings())
    expected = {k: tuple(v.shape) for k, v in head_tensors(head).items()}
    found = {k: tuple(v.shape) for k, v in tensors.items()}
    if expected != found:
        diff = sorted(set(expected.items()) ^ set(found.items()))[:6]
        raise Eagle3ShapeError(f"{weights} does not hold the tensors of its config.json (name, shape): {diff}")
    head.load_state_dict({**tensors, "embed_tokens.weight": head.embed_tokens.weight}, strict=True)
    weights_of_target = next(target.parameters())
    head.to(device=weights_of_target.device, dtype=weights_of_target.dtype).eval()  # runs as the target does
    return LoadedEagle3(head, tokenizer, directory, meta, bool(reason), reason)


def transplant_head_vocab(
    config: LlamaConfig,
    tensors: dict[str, torch.Tensor],
    old_tok: PreTrainedTokenizerBase,
    new_tok: PreTrainedTokenizerBase,
    target: PreTrainedModel,
) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Carry a head over to a target with another tokenizer: remap d2t/t2d by token string; a kept
    token keeps its lm_head row, a token the new tokenizer added starts from the target's own head
    row for it. Embeddings need nothing: they are the target's."""
    old_vocab = DraftVocab(tensors["d2t"] + torch.arange(tensors["d2t"].numel()), config.vocab_size)
    remapped = remap_draft_vocab(old_vocab, old_tok, new_tok)
    new_vocab = DraftVocab(remapped.token_ids, target.config.vocab_size)
    old_ids = old_tok.get_vocab()
    old_row = {int(t): i for i, t in enumerate(old_vocab.token_ids.tolist())}
    target_head = target.get_output_embeddings().weight.detach()
    lm_head = tensors["lm_head.weight"]
    rows = []
    for new_id in new_vocab.token_ids.tolist():
        old_id = old_ids.get(new_tok.convert_ids_to_tokens(new_id))
        row = old_row.get(old_id) if old_id is not None else None
        rows.append(lm_head[row] if row is not None else target_head[new_id].to(lm_head.dtype))
    config = LlamaConfig.from_dict({**config.to_dict(), "vocab_size": target.config.vocab_size,
                                    "draft_vocab_size": new_vocab.size})
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, name, getattr(new_tok, name, None))
    tensors = {**tensors, "lm_head.weight": torch.stack(rows), "d2t": new_vocab.d2t, "t2d": new_vocab.t2d}
    return config, tensors


def align_head(head_dir: str | os.PathLike, target: PreTrainedModel, target_tokenizer: PreTrainedTokenizerBase,
               out_dir: str | os.PathLike) -> tuple[Path, LoadedEagle3, dict]:
    """A head made usable on `target` (a warm start after a target update): (directory, loaded head,
    vocabulary report), the directory a copy in `out_dir` when the vocabulary had to be carried over."""
    report = check_vocab(target_tokenizer, AutoTokenizer.from_pretrained(head_dir)).to_dict()
    loaded = load_eagle3(head_dir, target, target_tokenizer=target_tokenizer)
    if not loaded.transplanted:
        return Path(head_dir), loaded, report
    if (Path(out_dir) / "config.json").is_file():  # carried over before, for this very target
        return Path(out_dir), loaded, report
    meta = {**loaded.meta, "transplanted_from": str(head_dir), "transplant_reason": loaded.reason}
    return save_eagle3(loaded.head, target_tokenizer, out_dir, meta), loaded, report
