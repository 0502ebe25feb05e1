"""The suffix drafter's corpus on disk: the target's past answers as token ids, versioned like a draft.

One safetensors file: `tokens` (int32, all answers back to back) and `offsets` (int64, where each
starts; one more at the end), with metadata naming the target fingerprint and tokenizer digest the
ids belong to, the split they came from (always `train`: held-out prompts would leak into what the
benchmark measures), the files they were read from and a SHA-256 over the two arrays. A file that is
cut off, corrupt, of another format, or built for another target or tokenizer fails with an error
naming the file; an empty corpus loads (the drafter then drafts from the request's own context
alone and says so).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save as safetensors_bytes

from specdistill import paths

CORPUS_FORMAT = "specdistill-suffix-corpus/1"


class CorpusError(ValueError):
    """A corpus file that cannot be used as it is: the message names the file and what to do."""


@dataclass
class CorpusMeta:
    target_fingerprint: str
    tokenizer: str  # `modeling.fingerprints.tokenizer_digest` of the target's tokenizer
    split: str = "train"
    sources: list[str] = field(default_factory=list)  # the answers files the sequences were read from
    sequences: int = 0
    tokens: int = 0
    created: float = field(default_factory=time.time)
    note: str = ""
    format: str = CORPUS_FORMAT


def _digest(tokens: np.ndarray, offsets: np.ndarray) -> str:
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(tokens, dtype=np.int32).tobytes())
    h.update(np.ascontiguousarray(offsets, dtype=np.int64).tobytes())
    return h.hexdigest()


def save_corpus(path: str | Path, sequences: list[list[int]], meta: CorpusMeta) -> Path:
    """Write the corpus atomically (a reader sees the old file or the new one); train split only."""
    if meta.split != "train":
        raise CorpusError(f"{path}: a suffix corpus is built from the train split only, not {meta.split!r}")
    path = Path(path)
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.concatenate([np.asarray(s, dtype=np.int32) for s in sequences]) if sequences else np.zeros(0, np.int32)
    meta.sequences, meta.tokens = len(sequences), int(tokens.size)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = safetensors_bytes({"tokens": tokens, "offsets": offsets},
                             metadata={"meta": json.dumps(asdict(meta)), "sha256": _digest(tokens, offsets)})
    # the target's answers to production traffic, as token ids: the owner only; written beside, renamed over
    return paths.atomic_write_bytes(path, data, mode=paths.PRIVATE_FILE_MODE)


def read_corpus_meta(path: str | Path) -> CorpusMeta:
    """The corpus's metadata alone (the header), for a staleness check without reading the tokens."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"suffix corpus {path} does not exist")
    try:
        with safe_open(str(path), framework="numpy") as f:
            header = f.metadata() or {}
    except Exception as exc:  # noqa: BLE001 - any parse failure is a corrupt file
        raise CorpusError(f"suffix corpus {path} is truncated or corrupt ({exc})") from exc
    try:
        meta = CorpusMeta(**json.loads(header["meta"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise CorpusError(f"suffix corpus {path} has no valid metadata ({exc}): not a {CORPUS_FORMAT} file") from exc
    if meta.format != CORPUS_FORMAT:
        raise CorpusError(f"suffix corpus {path} is format {meta.format!r}, expected {CORPUS_FORMAT!r}")
    return meta


def check_corpus_target(path: str | Path, meta: CorpusMeta, target_fingerprint: str | None,
                        tokenizer: str | None = None) -> None:
    if target_fingerprint is not None and meta.target_fingerprint != target_fingerprint:
        raise CorpusError(f"suffix corpus {path} was built from the answers of target {meta.target_fingerprint}, "
                          f"not of this target ({target_fingerprint}): rebuild it from this target's answers")
    if tokenizer is not None and meta.tokenizer != tokenizer:
        raise CorpusError(f"suffix corpus {path} holds token ids of another tokenizer ({meta.tokenizer[:12]}…, this "
                          f"target's is {tokenizer[:12]}…): rebuild it with this target's tokenizer")


def load_corpus(path: str | Path, target_fingerprint: str | None = None, tokenizer: str | None = None,
                vocab_size: int | None = None) -> tuple[list[np.ndarray], CorpusMeta]:
    """The sequences and metadata, checked: checksum, format, ids that are token ids (not negative, and
    under `vocab_size`, the target's vocabulary, when given), and (when given) target and tokenizer."""
    path = Path(path)
    meta = read_corpus_meta(path)
    check_corpus_target(path, meta, target_fingerprint, tokenizer)
    try:
        with safe_open(str(path), framework="numpy") as f:
            tokens, offsets = f.get_tensor("tokens"), f.get_tensor("offsets")
            expected = (f.metadata() or {}).get("sha256")
    except Exception as exc:  # noqa: BLE001
        raise CorpusError(f"suffix corpus {path} is truncated or corrupt ({exc})") from exc
    if expected != _digest(tokens, offsets):
        raise CorpusError(f"suffix corpus {path} fails its checksum (sha256 {expected} recorded): the file is corrupt")
    if offsets.size != meta.sequences + 1 or (offsets.size and int(offsets[-1]) != tokens.size):
        raise CorpusError(f"suffix corpus {path}: offsets do not match its {meta.sequences} sequences")
    _check_ids(path, tokens, vocab_size)
    return [tokens[int(a) : int(b)] for a, b in zip(offsets[:-1], offsets[1:])], meta


def _check_ids(path: Path, tokens: np.ndarray, vocab_size: int | None) -> None:
    """Every id a token of the target's vocabulary: a drafted id past it is an index error in the target."""
    if not tokens.size:
        return
    low, high = int(tokens.min()), int(tokens.max())
    bad = low if low < 0 else high if vocab_size is not None and high >= vocab_size else None
    if bad is not None:
        where = int(np.flatnonzero(tokens == bad)[0])
        vocab = "no token id is negative" if vocab_size is None else f"the target's vocabulary of {vocab_size} ids is 0 to {vocab_size - 1}"
        raise CorpusError(f"suffix corpus {path} holds token id {bad} (at token {where}), outside the target's "
                          f"vocabulary ({vocab}): rebuild it from this target's answers")


def corpus_is_current(path: str | Path, target_fingerprint: str, tokenizer: str | None = None) -> tuple[bool, str]:
    """Whether a corpus can draft for this target version (a target update makes it stale, as a draft)
    and, when `tokenizer` is given, holds ids of this target's tokenizer."""
    try:
        meta = read_corpus_meta(path)
        if meta.target_fingerprint != target_fingerprint:
            return False, (f"suffix corpus {path} is stale: built for target {meta.target_fingerprint}, "
                           f"the target is now {target_fingerprint}")
        check_corpus_target(path, meta, None, tokenizer)
    except CorpusError as exc:
        return False, str(exc)
    return True, ""


def load_suffix_drafter(path: str | Path, target_fingerprint: str | None = None, tokenizer: str | None = None,
                        tree_width: int = 1, vocab_size: int | None = None):
    """A `SuffixDrafter` over a corpus file (checked as `load_corpus` does, its ids against the target's
    `vocab_size`). An empty corpus gives a drafter over the request's own context alone, with a warning
    and `drafter.note` saying so."""
    from specdistill.speculative.suffix import SuffixDrafter, SuffixIndex  # lazy: keeps torch off import

    path = Path(path)
    sequences, _ = load_corpus(path, target_fingerprint, tokenizer, vocab_size)
    drafter = SuffixDrafter(SuffixIndex(sequences), tree_width=tree_width, name=f"suffix:{path.name}")
    drafter.note = ""
    if drafter.corpus is None:
        drafter.note = f"suffix corpus {path} is empty: drafting from the request's own context only"
        logging.getLogger(__name__).warning(drafter.note)
    return drafter
