"""Registered drafts as model references: `models:/NAME@ALIAS` or `models:/NAME/VERSION` resolved to
the HF checkpoint a logged draft carries, and the MLflow client every registry call goes through.

Registering and promoting are operations (`ops.registry`). Registration records the SHA-256 of every
file of a checkpoint in the version's tag `draft_files_sha256` (in the tracking store, apart from the
artifact store), and every resolution checks the files against it, so a draft changed after the gate
approved it is refused; so is a version without the tag (removed, or registered before it existed).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import mlflow
import sqlalchemy as sa
import yaml
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from specdistill import paths
from specdistill.env import driver_url, mask_url
from specdistill.recipe import load_yaml

DRAFT_ARTIFACT = "draft"
FILES_TAG = "draft_files_sha256"  # {relative path: sha256} of the registered checkpoint's files
# written into a checkpoint directory by a load (a fingerprint record), not part of what was registered
UNHASHED_FILES = ("specdistill_fingerprint.json", "specdistill_source.json")


class RegisteredDraftChanged(ValueError):
    """A registered draft whose files differ from the hashes recorded when it was registered."""


def tracking_uri() -> str:
    """`MLFLOW_TRACKING_URI` when set (an `mlflow server` on PostgreSQL), else SQLite in the state directory
    (created 0600: its runs and tags describe production traffic)."""
    if os.environ.get("MLFLOW_TRACKING_URI"):  # an @ in its password read as every parser reads it
        return driver_url(os.environ["MLFLOW_TRACKING_URI"])
    return f"sqlite:///{paths.create_private_file(paths.ensure(paths.home()) / 'mlflow.db')}"


class TrackingServerError(RuntimeError):
    """The MLflow tracking server cannot be reached, or its SQLite store read; the message names its URI
    (credentials masked) or the file."""


REACH_SECONDS = 5.0  # how long an unreachable tracking server is retried before the command stops
_reached: set[str] = set()


def check_reachable(uri: str) -> None:
    """An `http(s)://` tracking server answers at all (any HTTP status counts), retried for
    `REACH_SECONDS`, once per process and URI: an unreachable one stops the command in seconds
    with one line naming it, instead of MLflow's own minutes of retries and a traceback."""
    if uri in _reached:
        return
    if not uri.startswith(("http://", "https://")):
        if "://" in uri and not uri.startswith(("file:", "sqlite:")):  # a database-backed store: its URL parses

            try:
                sa.make_url(uri)
            except (sa.exc.ArgumentError, ValueError):
                raise TrackingServerError(f"MLFLOW_TRACKING_URI {mask_url(uri)}: not a database URL "
                                          "(is its port a number?)") from None
        return

    parts = urllib.parse.urlsplit(uri)
    try:
        port = parts.port
    except ValueError:
        raise TrackingServerError(f"MLFLOW_TRACKING_URI {mask_url(uri)}: its port is not a number") from None
    host = parts.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{port}" if port else "")
    health = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/") + "/health", "", ""))
    deadline = time.monotonic() + REACH_SECONDS
    while True:
        try:
            with urllib.request.urlopen(health, timeout=max(0.5, min(2.0, REACH_SECONDS))):
                break
        except urllib.error.HTTPError:  # it answered: reachable (auth, a proxy's 404: MLflow says what)
            break
        except (urllib.error.URLError, OSError, ValueError) as exc:
            if time.monotonic() >= deadline:
                reason = getattr(exc, "reason", exc)
                raise TrackingServerError(
                    f"MLflow tracking server {mask_url(uri)} (MLFLOW_TRACKING_URI) is unreachable after "
                    f"{REACH_SECONDS:.0f} s: {reason}") from None
            time.sleep(0.5)
    _reached.add(uri)


def check_sqlite_store(uri: str) -> None:
    """A SQLite tracking store is a sound SQLite database before MLflow opens it (MLflow's own error is a
    SQLAlchemy traceback with its schema query), once per process and URI; a new, empty file is fine."""
    if not uri.startswith("sqlite:") or uri in _reached:
        return

    try:
        database = sa.make_url(uri).database
    except (sa.exc.ArgumentError, ValueError):
        return  # MLflow names a URL it cannot parse
    path = Path(database) if database and database != ":memory:" else None
    if path is not None and path.is_file() and path.stat().st_size:
        try:
            with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as con:
                verdict = con.execute("PRAGMA quick_check(1)").fetchone()[0]
        except sqlite3.Error as exc:
            verdict = str(exc)
        if verdict != "ok":
            raise TrackingServerError(f"MLflow's store {path} is not a readable SQLite database ({verdict}): restore it "
                                      "from a backup, or move it aside to start an empty registry")
    _reached.add(uri)


def client() -> MlflowClient:
    uri = tracking_uri()
    check_reachable(uri)
    check_sqlite_store(uri)
    # mlflow.set_*_uri also export MLFLOW_*_URI to the environment; put back what the user had, so
    # the next call (another state directory in the same process) resolves its own store again.
    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def download_draft(model_uri: str) -> Path:
    """A registered draft's HF directory (`models:/NAME@champion`, `models:/NAME/3`), cached by version."""
    c = client()
    match = re.fullmatch(r"models:/([^/@]+)(?:@([^/]+)|/(\d+))", model_uri)
    if not match:
        raise ValueError(f"not a registered model URI: {model_uri!r} (expected models:/NAME@ALIAS or models:/NAME/VERSION)")
    name, alias, number = match.groups()
    try:
        mv = c.get_model_version_by_alias(name, alias) if alias else c.get_model_version(name, number)
    except MlflowException as exc:
        raise ValueError(f"{model_uri}: {exc.message}") from exc
    target = paths.registry_copies_dir() / name / str(mv.version)
    if not (target / "MLmodel").is_file():
        target.mkdir(parents=True, exist_ok=True)
        mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{mv.version}", dst_path=str(target))
    try:  # the HF checkpoint a logged draft model carries: the pyfunc artifact named `draft`
        meta = load_yaml(paths.read_whole(target / "MLmodel", "MLmodel file"))
        hf_dir = target / meta["flavors"]["python_function"]["artifacts"][DRAFT_ARTIFACT]["path"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError, yaml.YAMLError):
        hf_dir = None
    if hf_dir is None or not (hf_dir / "config.json").is_file():
        raise ValueError(f"{model_uri}: the registered model has no '{DRAFT_ARTIFACT}' checkpoint (MLmodel in {target})")
    verify_registered_files(hf_dir, (mv.tags or {}).get(FILES_TAG), name, str(mv.version))
    return hf_dir


_HASHED: dict[tuple, dict[str, str]] = {}  # a directory's hashes per process, keyed by every file's stat


def draft_files_sha256(directory: str | Path) -> dict[str, str]:
    """{relative path: SHA-256} of a checkpoint directory's files: what registration records. Memoized in
    the process by each file's inode, size, mtime and ctime (a rewrite moves ctime even when mtime is
    put back), so a nightly's repeated resolutions hash once."""
    directory = Path(directory)
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.relative_to(directory).as_posix() not in UNHASHED_FILES)
    key = (str(directory.resolve()), tuple((p.relative_to(directory).as_posix(), st.st_ino, st.st_size, st.st_mtime_ns,
                                            st.st_ctime_ns) for p in files for st in [p.stat()]))
    if key not in _HASHED:
        _HASHED.clear()  # one directory at a time is all a run resolves repeatedly
        _HASHED[key] = {rel: paths.file_sha256(directory / rel) for rel, *_ in key[1]}
    return dict(_HASHED[key])


def verify_registered_files(hf_dir: Path, recorded: str | None, name: str, version: str) -> None:
    """Refuse a registered draft whose files differ from the hashes recorded at registration (the
    message names the version and the file), and one without them: a removed tag is indistinguishable
    from a version that was never checked, and neither is served."""
    where = f"models:/{name}/{version}"
    if not recorded:
        raise RegisteredDraftChanged(f"{where} ({name} version {version}): no {FILES_TAG} tag, so its files cannot "
                                     "be verified against what was registered: a registered draft is never served "
                                     "unverified (register the draft again from its checkpoint to serve it)")
    try:
        want = json.loads(recorded)
    except ValueError:
        want = None
    if not isinstance(want, dict):
        raise RegisteredDraftChanged(f"{where}: its {FILES_TAG} tag is not the JSON registration wrote: "
                                     f"the version cannot be verified")
    have = draft_files_sha256(hf_dir)
    for rel in sorted(set(want) | set(have)):
        if rel not in have:
            problem = "is missing"
        elif rel not in want:
            problem = "was added after registration"
        elif have[rel] != want[rel]:
            problem = "differs from the SHA-256 recorded at registration"
        else:
            continue
        raise RegisteredDraftChanged(f"{where} ({name} version {version}): {hf_dir / rel} {problem}: "
                                     "a registered draft is never served changed")
