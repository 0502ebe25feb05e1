"""The answer pool: every night's target answers for one target version, kept so the draft keeps learning.

The draft is data-limited (+0.075 first-position acceptance per doubling of unique answer tokens in
`benchmarks/experiments/eagle_budget.py`) while one night answers one window. A pool, keyed by the target
fingerprint, lists each night's train answers, teacher cache and EAGLE-3 feature cache (left where the
answer stage wrote them) in `pool.json`. A night trains on a `PoolView`: the pool's answers newest
first, a duplicate prompt once (its newest answer), capped by an answer-token budget, the new night's
always in; an ordinary answers file whose caches' shards link to the nights' shards.

Every prompt ever evaluated on (its log id and a hash of its prompt tokens) never enters a view. Over
`max_gb`, the oldest nights' data is deleted first. A truncated shard, or a cache for another target, is
skipped with a warning naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Iterable
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from specdistill import paths
from specdistill.distill.night_files import CACHE_META, FEATURE_META, read_done
from specdistill.distill.pool_view import PoolNight, PoolView, ViewSelection, write_json

POOL_MANIFEST = "pool.json"


class PoolWarning(UserWarning):
    """A pool shard or night that was skipped (truncated, another target, other settings)."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def prompt_hash(record: dict) -> str:
    """The identity of a prompt across log ids: its rendered token ids (else its messages)."""
    what = record.get("prompt_ids") or record.get("prompt")
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


class AnswerPool:
    """One target version's pool: a directory holding the manifest and the latest view."""

    def __init__(self, directory: str | os.PathLike, manifest: dict):
        self.dir = Path(directory)
        self.manifest = manifest

    @classmethod
    def open(cls, root: str | os.PathLike, fingerprint: str) -> AnswerPool:
        """The pool of this target under `root`, created empty when it does not exist."""
        directory = Path(root) / fingerprint
        path = directory / POOL_MANIFEST
        if path.is_file():
            manifest = paths.read_json(path, "pool manifest")
            if manifest.get("fingerprint") != fingerprint:
                raise ValueError(f"{path} is the pool of target {manifest.get('fingerprint')!r}, not {fingerprint!r}")
            return cls(directory, manifest)
        directory.mkdir(parents=True, exist_ok=True)
        pool = cls(directory, {"fingerprint": fingerprint, "created_at": _now(), "updated_at": _now(), "nights": [],
                               "held_out_ids": [], "held_out_prompts": [], "evictions": []})
        pool.save()
        return pool

    fingerprint = property(lambda self: self.manifest["fingerprint"])

    @property
    def nights(self) -> list[PoolNight]:
        """Oldest first."""
        return [PoolNight(**n) for n in self.manifest["nights"]]

    def save(self) -> None:
        self.manifest["updated_at"] = _now()
        write_json(self.dir / POOL_MANIFEST, self.manifest)

    def hold_out(self, records: Iterable[dict]) -> int:
        """Record evaluated prompts (answer records, or {"id", "prompt_ids"}): they never enter a view."""
        ids, prompts = set(self.manifest["held_out_ids"]), set(self.manifest["held_out_prompts"])
        before = len(ids)
        for rec in records:
            ids.add(str(rec["id"]))
            prompts.add(prompt_hash(rec))
        self.manifest["held_out_ids"], self.manifest["held_out_prompts"] = sorted(ids), sorted(prompts)
        self.save()
        return len(ids) - before

    def add_night(self, key: str, answers: str | os.PathLike, teacher_cache: str | os.PathLike,
                  features: str | os.PathLike | None = None, *, before: str | None = None) -> PoolNight:
        """A night's train answers join the pool (again: its entry is refreshed in place). The newest
        night is last; `before` inserts it ahead of that night (answers re-made for older prompts)."""
        meta = Path(teacher_cache) / CACHE_META
        if not meta.is_file():
            raise FileNotFoundError(f"no teacher cache at {teacher_cache} ({CACHE_META} missing)")
        written_for = paths.read_json(meta, "teacher cache record").get("fingerprint")
        if written_for != self.fingerprint:
            raise ValueError(f"teacher cache {teacher_cache} was written for target {written_for!r}; "
                             f"this pool is target {self.fingerprint!r}'s")
        records = read_done(Path(answers))
        has_features = features is not None and (Path(features) / FEATURE_META).is_file()
        night = PoolNight(key=key, answers=str(answers), teacher_cache=str(teacher_cache),
                          features=str(features) if has_features else None, answers_count=len(records),
                          tokens=sum(len(r["response_ids"]) for r in records.values()), added_at=_now())
        nights = self.manifest["nights"]
        old = next((i for i, n in enumerate(nights) if n["key"] == key), None)
        if old is not None:
            night.added_at = nights[old]["added_at"]
            nights[old] = asdict(night)
        else:
            at = next((i for i, n in enumerate(nights) if n["key"] == before), len(nights))
            nights.insert(at, asdict(night))
        self.save()
        return night

    def disk_bytes(self) -> int:
        return sum(n.disk_bytes() for n in self.nights)

    def enforce_disk_cap(self, max_gb: float | None, keep: Iterable[str] = ()) -> list[dict]:
        """Delete the oldest nights' data until the pool fits `max_gb`; nights in `keep` (tonight's) stay.
        Returns what left: key, bytes and when."""
        if max_gb is None:
            return []
        keep = set(keep)
        left = []
        for raw in self.manifest["nights"]:
            if self.disk_bytes() <= max_gb * 2**30:
                break
            night = PoolNight(**raw)
            if night.evicted_at or night.key in keep:
                continue
            size = night.disk_bytes()
            _delete_night_data(night)
            raw["evicted_at"] = _now()
            left.append({"key": night.key, "bytes": size, "at": raw["evicted_at"]})
        if left:
            self.manifest["evictions"] += left
            self.save()
        return left

    def drop(self) -> int:
        """Delete every night's data and the pool itself (a retired target version); returns the bytes freed."""
        size = self.disk_bytes()
        for night in self.nights:
            if not night.evicted_at:
                _delete_night_data(night)
        shutil.rmtree(self.dir, ignore_errors=True)
        return size

    def recent_prompts(self, n: int, exclude: Iterable[str] = ()) -> list[dict]:
        """The `n` most recent distinct prompts answered here (newest night first), never a held-out one:
        what a new target version re-answers to start its own pool."""
        held_ids, held_prompts = set(self.manifest["held_out_ids"]), set(self.manifest["held_out_prompts"])
        seen, out = set(exclude), []
        for night in reversed(self.nights):
            if night.evicted_at:
                continue
            for rec in read_done(Path(night.answers)).values():
                rid = str(rec["id"])
                if rid in seen or rid in held_ids or prompt_hash(rec) in held_prompts:
                    continue
                seen.add(rid)
                out.append({"id": rid, "prompt": rec["prompt"]})
                if len(out) >= n:
                    return out
        return out

    def view(self, *, include: str, max_tokens: int | None = None) -> PoolView:
        """The answers a night trains on (see the module docstring), written under the pool as
        `views/<content hash>` (reused when it exists; older views are removed).

        A prompt answered on several nights is taken from the first night in the view's order
        (`include`, then newest first), and the view's shards are named so that this night's rows
        are read last: a rerun of an older night trains on its own answers' teacher rows, not on a
        newer night's rows for another answer (bf16 greedy answers can differ between nights)."""
        nights = {n.key: n for n in self.nights}
        if include not in nights:
            raise KeyError(f"night {include!r} is not in the pool {self.dir}")
        order = [nights[include]] + [n for n in reversed(self.nights) if n.key != include and not n.evicted_at]
        read_last = {n.key: len(order) - 1 - i for i, n in enumerate(order)}  # the link names' order: include last
        held_ids, held_prompts = set(self.manifest["held_out_ids"]), set(self.manifest["held_out_prompts"])
        skipped: list[str] = []

        def skip(message: str) -> None:  # from a selection step, the warning names the caller of view
            warnings.warn(message, PoolWarning, stacklevel=4)
            skipped.append(message)

        def held_out(rec: dict) -> bool:
            return str(rec["id"]) in held_ids or prompt_hash(rec) in held_prompts

        selection = ViewSelection(self.fingerprint, nights[include], skip)
        for night in order:
            found = selection.shards_of(night)
            if found is not None:
                selection.take(night, *found, held_out, f"n{read_last[night.key]:05d}",
                               None if night.key == include else max_tokens)
        return selection.write(self.dir / "views", skipped)


def _delete_night_data(night: PoolNight) -> None:
    for path in (night.teacher_cache, night.features):
        if path:
            shutil.rmtree(path, ignore_errors=True)
    Path(night.answers).unlink(missing_ok=True)


def pools(root: str | os.PathLike) -> list[AnswerPool]:
    """Every target version's pool under `root`, most recently updated first."""
    root = Path(root)
    found = [AnswerPool(p.parent, paths.read_json(p, "pool manifest")) for p in root.glob(f"*/{POOL_MANIFEST}")] if root.is_dir() else []
    return sorted(found, key=lambda p: p.manifest.get("updated_at", ""), reverse=True)


def retire_pools(root: str | os.PathLike, keep_versions: int, current: str) -> list[dict]:
    """Keep the pools of the `keep_versions` most recent target versions (the current one always);
    drop the others with their data. Returns what was dropped."""
    kept, dropped = 1, []
    for pool in pools(root):
        if pool.fingerprint == current:
            continue
        if kept < keep_versions:
            kept += 1
            continue
        dropped.append({"fingerprint": pool.fingerprint, "bytes": pool.drop()})
    return dropped
