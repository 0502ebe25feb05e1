"""Target fingerprints: a target version's identity, over its weights and tokenizer, and a model's
files checked by content, not by name, size and mtime.

The fingerprint names a target version everywhere (answers, drafts, corpora, serving configs are keyed by
it), so it must change when a weight or the tokenizer changes and not otherwise: it is taken over the
weights as stored, whatever dtype a run loads them in, and remembered beside them so a load does not
hash 0.5 GB each time.

A files record holds, per file of the model (the safetensors and every file beside them its
behaviour depends on: config, generation config, tokenizer, chat template; not our own records),
its stat, its full SHA-256 and a sampled digest (~4 MiB read, first and last blocks included). Each
load checks the sampled digest; a file whose stat changed is hashed in full again. The stat includes
ctime, which only the kernel sets, so an overwrite through the file system is caught even with mtime
put back; one below the file system is caught when it touches a sampled block, and in full by
`verify_weights_full`, which the nightly runs once per run (~0.6 s for the demo's 538 MB). A record
written when only the safetensors were recorded is checked on them, then completed with the other
files as they are (`"files": "all"`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from specdistill.paths import OUTPUT_MARKER, atomic_write_json, file_sha256, read_json

SAMPLE_BLOCKS = 512
SAMPLE_BYTES = 8192
FINGERPRINT_FILE = "specdistill_fingerprint.json"
SOURCE_FILE = "specdistill_source.json"  # a GGUF cache's source and the content record of its files
# written by us beside a model (and their atomic writes' temporaries): not part of what it is
OWN_FILES = (FINGERPRINT_FILE, SOURCE_FILE, OUTPUT_MARKER)
ALL_FILES = "all"  # a record's "files": every model file is recorded, not only the safetensors


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


def model_files(directory: Path, all_files: bool = True) -> list[Path]:
    """The files a model's behaviour depends on: every file of its directory but our own records (or,
    for a record from before, its safetensors only)."""
    if not all_files:
        return sorted(Path(directory).glob("*.safetensors"))
    return sorted(p for p in Path(directory).iterdir() if p.is_file() and not p.name.startswith(OWN_FILES))


def _entry(p: Path) -> dict:
    return {"sha256": file_sha256(p), "sample": sample_digest(p), "stat": _stat(p)}


def weights_record(directory: Path) -> dict[str, dict]:
    """The record of every model file in `directory` (full hashes: at conversion or a first sight)."""
    return {p.name: _entry(p) for p in model_files(directory)}


def verify_weights(directory: Path, record: dict[str, dict], all_files: bool = True) -> bool:
    """Check `directory`'s model files against `record`: the sampled digest always, the full hash when a
    file's stat changed (then the record's stat is refreshed in place; returns True when it was).
    Raises `WeightsIntegrityError` naming the first file that differs, is missing or is new."""
    directory = Path(directory)
    present = sorted(p.name for p in model_files(directory, all_files))
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


def verify_weights_full(directory: Path, record: dict[str, dict], all_files: bool = True) -> int:
    """Every model file of `directory` hashed in full against `record`, whatever its stat says;
    returns the bytes read. Raises `WeightsIntegrityError` naming the first file that differs."""
    directory = Path(directory)
    present = sorted(p.name for p in model_files(directory, all_files))
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


def _complete(record: dict, directory: Path) -> dict:
    """A record from when only the safetensors were recorded (their content just verified), with every
    other model file recorded as it is now."""
    return {**record, "files": ALL_FILES, "weights": {**weights_record_except(directory, record["weights"]), **record["weights"]}}


def weights_record_except(directory: Path, recorded: dict) -> dict[str, dict]:
    return {p.name: _entry(p) for p in model_files(directory) if p.name not in recorded}


def check_weights_record(source: Path) -> None:
    """A directory's files against the record `source` written with them (`verify_weights`); a record
    from before content records gets them now, one from before every file was recorded gets the rest."""
    cache_dir = source.parent
    try:
        record = read_json(source, "weights record")
    except (OSError, ValueError):
        raise WeightsIntegrityError(f"{source} is missing or corrupt: the cache's files cannot be checked") from None
    if "weights" not in record and "check" not in record:  # written before content records
        atomic_write_json(source, sealed({**record, "files": ALL_FILES, "weights": weights_record(cache_dir)}), mode=0o644)
        return
    if not is_sealed(record):
        raise WeightsIntegrityError(f"{source} was edited: its record no longer matches its check")
    all_files = record.get("files") == ALL_FILES
    refreshed = verify_weights(cache_dir, record["weights"], all_files)  # True: a touch or a copy, same content
    if not all_files:
        record, refreshed = _complete(record, cache_dir), True
    if refreshed:
        with contextlib.suppress(OSError):  # a read-only cache stays usable: the full hash just runs again next time
            atomic_write_json(source, sealed(record), mode=0o644)


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
    """Stats of the files beside the weights, as a record from before every file was recorded by content holds."""
    skip = (FINGERPRINT_FILE, SOURCE_FILE)
    return sorted(
        (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in model_dir.iterdir()
        if p.is_file() and p.name not in skip and p.suffix != ".safetensors"
    )


def saved_fingerprint(model_dir: Path) -> str | None:
    """The fingerprint remembered beside the weights, if no model file changed since (by content). A
    record edited by hand (its check fails) is ignored; a changed file is named on stderr; either way
    the fingerprint is computed again."""
    record_path = model_dir / FINGERPRINT_FILE
    try:
        saved = read_json(record_path, "fingerprint record")
        if not is_sealed(saved):
            return None
        all_files = saved.get("files") == ALL_FILES
        if not all_files and saved.get("signature") != json.loads(json.dumps(_dir_signature(model_dir))):
            return None  # a record from before: the other files' stats moved
        refreshed = verify_weights(model_dir, saved["weights"], all_files)
        if not all_files:
            saved, refreshed = {k: v for k, v in _complete(saved, model_dir).items() if k != "signature"}, True
        if refreshed:
            with contextlib.suppress(OSError):
                atomic_write_json(record_path, sealed(saved), mode=0o644)
        return saved["fingerprint"]
    except WeightsIntegrityError as exc:
        print(f"specdistill: {exc}; {model_dir} changed since its fingerprint was recorded: taking it again",
              file=sys.stderr)
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def cached_fingerprint(model_dir: Path, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> str:
    known = saved_fingerprint(model_dir)
    if known:
        return known
    record = model_dir / FINGERPRINT_FILE
    fp = fingerprint(model, tokenizer)
    with contextlib.suppress(OSError):  # a read-only model directory still gets a fingerprint, just not cached
        atomic_write_json(record, sealed({"files": ALL_FILES, "weights": weights_record(model_dir), "fingerprint": fp}),
                          mode=0o644)
    return fp
