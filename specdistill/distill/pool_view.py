"""The view a night trains on, picked over the answer pool's nights (`AnswerPool.view` in pool.py).

Night by night in the view's order, a night's teacher cache (and feature cache) is checked against
tonight's and its intact shards indexed; its answers are taken (never a held-out prompt, a prompt once,
older nights' within the token budget); and the view is written once under its content hash: an
answers file and caches whose shards link to the nights' shards. The pool's nights (`PoolNight`) are
defined here, below the pool, because the view reads them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdistill import paths
from specdistill.distill.night_files import CACHE_META, FEATURE_META, read_done

VIEW_DONE = "view.json"


def write_json(path: Path, data: dict) -> None:
    """A pool file (manifest, view record, cache record): written atomically, readable by all, keys sorted."""
    paths.atomic_write_json(path, data, mode=paths.PUBLIC_FILE_MODE, sort_keys=True)


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


class ViewSelection:
    """A view's answers as they are taken night by night, the shards their teacher rows (and features) are
    linked from, and the counts the view reports. `skip` warns of a night or shard not trained on; tonight's
    caches set the settings every other night's must share."""

    def __init__(self, fingerprint: str, tonight: PoolNight, skip: Callable[[str], None]):
        self.fingerprint, self.skip = fingerprint, skip
        self.first_meta = _meta(tonight.teacher_cache, CACHE_META)
        self.feature_meta = _meta(tonight.features, FEATURE_META) if tonight.features else None
        self.seen: set[str] = set()  # prompt ids decided: taken, or left out by the budget
        self.picked: list[dict] = []
        self.teacher_links: dict[Path, str] = {}  # a night's shard -> the link name that orders its reading
        self.feature_links: dict[Path, str] = {}
        self.stats = {"duplicates": 0, "held_out": 0, "over_budget": 0}
        self.per_night: dict[str, dict] = {}
        self.tokens = 0

    def shards_of(self, night: PoolNight) -> tuple[dict[str, Path], dict[str, Path]] | None:
        """The night's intact teacher (and feature) shards by example id; None when its teacher cache is for
        another target or other settings than tonight's. A feature cache that does not match is not used."""
        meta = _meta(night.teacher_cache, CACHE_META)
        if meta is None or meta.get("fingerprint") != self.fingerprint:
            self.skip(f"pool night {night.key}: teacher cache {night.teacher_cache} is "
                      f"{'missing' if meta is None else 'for target ' + repr(meta.get('fingerprint'))}, "
                      f"not target {self.fingerprint!r}: not trained on")
            return None
        if any(meta.get(k) != self.first_meta.get(k) for k in ("k", "temperature", "vocab")):
            self.skip(f"pool night {night.key}: teacher cache {night.teacher_cache} has other settings "
                      f"(k/temperature/vocab) than tonight's: not trained on")
            return None
        teacher_shard = _index(Path(night.teacher_cache), self.skip)
        feature_shard = {}
        if self.feature_meta is not None and night.features:
            fmeta = _meta(night.features, FEATURE_META)
            if fmeta is None or any(fmeta.get(k) != self.feature_meta.get(k) for k in ("fingerprint", "layers", "prompt_context")):
                self.skip(f"pool night {night.key}: feature cache {night.features} is for another target, layer "
                          f"set or prompt context: its features are not used (the trainer recomputes them)")
            else:
                feature_shard = _index(Path(night.features), self.skip)
        return teacher_shard, feature_shard

    def take(self, night: PoolNight, teacher_shard: dict[str, Path], feature_shard: dict[str, Path],
             held_out: Callable[[dict], bool], link: str, budget: int | None) -> None:
        """The night's answers the view takes: not a held-out prompt, not a prompt already decided, not one
        without intact teacher rows, and within `budget` answer tokens in all (None: no budget). Their
        shards are linked under the name `link`."""
        counts, missing = {"answers": 0, "tokens": 0}, 0
        for rec in read_done(Path(night.answers)).values():
            rid = str(rec["id"])
            if held_out(rec):
                self.stats["held_out"] += 1
                continue
            if rid in self.seen:
                self.stats["duplicates"] += 1
                continue
            if rid not in teacher_shard:
                missing += 1
                continue
            n = len(rec["response_ids"])
            if budget is not None and self.tokens + n > budget:
                self.stats["over_budget"] += 1
                self.seen.add(rid)  # its newest answer is left out: no older answer of it stands in
                continue
            self.seen.add(rid)
            self.picked.append(rec)
            self.tokens, counts["answers"], counts["tokens"] = self.tokens + n, counts["answers"] + 1, counts["tokens"] + n
            self.teacher_links[teacher_shard[rid]] = link
            if rid in feature_shard:
                self.feature_links[feature_shard[rid]] = link
        if missing:
            self.skip(f"pool night {night.key}: {missing} answers in {night.answers} have no intact teacher "
                      f"rows: not trained on")
        if counts["answers"]:
            self.per_night[night.key] = counts

    def write(self, views: Path, skipped: list[str]) -> PoolView:
        """The view, written once under `views/<content hash>` (reused when it exists); other views are removed."""
        # the links' names (their read order) are part of the key: a view written before they were
        # ordered by the view's own order is not reused
        key = hashlib.sha256(json.dumps([[r["id"] for r in self.picked], sorted(map(str, self.teacher_links.items())),
                                         sorted(map(str, self.feature_links.items()))]).encode()).hexdigest()[:12]
        out = views / key
        view = PoolView(path=str(out / "train_generated.jsonl"), teacher_cache=str(out / "teacher_cache"),
                        features=str(out / "features") if self.feature_meta is not None else None,
                        answers=len(self.picked), tokens=self.tokens, nights=self.per_night, skipped=skipped, **self.stats)
        if not (out / VIEW_DONE).is_file():
            shutil.rmtree(out, ignore_errors=True)
            _link_cache(out / "teacher_cache", CACHE_META, {**self.first_meta, "data": f"pool-{key}"}, self.teacher_links)
            if self.feature_meta is not None:
                _link_cache(out / "features", FEATURE_META, {**self.feature_meta, "data": f"pool-{key}"}, self.feature_links)
            with paths.open_private(out / "train_generated.jsonl", "w", encoding="utf-8") as f:
                for rec in self.picked:
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            write_json(out / VIEW_DONE, asdict(view))
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
    from specdistill.distill import shards  # lazy: torch only when shards are read (logs prune and forget need none)

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
    write_json(directory / meta_name, meta)
