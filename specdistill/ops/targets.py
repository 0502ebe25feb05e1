"""Target versions: which target is served now, and every version served before it.

A target version is its fingerprint (weights + tokenizer, `modeling.fingerprints.fingerprint`) and where it lives.
The history is one append-only JSON file under `$SPECDISTILL_HOME` (`targets.json`), replaced
atomically on every write, so a reader never sees half a history. The last entry is the current
version. The monitor calls `detect_change` on its schedule; `specdistill target register PATH`
records a version on purpose (and the flow layer announces it).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from specdistill import paths
from specdistill.data.record import Record

TARGETS_FILE = "targets.json"


@dataclass(frozen=True)
class TargetVersion(Record):
    fingerprint: str
    path: str  # the HF directory the weights were read from
    ref: str  # the reference it was registered under (`demo`, a directory, a .gguf file)
    registered_at: str  # ISO 8601, UTC
    # the model names production logs this version's responses under (an OpenAI log's `model`): those
    # responses are its own answers, used as training data as they are (`pipeline.answers.logged`)
    served_names: tuple[str, ...] = ()


@dataclass
class TargetChange(Record):
    """What the monitor found: the served target against the last recorded version and the champion's."""

    changed: bool  # the served target's fingerprint differs from the last run's
    drifted: bool  # changed, or the champion was distilled for another target
    champion_target: str | None  # the fingerprint the champion was distilled for (its tag)
    current: TargetVersion
    previous: TargetVersion | None = None


def history_path() -> Path:
    override = os.environ.get("SPECDISTILL_TARGETS_FILE")
    return Path(override).resolve() if override else paths.home() / TARGETS_FILE


def target_history(path: str | Path | None = None) -> list[TargetVersion]:
    """Every recorded version, oldest first."""
    path = Path(path) if path else history_path()
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text())
        return [TargetVersion(**{**entry, "served_names": tuple(entry.get("served_names", ()))}) for entry in data["versions"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"corrupt target history {path}: {exc}") from exc


def current_target(path: str | Path | None = None) -> TargetVersion | None:
    history = target_history(path)
    return history[-1] if history else None


def _write_history(versions: list[TargetVersion], path: Path) -> None:
    paths.atomic_write_json(path, {"versions": [v.to_dict() for v in versions]})


def fingerprint_of(ref: str | os.PathLike) -> tuple[str, Path]:
    """(fingerprint, HF directory) of a model reference; cached beside the weights after the first time."""
    from specdistill.modeling.models import load_model  # lazy: keeps torch off import

    loaded = load_model(ref)
    return loaded.fingerprint, loaded.path


def register_target(ref: str | os.PathLike, *, fingerprint: str | None = None, model_dir: str | Path | None = None,
                    path: str | Path | None = None, served_names: tuple[str, ...] | list[str] = ()) -> TargetVersion:
    """Record `ref` as the current target version (appended even when it equals an older version:
    a rollback to an earlier target is a change too). Registering the current version again is a no-op,
    except that `served_names` it did not have yet are added to it."""
    if fingerprint is None or model_dir is None:
        fingerprint, model_dir = fingerprint_of(ref)
    for name in served_names:
        if not name or not name.strip() or len(name) > 256:
            raise ValueError(f"a served model name is 1 to 256 characters, not {name!r}")
    path = Path(path) if path else history_path()
    history = target_history(path)
    if history and history[-1].fingerprint == fingerprint and history[-1].path == str(model_dir):
        last = history[-1]
        names = tuple(dict.fromkeys([*last.served_names, *served_names]))
        if names == last.served_names:
            return last
        updated = TargetVersion(last.fingerprint, last.path, last.ref, last.registered_at, names)
        _write_history(history[:-1] + [updated], path)
        return updated
    version = TargetVersion(fingerprint, str(model_dir), str(ref), datetime.now(timezone.utc).isoformat(),
                            tuple(dict.fromkeys(served_names)))
    _write_history(history + [version], path)
    return version


def detect_change(ref: str | os.PathLike) -> tuple[bool, TargetVersion, TargetVersion | None]:
    """(changed, current, previous): the model at `ref` against the recorded current version, which a changed
    fingerprint becomes. A first sighting is recorded as no change: there is nothing the champion could have drifted from."""
    fp, model_dir = fingerprint_of(ref)
    recorded = current_target()
    if recorded is not None and recorded.fingerprint == fp:
        return False, recorded, None
    current = register_target(ref, fingerprint=fp, model_dir=model_dir)
    return recorded is not None, current, recorded
