"""The names of a night's data files and how an answers file is read back: what the answer pool and retention
need from a night's directory without importing torch (`logs prune` and `logs forget` stay light)."""

from __future__ import annotations

import json
from pathlib import Path

FEATURE_META = "feature_cache.json"  # beside a night's feature shards (distill.features)
CACHE_META = "teacher_cache.json"  # beside a night's teacher shards (distill.teacher)


def read_done(path: Path) -> dict[str, dict]:
    """The records of an answers JSONL by id; a torn last line (killed mid-write) is ignored and rewritten."""
    done: dict[str, dict] = {}
    if not path.exists():
        return done
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[str(rec["id"])] = rec
    return done
