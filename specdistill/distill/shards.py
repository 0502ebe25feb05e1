"""Safetensors shards of the offline teacher and the EAGLE-3 features, with a checksum each.

A shard carries a SHA-256 over its tensors (names, dtypes, shapes, bytes) in its metadata, verified when
read. A shard that fails (truncated, scrambled, not safetensors) is named and moved into `quarantine/`
with the reason beside it; the next run answers its examples again: nothing is trained on garbage and no
run is stuck on the same file. A shard without a checksum is refused alike: every writer records one, so
its metadata was stripped (or predates checksums) and its rows cannot be told from forged ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from specdistill import paths

DIGEST_KEY = "specdistill_sha256"
QUARANTINE = "quarantine"
SHARD_GLOB = "shard-*.safetensors"


class CorruptShardError(ValueError):
    """A shard that cannot be trusted; the message names the file and where it was moved."""

    def __init__(self, message: str, path: Path):
        super().__init__(message)
        self.path = path


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """Write atomically (a kill leaves the shard complete or absent), with its checksum, mode 0600
    (the rows describe answers to production traffic)."""
    path = Path(path)
    tensors = {k: t.contiguous() for k, t in tensors.items()}
    data = save(tensors, metadata={DIGEST_KEY: tensors_digest(tensors)})  # then written beside and renamed over
    return paths.atomic_write_bytes(path, data, mode=paths.PRIVATE_FILE_MODE)


def _problem(path: Path) -> tuple[dict[str, torch.Tensor] | None, str]:
    try:
        with safe_open(str(path), "pt") as f:
            expected = (f.metadata() or {}).get(DIGEST_KEY)
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error kinds on a truncated or foreign file
        return None, f"unreadable ({type(exc).__name__}: {exc})"
    if expected is None:
        return None, f"without a checksum (no {DIGEST_KEY} in its metadata: stripped, or written before checksums)"
    if tensors_digest(tensors) != expected:
        return None, "checksum mismatch (its content changed after it was written)"
    return tensors, ""


def quarantine(path: Path, reason: str) -> Path:
    """Move a bad shard into `quarantine/` beside it, with the reason in a .reason file; returns where."""
    path = Path(path)
    where = path.parent / QUARANTINE
    where.mkdir(exist_ok=True)
    moved = where / f"{path.name}.{time.strftime('%Y%m%dT%H%M%S')}"
    os.replace(path, moved)
    paths.atomic_write_text(moved.with_name(moved.name + ".reason"), f"{path}: {reason}\n")
    return moved


def verified_keys(directory: Path, suffix: str) -> tuple[set[str], list[str]]:
    """Example ids (keys `ID/<suffix>`) of the good shards in `directory`, and a line per shard that
    was bad and is now quarantined (reads every shard: a resume's check)."""
    ids: set[str] = set()
    bad = []
    for shard in sorted(Path(directory).glob(SHARD_GLOB)):
        tensors, reason = _problem(shard)
        if tensors is None:
            bad.append(f"{shard}: {reason} (moved to {quarantine(shard, reason)})")
            continue
        ids.update(key[: -len(suffix) - 1] for key in tensors if key.endswith("/" + suffix))
    return ids, bad


def load_shards(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    """A sharded cache's entries by example id: shard keys are `EXAMPLE_ID/FIELD`; every shard verified,
    a bad one quarantined (`CorruptShardError`)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for shard in sorted(Path(directory).glob(SHARD_GLOB)):
        tensors, reason = _problem(shard)
        if tensors is None:
            raise CorruptShardError(f"cache shard {shard} is {reason}: moved to {quarantine(shard, reason)}; the next "
                                    "run answers its examples again", shard)
        for key, tensor in tensors.items():
            ex_id, field = key.rsplit("/", 1)
            out.setdefault(ex_id, {})[field] = tensor
    return out


def header_keys(paths: Iterable[Path]) -> dict[str, Path]:
    """`key -> shard` from the shards' headers only (cheap); an unreadable header quarantines its shard."""
    out = {}
    for shard in paths:
        try:
            with safe_open(str(shard), "pt") as f:
                keys = list(f.keys())
        except Exception as exc:
            quarantine(shard, f"unreadable ({type(exc).__name__}: {exc})")
            continue
        out.update(dict.fromkeys(keys, shard))
    return out


def intact_keys(path: Path) -> list[str] | None:
    """The tensor names of an intact safetensors shard, or None when it is truncated or unreadable:
    the header's last data offset must be exactly where the file ends."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n <= 0 or n > 100_000_000:
                return None
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        return [k for k in header if k != "__metadata__"] if 8 + n + end == path.stat().st_size else None
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
