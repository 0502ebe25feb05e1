"""Target versions: which target is served now, and every version served before it.

A target version is its fingerprint (weights + tokenizer, `modeling.fingerprints.fingerprint`) and where it lives.
The history is one append-only JSON file under `$SPECDISTILL_HOME` (`targets.json`), replaced
atomically on every write, so a reader never sees half a history. The last entry is the current
version. The monitor calls `detect_change` on its schedule; `specdistill target register PATH`
records a version on purpose (and the flow layer announces it).

Paths are recorded absolute, so the history names the same model from any working directory. A
served name (`--served-name`: the model name production logs a version's responses under) belongs
to one version at a time, from the moment it was registered for it until another version claims it:
a response logged under it is that version's own answer only if it arrived in that period.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
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
    # responses are its own answers, used as training data as they are (`pipeline.stages.answers.logged`)
    served_names: tuple[str, ...] = ()
    # when a name was added to this version after its registration (ISO 8601); else it holds from `registered_at`
    served_since: dict[str, str] = field(default_factory=dict)
    # names this version was served under until another version claimed them (ISO 8601, when): its history,
    # no longer in `served_names`, so that a served name is listed by one version only
    served_until: dict[str, str] = field(default_factory=dict)

    def name_since(self, name: str) -> datetime:
        return datetime.fromisoformat(self.served_since.get(name, self.registered_at))

    def gives_up(self, names: Iterable[str], when: str) -> TargetVersion:
        """This version, no longer served under `names` (another version claimed them at `when`)."""
        lost = [n for n in names if n in self.served_names]
        if not lost:
            return self
        return replace(self, served_names=tuple(n for n in self.served_names if n not in lost),
                       served_until={**self.served_until, **dict.fromkeys(lost, when)})


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
    if not path.exists():
        return []
    data = paths.read_json(path, "target history")  # a FIFO, a directory, a huge or too deeply nested file: named
    try:
        versions = [TargetVersion(**{**entry, "served_names": tuple(entry.get("served_names", ())),
                                     "served_since": dict(entry.get("served_since", {})),
                                     "served_until": dict(entry.get("served_until", {}))}) for entry in data["versions"]]
        return _one_holder_each(versions)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"corrupt target history {path}: {exc}") from exc


def _one_holder_each(history: list[TargetVersion]) -> list[TargetVersion]:
    """A history where each served name is listed by the version that claimed it last only; the versions that
    held it before keep it as history (`served_until`: until the next claim). A file written before names moved
    listed a name under every version registered with it."""
    for name, timeline in _claims(history).items():
        holders = [i for i, v in enumerate(history) if name in v.served_names]
        if len(holders) < 2:
            continue
        ends = {fp_since: timeline[k + 1][0] for k, fp_since in enumerate(timeline[:-1])}
        last = max(holders, key=lambda i: (history[i].name_since(name), i))
        for i in holders:
            if i != last:
                until = ends.get((history[i].name_since(name), history[i].fingerprint))
                history[i] = history[i].gives_up([name], until.isoformat() if until else history[last].served_since.get(
                    name, history[last].registered_at))
    return history


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


def absolute_ref(ref: str | os.PathLike) -> str:
    """A model reference as it reads from any directory: a path made absolute (symbolic links kept, so
    a link that moves to the next version is followed); `demo` and `models:/` URIs as they are."""
    ref = str(ref)
    if ref == "demo" or "://" in ref or ref.startswith("models:/"):
        return ref
    return os.path.abspath(ref)


def register_target(ref: str | os.PathLike, *, fingerprint: str | None = None, model_dir: str | Path | None = None,
                    path: str | Path | None = None, served_names: tuple[str, ...] | list[str] = ()) -> TargetVersion:
    """Record `ref` as the current target version (appended even when it equals an older version:
    a rollback to an earlier target is a change too). Registering the current version again is a no-op,
    except that `served_names` it did not have yet are added to it, from now on."""
    if fingerprint is None or model_dir is None:
        fingerprint, model_dir = fingerprint_of(ref)
    for name in served_names:
        if not name or not name.strip() or len(name) > 256:
            raise ValueError(f"a served model name is 1 to 256 characters, not {name!r}")
    ref, model_dir = absolute_ref(ref), os.path.abspath(model_dir)
    path = Path(path) if path else history_path()
    history = target_history(path)
    now = datetime.now(timezone.utc).isoformat()
    if history and history[-1].fingerprint == fingerprint and history[-1].path == model_dir:
        last = history[-1]
        added = [n for n in dict.fromkeys(served_names) if n not in last.served_names]
        if not added:
            return last
        updated = replace(last, served_names=(*last.served_names, *added), served_since={**last.served_since,
                          **dict.fromkeys(added, now)}, served_until={k: v for k, v in last.served_until.items() if k not in added})
        _write_history([v.gives_up(added, now) for v in history[:-1]] + [updated], path)  # a name moves: one holder
        return updated
    version = TargetVersion(fingerprint, model_dir, ref, now, tuple(dict.fromkeys(served_names)))
    _write_history([v.gives_up(version.served_names, now) for v in history] + [version], path)
    return version


Period = tuple[datetime | None, datetime | None]  # [since, until); None: unbounded


def _claims(history: list[TargetVersion]) -> dict[str, list[tuple[datetime, str]]]:
    """Each served name's registrations, in time order: (since, fingerprint)."""
    claims: dict[str, list[tuple[datetime, str]]] = {}
    for v in history:
        for name in (*v.served_names, *v.served_until):  # held now, or until another version claimed it
            claims.setdefault(name, []).append((v.name_since(name), v.fingerprint))
    return {name: sorted(c, key=lambda c: c[0]) for name, c in claims.items()}


def served_name_periods(fingerprint: str, mapped: Iterable[str] = (), path: str | Path | None = None) -> dict[str, list[Period]]:
    """When each served name was this version's: from a registration that gave it the name until the next
    registration of the name for another version. `mapped` names (a config's mapping of a name to this
    version) hold too, except while a registration gave the name to another version."""
    claims, mapped = _claims(target_history(path)), set(mapped)
    out: dict[str, list[Period]] = {}
    for name in sorted(set(claims) | mapped):
        timeline = claims.get(name, [])
        first = timeline[0][0] if timeline else None
        segments: list[tuple[datetime | None, datetime | None, str | None]] = [
            (None, first, fingerprint if name in mapped else None)]
        segments += [(since, timeline[i + 1][0] if i + 1 < len(timeline) else None, fp)
                     for i, (since, fp) in enumerate(timeline)]
        periods: list[Period] = []
        for since, until, holder in segments:
            if holder != fingerprint or (since is not None and since == until):
                continue
            if periods and periods[-1][1] == since:
                periods[-1] = (periods[-1][0], until)  # one continuous holding
            else:
                periods.append((since, until))
        if periods:
            out[name] = periods
    return out


def held_at(periods: list[Period], when: datetime) -> bool:
    return any((since is None or since <= when) and (until is None or when < until) for since, until in periods)


def name_holder(name: str, when: datetime, path: str | Path | None = None) -> str | None:
    """The fingerprint that held a served name at `when` by registration, or None."""
    holder = None
    for since, fp in _claims(target_history(path)).get(name, []):
        if since <= when:
            holder = fp
    return holder


def detect_change(ref: str | os.PathLike) -> tuple[bool, TargetVersion, TargetVersion | None]:
    """(changed, current, previous): the model at `ref` against the recorded current version, which a changed
    fingerprint becomes. A first sighting is recorded as no change: there is nothing the champion could have drifted from."""
    fp, model_dir = fingerprint_of(ref)
    recorded = current_target()
    if recorded is not None and recorded.fingerprint == fp:
        return False, recorded, None
    current = register_target(ref, fingerprint=fp, model_dir=model_dir)
    return recorded is not None, current, recorded
