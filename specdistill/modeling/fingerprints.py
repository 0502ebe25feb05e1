"""Target fingerprints: a target version's identity, over its weights and tokenizer, and weights
checked by content, not by name, size and mtime.

The fingerprint names a target version everywhere (answers, drafts, corpora, serving configs are keyed by
it), so it must change when a weight or the tokenizer changes and not otherwise: it is taken over the
weights as stored, whatever dtype a run loads them in, and remembered beside them so a load does not
hash 0.5 GB each time.

A weights record holds, per safetensors file, its stat, its full SHA-256 and a sampled digest (~4 MiB
read, first and last blocks included). Each load checks the sampled digest; a file whose stat
changed is hashed in full again. The stat includes ctime, which only the kernel sets, so an
overwrite through the file system is caught even with mtime put back; one below the file system is
caught when it touches a sampled block, and in full by `verify_weights_full`, which the nightly
runs once per run (~0.6 s for the demo's 538 MB).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from specdistill.paths import atomic_write_json, file_sha256

SAMPLE_BLOCKS = 512
SAMPLE_BYTES = 8192


class WeightsIntegrityError(RuntimeError):
    """Weights whose content no longer matches the record written with them; names the file."""


def sample_digest(path: Path) -> str:
    """SHA-256 over evenly spaced blocks of the file (and its size): the cheap per-load check."""
    size = Path(path).stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= SAMPLE_BLOCKS * SAMPLE_BYTES:
            h.update(f.read())
            return h.hexdigest()
        last = size - SAMPLE_BYTES
        for i in range(SAMPLE_BLOCKS):
            f.seek(last * i // (SAMPLE_BLOCKS - 1))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def _stat(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def weights_record(directory: Path) -> dict[str, dict]:
    """The record of every `*.safetensors` in `directory` (full hashes: at conversion or a first sight)."""
    return {p.name: {"sha256": file_sha256(p), "sample": sample_digest(p), "stat": _stat(p)}
            for p in sorted(Path(directory).glob("*.safetensors"))}


def verify_weights(directory: Path, record: dict[str, dict]) -> bool:
    """Check `directory`'s safetensors against `record`: the sampled digest always, the full hash when a
    file's stat changed (then the record's stat is refreshed in place; returns True when it was).
    Raises `WeightsIntegrityError` naming the first file that differs, is missing or is new."""
    directory = Path(directory)
    present = sorted(p.name for p in directory.glob("*.safetensors"))
    if present != sorted(record):
        extra, missing = set(present) - set(record), set(record) - set(present)
        raise WeightsIntegrityError(f"weights of {directory} changed: "
                                    + ", ".join([*(f"{n} is new" for n in sorted(extra)),
                                                 *(f"{n} is missing" for n in sorted(missing))]))
    refreshed = False
    for name, want in record.items():
        path = directory / name
        if _stat(path) != want["stat"]:
            if file_sha256(path) != want["sha256"]:
                raise WeightsIntegrityError(f"{path}: content differs from the SHA-256 recorded when it was written")
            want["stat"], want["sample"] = _stat(path), sample_digest(path)
            refreshed = True
        elif sample_digest(path) != want["sample"]:
            raise WeightsIntegrityError(f"{path}: content differs from what was recorded when it was written "
                                        "(same size and modification time)")
    return refreshed


def verify_weights_full(directory: Path, record: dict[str, dict]) -> int:
    """Every safetensors file of `directory` hashed in full against `record`, whatever its stat says;
    returns the bytes read. Raises `WeightsIntegrityError` naming the first file that differs."""
    directory = Path(directory)
    present = sorted(p.name for p in directory.glob("*.safetensors"))
    if present != sorted(record):
        raise WeightsIntegrityError(f"weights of {directory} changed: files {present}, recorded {sorted(record)}")
    total = 0
    for name, want in record.items():
        path = directory / name
        if file_sha256(path) != want["sha256"]:
            raise WeightsIntegrityError(f"{path}: content differs from the SHA-256 recorded when it was written")
        total += path.stat().st_size
    return total


def sealed(payload: dict) -> dict:
    """`payload` with a `check` over its canonical JSON: a hand edit of any value breaks it."""
    body = {k: v for k, v in payload.items() if k != "check"}
    return {**body, "check": hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()}


def is_sealed(payload: dict) -> bool:
    return isinstance(payload, dict) and payload.get("check") == sealed(payload)["check"]


def check_weights_record(source: Path) -> None:
    """A directory's weights against the record `source` written with them (`verify_weights`); a record
    from before content records gets them now."""
    cache_dir = source.parent
    try:
        record = json.loads(source.read_text())
    except (OSError, ValueError):
        raise WeightsIntegrityError(f"{source} is missing or corrupt: the cache's weights cannot be checked") from None
    if "weights" not in record and "check" not in record:  # written before content records
        atomic_write_json(source, sealed({**record, "weights": weights_record(cache_dir)}), mode=0o644)
        return
    if not is_sealed(record):
        raise WeightsIntegrityError(f"{source} was edited: its record no longer matches its check")
    if verify_weights(cache_dir, record["weights"]):  # a touch or a copy: same content, new stat
        with contextlib.suppress(OSError):  # a read-only cache stays usable: the full hash just runs again next time
            atomic_write_json(source, sealed(record), mode=0o644)


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
    stat, the safetensors by content. A record edited by hand (its check fails) or of another
    content is ignored, and the fingerprint is computed again."""
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
