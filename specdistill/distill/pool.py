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
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from specdistill import paths
from specdistill.distill import shards
from specdistill.distill.examples import read_done
from specdistill.distill.features import FEATURE_META
from specdistill.distill.teacher import CACHE_META

POOL_MANIFEST = "pool.json"
VIEW_DONE = "view.json"


class PoolWarning(UserWarning):
    """A pool shard or night that was skipped (truncated, another target, other settings)."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _write_json(path: Path, data: dict) -> None:
    paths.atomic_write_json(path, data, mode=paths.PUBLIC_FILE_MODE, sort_keys=True)


def prompt_hash(record: dict) -> str:
    """The identity of a prompt across log ids: its rendered token ids (else its messages)."""
    what = record.get("prompt_ids") or record.get("prompt")
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def _dir_bytes(path: str | None) -> int:
    if not path or not Path(path).exists():
        return 0
    p = Path(path)
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


@dataclass
class PoolNight:
    key: str  # the data window's key
    answers: str  # the night's train answers (JSONL)
    teacher_cache: str
    features: str | None  # its EAGLE-3 feature cache, None when the answer pass recorded none
    answers_count: int
    tokens: int  # answer tokens
    added_at: str
    evicted_at: str | None = None  # when the disk cap deleted its data

    def disk_bytes(self) -> int:
        return 0 if self.evicted_at else sum(_dir_bytes(p) for p in (self.answers, self.teacher_cache, self.features))


@dataclass
class PoolView:
    """What a night trains on: `path` + `teacher_cache` (+ `features`) as the trainer reads one night's data."""

    path: str
    teacher_cache: str
    features: str | None
    answers: int
    tokens: int
    nights: dict[str, dict] = field(default_factory=dict)  # night key -> {"answers", "tokens"}, newest first
    duplicates: int = 0  # prompts answered on several nights, kept once (the newest answer)
    held_out: int = 0  # answers dropped because their prompt has been evaluated on
    over_budget: int = 0  # older answers left out by the token budget
    skipped: list[str] = field(default_factory=list)  # warnings: shards or nights not trained on


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
        _write_json(self.dir / POOL_MANIFEST, self.manifest)

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

        def skip(message: str) -> None:
            warnings.warn(message, PoolWarning, stacklevel=3)
            skipped.append(message)

        first_meta = _meta(nights[include].teacher_cache, CACHE_META)
        feature_meta = _meta(nights[include].features, FEATURE_META) if nights[include].features else None
        seen, picked, teacher_links, feature_links = set(), [], {}, {}
        stats, per_night, tokens = {"duplicates": 0, "held_out": 0, "over_budget": 0}, {}, 0
        for night in order:
            meta = _meta(night.teacher_cache, CACHE_META)
            if meta is None or meta.get("fingerprint") != self.fingerprint:
                skip(f"pool night {night.key}: teacher cache {night.teacher_cache} is "
                     f"{'missing' if meta is None else 'for target ' + repr(meta.get('fingerprint'))}, "
                     f"not target {self.fingerprint!r}: not trained on")
                continue
            if any(meta.get(k) != first_meta.get(k) for k in ("k", "temperature", "vocab")):
                skip(f"pool night {night.key}: teacher cache {night.teacher_cache} has other settings "
                     f"(k/temperature/vocab) than tonight's: not trained on")
                continue
            teacher_shard = _index(Path(night.teacher_cache), skip)
            feature_shard = {}
            if feature_meta is not None and night.features:
                fmeta = _meta(night.features, FEATURE_META)
                if fmeta is None or any(fmeta.get(k) != feature_meta.get(k) for k in ("fingerprint", "layers", "prompt_context")):
                    skip(f"pool night {night.key}: feature cache {night.features} is for another target, layer "
                         f"set or prompt context: its features are not used (the trainer recomputes them)")
                else:
                    feature_shard = _index(Path(night.features), skip)
            counts, missing = {"answers": 0, "tokens": 0}, 0
            for rec in read_done(Path(night.answers)).values():
                rid = str(rec["id"])
                if rid in held_ids or prompt_hash(rec) in held_prompts:
                    stats["held_out"] += 1
                    continue
                if rid in seen:
                    stats["duplicates"] += 1
                    continue
                if rid not in teacher_shard:
                    missing += 1
                    continue
                n = len(rec["response_ids"])
                if night.key != include and max_tokens is not None and tokens + n > max_tokens:
                    stats["over_budget"] += 1
                    seen.add(rid)  # its newest answer is left out: no older answer of it stands in
                    continue
                seen.add(rid)
                picked.append(rec)
                tokens, counts["answers"], counts["tokens"] = tokens + n, counts["answers"] + 1, counts["tokens"] + n
                teacher_links[teacher_shard[rid]] = f"n{read_last[night.key]:05d}"
                if rid in feature_shard:
                    feature_links[feature_shard[rid]] = f"n{read_last[night.key]:05d}"
            if missing:
                skip(f"pool night {night.key}: {missing} answers in {night.answers} have no intact teacher "
                     f"rows: not trained on")
            if counts["answers"]:
                per_night[night.key] = counts
        # the links' names (their read order) are part of the key: a view written before they were
        # ordered by the view's own order is not reused
        key = hashlib.sha256(json.dumps([[r["id"] for r in picked], sorted(map(str, teacher_links.items())),
                                         sorted(map(str, feature_links.items()))]).encode()).hexdigest()[:12]
        views = self.dir / "views"
        out = views / key
        view = PoolView(path=str(out / "train_generated.jsonl"), teacher_cache=str(out / "teacher_cache"),
                        features=str(out / "features") if feature_meta is not None else None, answers=len(picked),
                        tokens=tokens, nights=per_night, skipped=skipped, **stats)
        if not (out / VIEW_DONE).is_file():
            shutil.rmtree(out, ignore_errors=True)
            _link_cache(out / "teacher_cache", CACHE_META, {**first_meta, "data": f"pool-{key}"}, teacher_links)
            if feature_meta is not None:
                _link_cache(out / "features", FEATURE_META, {**feature_meta, "data": f"pool-{key}"}, feature_links)
            with paths.open_private(out / "train_generated.jsonl", "w", encoding="utf-8") as f:
                for rec in picked:
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            _write_json(out / VIEW_DONE, asdict(view))
        for other in views.iterdir():
            if other.is_dir() and other.name != key:
                shutil.rmtree(other, ignore_errors=True)
        return view


def _meta(directory: str | None, name: str) -> dict | None:
    path = Path(directory) / name if directory else None
    if path is None or not path.is_file():
        return None
    try:
        return paths.read_json(path, "cache record")
    except (OSError, ValueError):
        return None


def _index(directory: Path, skip) -> dict[str, Path]:
    """Example id -> its shard, over the intact shards; a truncated one is skipped with a warning.
    Shards in name order, so a later one wins as it does in `teacher.load_shards`."""
    index = {}
    for shard in sorted(directory.glob("shard-*.safetensors")):
        keys = shards.intact_keys(shard)
        if keys is None:
            skip(f"pool shard {shard} is truncated or unreadable: skipped, its answers are not trained on from it")
            continue
        for k in keys:
            if k.endswith("/input_ids"):
                index[k[: -len("/input_ids")]] = shard
    return index


def _link_cache(directory: Path, meta_name: str, meta: dict, links: dict[Path, str]) -> None:
    """A cache directory whose shards are symlinks to the nights' shards, named in the view's reverse
    order, so that where two linked shards hold the same example the night it was taken from is read
    last (and wins)."""
    directory.mkdir(parents=True, exist_ok=True)
    for shard, night in sorted(links.items(), key=lambda kv: (kv[1], kv[0].name)):
        (directory / f"shard-{night}-{shard.name.removeprefix('shard-')}").symlink_to(shard.resolve())
    _write_json(directory / meta_name, meta)


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
