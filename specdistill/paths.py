"""Where state lives: `$SPECDISTILL_HOME` (default `.specdistill/` in the working directory).

Each location can be overridden on its own, so two state directories never interfere and tests
can share one model cache while keeping everything else in a temporary directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("SPECDISTILL_HOME") or ".specdistill").resolve()


def model_cache_dir() -> Path:
    """Dequantized GGUF targets, cached as safetensors (shared across runs)."""
    override = os.environ.get("SPECDISTILL_MODEL_CACHE")
    return Path(override).resolve() if override else home() / "models"


def ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


PRIVATE_FILE_MODE = 0o600  # files holding production traffic or answers to it: the owner only
PRIVATE_DIR_MODE = 0o700


def ensure_private(path: Path) -> Path:
    """A directory for files that hold traffic (teacher caches, features): created 0700."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=PRIVATE_DIR_MODE)
    except FileExistsError:
        pass
    return path


def create_private_file(path: Path) -> Path:
    """Create `path` empty with mode 0600 unless it exists (a database file before its engine opens it:
    SQLite keeps the mode and gives its journal and WAL files the same)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE))
    except FileExistsError:
        pass
    return path


# --------------------------------------------------------------------------------------------
# Output directories: a command never deletes what it did not create

OUTPUT_MARKER = ".specdistill-output.json"  # written into every directory atomic_dir makes


class UnsafeOutputError(ValueError):
    """An output directory that would replace what this command did not write (the message says why)."""


def output_kind(directory: Path) -> str | None:
    """The kind recorded by the command that wrote `directory` (None: not one of our outputs)."""
    try:
        marker = json.loads((Path(directory) / OUTPUT_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker.get("kind") if isinstance(marker, dict) else None


def _is_within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_output_dir(out_dir: Path, kind: str, *, force: bool) -> bool:
    """Whether `out_dir` may be written as a `kind` output; returns True when one exists there already.

    Refused: the working directory, the state directory or any directory containing either; a file;
    a non-empty directory that is not a previous `kind` output (our marker file); a previous output
    without `force`."""
    out = Path(out_dir).absolute().resolve()
    for what, where in (("the working directory", Path.cwd().resolve()), ("the state directory", home())):
        if _is_within(where, out):
            raise UnsafeOutputError(f"output directory {out_dir} is {what} or contains it ({where}): choose a new directory")
    if not out.exists() and not out.is_symlink():
        return False
    if not out.is_dir() or out.is_symlink():
        raise UnsafeOutputError(f"output {out_dir} exists and is not a directory: choose a new directory")
    if not any(out.iterdir()):
        return False
    found = output_kind(out)
    if found != kind:
        what = "files this command did not write" if found is None else f"a {found} output, not a {kind} one"
        raise UnsafeOutputError(f"output directory {out_dir} holds {what}: nothing was changed; choose a new directory "
                                "(or remove it yourself)")
    if not force:
        raise UnsafeOutputError(f"output directory {out_dir} holds a previous {kind} output: pass --force to replace it")
    return True


@contextlib.contextmanager
def atomic_dir(out_dir: Path, kind: str, *, replace: bool = True, force: bool = True) -> Iterator[Path]:
    """Build a directory beside `out_dir`, then rename it into place: after a kill there is either
    the old directory or the complete new one, never half a checkpoint.

    The new directory carries a marker naming `kind`; an existing `out_dir` is replaced only when it
    is a previous `kind` output and `force` is set (`check_output_dir`), and never when `replace` is
    False (someone else finished first: theirs is kept). Nothing else is ever deleted."""
    out_dir = Path(out_dir)
    if replace:
        check_output_dir(out_dir, kind, force=force)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    tmp.chmod(0o755)
    try:
        yield tmp
        (tmp / OUTPUT_MARKER).write_text(json.dumps({"kind": kind, "written_at": time.time()}))
        if out_dir.exists() and any(out_dir.iterdir()):
            if not replace:  # someone else finished first: theirs is as good as ours
                shutil.rmtree(tmp)
                return
            check_output_dir(out_dir, kind, force=force)  # again: it may have appeared meanwhile
            old = Path(tempfile.mkdtemp(prefix=out_dir.name + ".old-", dir=out_dir.parent))
            os.replace(out_dir, old / "previous")  # two renames: the previous output is gone only once ours is in
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
            return
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_json(path: Path, what: str = "file"):
    """A JSON file's value; unreadable or corrupt is a `ValueError` naming the file (never a bare
    `Expecting value: line 2 column 1`)."""
    path = Path(path)
    try:
        return json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"corrupt {what} {path}: {exc}") from None
    except IsADirectoryError:
        raise ValueError(f"{what} {path} is a directory, not a JSON file") from None


def atomic_write_json(path: Path, data, *, mode: int = PRIVATE_FILE_MODE) -> Path:
    """Replace a small JSON file so that readers see the old content or the new, never a mix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
