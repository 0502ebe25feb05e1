"""Retention and forgetting over everything the pipeline keeps of production traffic: the log store, the
nights' answers (the answer pool's data, held-out files), their teacher and feature shards and the suffix
corpora built from them, under the state directory.

`prune(days)`: what is older than `days` goes, unless a registered draft's gate or lineage still names it:
the data directory of its window (`data_window` tag: its held-out prompts, its training answers, their
shards and corpus) and the conversations those files name. `force` removes them too. The nightly prunes
after it succeeds when its config sets `retention_days`.

`forget(ids | user | source)`: those conversations leave the store, every answers file (train, held-out,
the pool's views, the generic baseline's conversations), every teacher and feature shard, and every suffix
corpus built from such a file (rebuilt without them; its SGLang text export is deleted, the next night
writes it again). It lists the registered drafts whose window's answers held them, and is recorded in the
log store's decisions by counts and a hash of what was asked, never the content.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

from specdistill import paths
from specdistill.data.logstore import LogStore
from specdistill.distill.pool import POOL_MANIFEST, AnswerPool, PoolNight, _delete_night_data
from specdistill.pipeline.nightly_recipe import run_root
from specdistill.speculative.suffix_corpus import CorpusError, load_corpus, save_corpus

ANSWER_FILES = ("train_generated.jsonl", "eval_generated.jsonl")
CORPUS_GLOB = "suffix_corpus*.safetensors"


@dataclass
class RetentionReport:
    """What left, by kind, and what stayed and why (both for `prune` and `forget`)."""

    action: str
    removed: dict[str, int] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)  # kind -> why
    drafts: list[str] = field(default_factory=list)  # forget: registered drafts whose window held them
    notes: list[str] = field(default_factory=list)

    def render(self) -> str:
        lines = [f"{self.action}: removed " + (", ".join(f"{n} {k}" for k, n in self.removed.items()) or "nothing")]
        lines += [f"kept {k}: {why}" for k, why in self.kept.items()]
        if self.drafts:
            lines.append("registered drafts trained on a window that held them (retrain to be rid of them): "
                         + ", ".join(self.drafts))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def registered_windows() -> dict[str, list[str]]:
    """Registered drafts by the window they were trained and gated on: {window key: ["name vN", ...]}.
    Empty when the state directory has no MLflow store (nothing registered yet)."""
    if not os.environ.get("MLFLOW_TRACKING_URI") and not (paths.home() / "mlflow.db").is_file():
        return {}
    from specdistill.ops import registry  # lazy: MLflow is slow to import, and most stores have no registry yet

    windows: dict[str, list[str]] = {}
    for v in registry.client().search_model_versions(""):
        key = v.tags.get("data_window")
        if key:
            windows.setdefault(key, []).append(f"{v.name} v{v.version}")
    return windows


def _data_dirs() -> list[Path]:
    root = run_root() / "data"
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def _newest_mtime(directory: Path) -> float:
    return max((f.stat().st_mtime for f in directory.rglob("*") if f.is_file()), default=directory.stat().st_mtime)


def _answer_ids(directory: Path) -> set[int]:
    ids: set[int] = set()
    for name in ANSWER_FILES:
        path = directory / name
        if path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    ids.add(int(json.loads(line)["id"]))
                except (ValueError, KeyError, TypeError):
                    continue  # a torn line, or an id that is no conversation's (a re-answered pool prompt's)
    return ids


def parse_age(text: str) -> timedelta:
    """`30d`, `12h` or a number of days."""
    text = text.strip().lower()
    try:
        if text.endswith("d"):
            return timedelta(days=float(text[:-1]))
        if text.endswith("h"):
            return timedelta(hours=float(text[:-1]))
        return timedelta(days=float(text))
    except ValueError:
        raise ValueError(f"not an age: {text!r} (expected e.g. 30d or 12h)") from None


def prune(older_than: timedelta, *, log_db: str | None = None, force: bool = False,
          now: datetime | None = None) -> RetentionReport:
    """Remove what is older than `older_than` (see the module docstring); returns what left and what stayed."""
    now = now or datetime.now(timezone.utc)
    cutoff = now - older_than
    report = RetentionReport(f"prune older than {cutoff.isoformat(timespec='seconds')}")
    windows = {} if force else registered_windows()
    keep_ids: set[int] = set()
    removed_dirs: list[Path] = []
    kept_dirs = 0
    for directory in _data_dirs():
        key = directory.name.split("-", 1)[0]
        if key in windows:
            keep_ids |= _answer_ids(directory)
            kept_dirs += 1
            continue
        if _newest_mtime(directory) < cutoff.timestamp():
            removed_dirs.append(directory)
    if kept_dirs:
        drafts = sorted({d for k, ds in windows.items() for d in ds})
        report.kept["nights' data"] = (f"{kept_dirs} directories (answers, held-out prompts, shards, corpus) of the "
                                       f"windows of registered drafts {', '.join(drafts)} (--force removes them)")
    removed_paths = {str(d) for d in removed_dirs}
    nights = 0
    for pool_dir in (run_root() / "pool").glob(f"*/{POOL_MANIFEST}"):
        pool = AnswerPool(pool_dir.parent, json.loads(pool_dir.read_text()))
        changed = False
        for raw in pool.manifest["nights"]:
            if raw.get("evicted_at") or not any(raw["answers"].startswith(p + os.sep) for p in removed_paths):
                continue
            _delete_night_data(PoolNight(**raw))
            raw["evicted_at"] = now.isoformat()
            nights += 1
            changed = True
        if changed:
            pool.save()
    for directory in removed_dirs:
        shutil.rmtree(directory, ignore_errors=True)
    report.removed["nights' data directories"] = len(removed_dirs)
    report.removed["pool nights"] = nights
    with LogStore(log_db) as store:
        counts = store.prune_before(cutoff, keep_ids)
        report.removed["conversations"] = counts["conversations"]
        report.removed["quarantined records"] = counts["quarantine"]
        if counts["kept"]:
            report.kept["conversations"] = (f"{counts['kept']} older ones named by a registered draft's held-out "
                                            "prompts or training window")
        store.add_decision("prune", "", None, json.dumps({"cutoff": cutoff.isoformat(), "force": force,
                                                          "removed": report.removed}))
    return report


def _rewrite_answers(path: Path, forgotten: set[str]) -> int:
    """Drop the records of forgotten ids from an answers JSONL, atomically; returns how many."""
    lines = path.read_text(encoding="utf-8").split("\n")
    keep, dropped = [], 0
    for line in lines:
        try:
            rid = str(json.loads(line).get("id")) if line.strip() else None
        except (ValueError, AttributeError):
            rid = None
        if rid is not None and rid.split("~")[0] in forgotten:  # `<id>~log`: a logged response labelled beside it
            dropped += 1
        else:
            keep.append(line)
    if dropped:
        tmp = path.with_name(f".{path.name}.tmp")
        with paths.open_private(tmp, "w", encoding="utf-8") as f:
            f.write("\n".join(keep))
        tmp.replace(path)
    return dropped


def _drop_shard_rows(shard: Path, forgotten: set[str]) -> int:
    """Rewrite a teacher or feature shard without the forgotten examples' tensors; returns how many went."""
    from safetensors import safe_open  # lazy: torch only when there are shards to rewrite

    from specdistill.distill.shards import write_shard  # lazy: torch only when there are shards to rewrite

    with safe_open(str(shard), framework="pt") as f:
        keys = list(f.keys())
        gone = {k for k in keys if k.split("/", 1)[0].split("~")[0] in forgotten}
        if not gone:
            return 0
        tensors = {k: f.get_tensor(k) for k in keys if k not in gone}
    examples = len({k.split("/", 1)[0] for k in gone})
    if tensors:
        write_shard(shard, tensors)
    else:
        shard.unlink()
    return examples


def forget(*, ids: list[int] = (), user: str | None = None, source: str | None = None,
           log_db: str | None = None) -> RetentionReport:
    """Forget conversations everywhere (see the module docstring); running it again removes nothing more."""
    asked = json.dumps({"ids": sorted(int(i) for i in ids), "user": user, "source": source}, sort_keys=True)
    report = RetentionReport("forget")
    with LogStore(log_db) as store:
        gone = store.forget(ids=ids, user=user, source=source)
    forgotten = {str(i) for i in gone} | {str(int(i)) for i in ids}
    report.removed["conversations"] = len(gone)
    windows = registered_windows()
    home = paths.home()
    touched: set[str] = set()
    rows = shards_examples = 0
    for path in sorted(home.rglob("*.jsonl")) if forgotten else []:
        if path.is_symlink() or path.name.endswith(".sglang.jsonl"):
            continue
        n = _rewrite_answers(path, forgotten)
        if n:
            rows += n
            touched.add(str(path.resolve()))
            key = path.parent.name.split("-", 1)[0]
            if path.name == "train_generated.jsonl" and key in windows:
                report.drafts += windows[key]
    for shard in sorted(home.rglob("shard-*.safetensors")) if forgotten else []:
        if not shard.is_symlink():
            shards_examples += _drop_shard_rows(shard, forgotten)
    corpora = 0
    for corpus in sorted(home.rglob(CORPUS_GLOB)) if touched else []:
        if corpus.is_symlink() or corpus.name.endswith(".tmp"):
            continue
        try:
            _, meta = load_corpus(corpus)
        except CorpusError as exc:
            report.notes.append(f"{corpus}: not rebuilt ({exc})")
            continue
        if not any(str(Path(s).resolve()) in touched for s in meta.sources):
            continue
        sequences = []
        for source_path in meta.sources:
            for line in Path(source_path).read_text(encoding="utf-8").splitlines() if Path(source_path).is_file() else []:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("source") != "other" and rec.get("response_ids"):
                    sequences.append([int(t) for t in rec["response_ids"]])
        meta.created = time.time()
        save_corpus(corpus, sequences, meta)
        corpora += 1
        export = corpus.with_name(corpus.stem + ".sglang.jsonl")
        if export.is_file():
            export.unlink()
            report.notes.append(f"{export} deleted (the answers' text): the next nightly writes it again")
    report.removed.update({"answer records": rows, "shard examples": shards_examples, "suffix corpora rebuilt": corpora})
    report.drafts = sorted(set(report.drafts))
    digest = hashlib.sha256(asked.encode()).hexdigest()[:16]
    with LogStore(log_db) as store:  # what was done, by counts; what was asked, by hash only
        store.add_decision("forget", "", None, json.dumps({"asked_sha256": digest, "removed": report.removed,
                                                           "drafts": report.drafts}))
    return report
