"""Target fingerprints: a target version's identity, over its weights and tokenizer.

The fingerprint names a target version everywhere (answers, drafts, corpora, serving configs are keyed by
it), so it must change when a weight or the tokenizer changes and not otherwise: it is taken over the
weights as stored, whatever dtype a run loads them in, and remembered beside them (checked by content,
`modeling.integrity`) so a load does not hash 0.5 GB each time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from specdistill.modeling.integrity import (
    WeightsIntegrityError,
    is_sealed,
    sealed,
    verify_weights,
    weights_record,
)
from specdistill.paths import atomic_write_json

FINGERPRINT_FILE = "specdistill_fingerprint.json"
SOURCE_FILE = "specdistill_source.json"  # a GGUF cache's source and the content record of its weights


def tokenizer_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    """Hash of what decides tokenization: the vocabulary, special tokens and chat template."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode())
    h.update(json.dumps(tokenizer.all_special_tokens, ensure_ascii=False).encode())
    h.update(str(getattr(tokenizer, "chat_template", None) or "").encode())
    return h.hexdigest()


def weights_digest(model: torch.nn.Module) -> str:
    """Hash over every tensor's name, shape, dtype and bytes (tied tensors counted once)."""
    h = hashlib.blake2b(digest_size=32)
    seen: set[int] = set()
    for name, tensor in sorted(model.state_dict().items()):
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        h.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}".encode())
        h.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def fingerprint(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> str:
    """A target version's identity: changes when a weight or the tokenizer changes, and not otherwise."""
    config = model.config.to_dict() if hasattr(model, "config") else {}
    arch = {k: config.get(k) for k in ("architectures", "hidden_size", "num_hidden_layers", "vocab_size")}
    h = hashlib.sha256()
    h.update(json.dumps(arch, sort_keys=True).encode())
    h.update(weights_digest(model).encode())
    h.update(tokenizer_digest(tokenizer).encode())
    return h.hexdigest()[:16]


def _dir_signature(model_dir: Path) -> list:
    """Stats of the files beside the weights (tokenizer, config); the weights are checked by content."""
    skip = (FINGERPRINT_FILE, SOURCE_FILE)
    return sorted(
        (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in model_dir.iterdir()
        if p.is_file() and p.name not in skip and p.suffix != ".safetensors"
    )


def saved_fingerprint(model_dir: Path) -> str | None:
    """The fingerprint remembered beside the weights, if nothing changed since: the other files by
    stat, the safetensors by content (`modeling.integrity`). A record edited by hand (its check
    fails) or of another content is ignored, and the fingerprint is computed again."""
    record_path = model_dir / FINGERPRINT_FILE
    try:
        saved = json.loads(record_path.read_text())
        if not is_sealed(saved) or saved.get("signature") != json.loads(json.dumps(_dir_signature(model_dir))):
            return None
        if verify_weights(model_dir, saved["weights"]):
            with contextlib.suppress(OSError):
                atomic_write_json(record_path, sealed(saved), mode=0o644)
        return saved["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError, WeightsIntegrityError):
        return None


def cached_fingerprint(model_dir: Path, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> str:
    known = saved_fingerprint(model_dir)
    if known:
        return known
    sig = _dir_signature(model_dir)
    record = model_dir / FINGERPRINT_FILE
    fp = fingerprint(model, tokenizer)
    with contextlib.suppress(OSError):  # a read-only model directory still gets a fingerprint, just not cached
        atomic_write_json(record, sealed({"signature": sig, "weights": weights_record(model_dir), "fingerprint": fp}), mode=0o644)
    return fp
