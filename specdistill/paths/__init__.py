"""Where state lives: `$SPECDISTILL_HOME` (default `.specdistill/` in the working directory).

Each location can be overridden on its own, so two state directories never interfere and tests
can share one model cache while keeping everything else in a temporary directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from specdistill.paths.files import (  # noqa: F401  (the file helpers every writer and reader uses)
    MAX_WHOLE_FILE_BYTES,
    PRIVATE_FILE_MODE,
    PUBLIC_FILE_MODE,
    UnsafeFileError,
    atomic_copy,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    check_regular,
    open_append,
    open_no_follow,
    open_regular,
    os_error_reason,
    parse_json,
    read_json,
    read_only_reason,
    read_whole,
    remove_entry,
)


def home() -> Path:
    return Path(os.environ.get("SPECDISTILL_HOME") or ".specdistill").resolve()


def model_cache_dir() -> Path:
    """Dequantized GGUF targets, cached as safetensors (shared across runs)."""
    override = os.environ.get("SPECDISTILL_MODEL_CACHE")
    return Path(override).resolve() if override else home() / "models"


# Production traffic and the target's answers to it (the log store, the nightly's data, teacher caches,
# features, corpora, MLflow's store) are the owner's only. The state directory is not listable by others,
# but a serving engine running as another user can open what it must read, and only that: `serving.json`
# (0644, no traffic) and the draft directories it names (registry/, fallback/: weights, 0755/0644). The
# suffix corpora it names stay private (answer text): an engine that reads them (SGLang's NGRAM external
# corpus) runs as the owner or is granted access by the operator.
PRIVATE_DIR_MODE = 0o700
STATE_DIR_MODE = 0o711


_warned: set[Path] = set()  # directories whose loose mode this process has warned about


def _warn_loose(directory: Path, mode: int, what: str) -> None:
    """One line on stderr, once per process and directory: other users can create files in `directory` (not
    created by specdistill, so its mode is never changed), where specdistill keeps what is private."""
    if directory in _warned:
        return
    _warned.add(directory)
    print(f"specdistill: warning: other users can create files in {what} {directory} (mode {mode & 0o7777:04o}); "
          "specdistill never changes the mode of a directory it did not create: give it a directory of your own "
          "(mode 0711 or 0700)", file=sys.stderr)


def _not_a_directory(path: Path, what: str) -> None:
    if path.exists() and not path.is_dir():
        raise UnsafeFileError(f"{what} {path} is a file, not a directory: point it at a directory (or move the file)")


def _secure_home(path: Path) -> None:
    """Before anything is created inside the state directory: create it 0711; one that was there is never
    chmod-ed (it may be /tmp, or a shared 1777 directory): one that others can write into is warned about."""
    root = home()
    if not is_within(Path(path).absolute().resolve(), root):
        return
    _not_a_directory(root, "the state directory (SPECDISTILL_HOME)")
    try:
        root.mkdir(mode=STATE_DIR_MODE, parents=True)
        return
    except FileExistsError:
        pass
    _not_a_directory(root, "the state directory (SPECDISTILL_HOME)")
    mode = root.stat().st_mode
    if mode & (0o022 | stat.S_ISVTX):
        _warn_loose(root, mode, "the state directory")


def _ours_from_before(path: Path) -> bool:
    """Whether an existing `path` is a directory an older version of specdistill created in the state
    directory (owned by this user, inside it, neither shared nor sticky): the only existing ones tightened."""
    info = path.lstat()
    return (stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & (0o022 | stat.S_ISVTX)
            and is_within(path.absolute().resolve(), home()) and path.absolute().resolve() != home())


def ensure(path: Path) -> Path:
    _secure_home(path)
    _not_a_directory(Path(path), "directory")
    path.mkdir(parents=True, exist_ok=True)
    return path


def ensure_private(path: Path) -> Path:
    """A directory for files that hold traffic (teacher caches, features, the nightly's data): 0700, created
    so, or tightened when an older version made it 0755 in the state directory; any other existing one is
    never chmod-ed (a warning says when others can create files in it)."""
    path = Path(path)
    _secure_home(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=PRIVATE_DIR_MODE)
        return path
    except FileExistsError:
        pass
    _not_a_directory(path, "directory")
    mode = path.stat().st_mode
    if mode & 0o077:
        if _ours_from_before(path):
            path.chmod(PRIVATE_DIR_MODE)
        elif mode & (0o022 | stat.S_ISVTX):
            _warn_loose(path.absolute(), mode, "the directory")
    return path


def create_private_file(path: Path) -> Path:
    """Create `path` empty with mode 0600 unless it exists (a database file before its engine opens it:
    SQLite keeps the mode and gives its journal and WAL files the same)."""
    path = Path(path)
    _secure_home(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE))
    return path


def _private_opener(path: str, flags: int) -> int:
    fd = open_no_follow(path, flags, PRIVATE_FILE_MODE)
    os.fchmod(fd, PRIVATE_FILE_MODE)  # one that exists (an older version wrote it 0644) is tightened too
    return fd


def open_private(path: str | os.PathLike, mode: str = "w", **kwargs: Any) -> IO:
    """`open()` for a file that holds traffic or answers (JSONL of conversations or answers, a corpus
    export): mode 0600, whether it is created now or was there; a symbolic link or a FIFO at its name is
    refused (`UnsafeFileError`), never written through."""
    return open(path, mode, opener=_private_opener, **kwargs)


# --------------------------------------------------------------------------------------------
# Output directories: a command never deletes what it did not create

OUTPUT_MARKER = ".specdistill-output.json"  # written into every output directory: its kind and what it wrote


class UnsafeOutputError(ValueError):
    """An output directory that would replace what this command did not write (the message says why)."""


def registry_artifacts_dir() -> Path:
    """Where the local MLflow registry keeps its artifacts (registered drafts): never written by a command."""
    return home() / "mlartifacts"


def registry_copies_dir() -> Path:
    """Where registered drafts are downloaded to be loaded and served: a copy of a version, never written over."""
    return home() / "registry"


def registry_stores() -> list[tuple[str, Path]]:
    """The directories that hold registered model versions: the artifact store, its local copies and, when
    `MLFLOW_TRACKING_URI` is a local file store, that store. A version the gate approved is what is served:
    no output is ever written inside these."""
    stores = [("the model registry's artifact store", registry_artifacts_dir()),
              ("the registered drafts' local copies", registry_copies_dir())]
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri.startswith("file:"):
        stores.append(("the MLflow file store", Path(urllib.parse.urlparse(uri).path)))
    elif uri and "://" not in uri and not uri.startswith(("sqlite:", "postgresql", "mysql", "databricks")):
        stores.append(("the MLflow file store", Path(uri)))
    return [(what, where.absolute().resolve()) for what, where in stores]


def output_marker(directory: Path) -> dict | None:
    """The marker of the command that wrote `directory` (None: not one of our outputs)."""
    try:
        marker = read_json(Path(directory) / OUTPUT_MARKER, "output marker")
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def output_kind(directory: Path) -> str | None:
    marker = output_marker(directory)
    return marker.get("kind") if marker else None


def is_within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_output_location(out_dir: Path) -> Path:
    """`out_dir` resolved, if an output may live there at all (else `UnsafeOutputError` says why)."""
    raw = Path(out_dir).absolute()
    out = raw.resolve()
    for what, where in (("the working directory", Path.cwd().resolve()), ("the state directory", home())):
        if is_within(where, out):
            raise UnsafeOutputError(f"output directory {out_dir} is {what} or contains it ({where}): choose a new directory")
    for what, where in registry_stores():
        if is_within(out, where) or is_within(where, out):
            raise UnsafeOutputError(f"output directory {out_dir} is inside {what} ({where}) or contains it: a registered "
                                    "version is never changed; choose a directory outside it")
    if raw.is_symlink():
        raise UnsafeOutputError(f"output {out_dir} is a symbolic link (to {os.readlink(raw)}): choose a new directory")
    for parent in out.parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise UnsafeOutputError(f"output directory {out_dir}: {parent} is not a directory")
            break
    if out.exists() and not out.is_dir():
        raise UnsafeOutputError(f"output {out_dir} exists and is not a directory: choose a new directory")
    return out


def check_output_dir(out_dir: Path, kind: str, *, force: bool, resume: bool = False) -> bool:
    """Whether `out_dir` may be written as a `kind` output; True when one exists there already. Called
    before any work, so a refusal costs nothing; `resume`: a training run continues its own checkpoints."""
    out = check_output_location(out_dir)
    if not out.exists() or not any(out.iterdir()):
        return False
    found = output_kind(out)
    if found != kind:
        what = "files this command did not write" if found is None else f"a {found} output, not a {kind} one"
        raise UnsafeOutputError(f"output directory {out_dir} holds {what}: nothing was changed; choose a new directory "
                                "(or remove it yourself)")
    if not force and not resume:
        raise UnsafeOutputError(f"output directory {out_dir} holds a previous {kind} output: pass --force to replace it")
    return True


def write_marker(directory: Path, kind: str, files: list[str]) -> None:
    """Mark `directory` as a `kind` output whose own entries are `files` (what `--force` may replace)."""
    marker = {"kind": kind, "written_at": time.time(), "files": sorted({*files, OUTPUT_MARKER})}
    atomic_write_json(Path(directory) / OUTPUT_MARKER, marker, mode=PUBLIC_FILE_MODE, indent=None)


def claim_output_dir(out_dir: Path, kind: str, files: list[str]) -> bool:
    """An output written in place (a training run: checkpoints, logs and the result appear as it goes),
    created with its marker listing `files`. True: a previous `kind` output resumes."""
    out = Path(out_dir)
    if check_output_dir(out, kind, force=False, resume=True):
        for name in files:  # what the run writes or appends to in place: never through a link it did not make
            if (out / name).is_symlink():
                raise UnsafeOutputError(f"{out / name} is a symbolic link (to {os.readlink(out / name)}), which this "
                                        f"command never makes: nothing was changed; remove it to resume the {kind} run")
        return True
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    tmp.chmod(0o755)
    write_marker(tmp, kind, files)
    try:
        os.replace(tmp, out)  # over a missing or an empty directory: the marker arrives with it
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return False


def release_output_dir(out_dir: Path, *, remove: bool) -> None:
    """Undo `claim_output_dir` after a run that failed before writing anything but the marker: the
    marker goes (and the directory, with `remove`: the run created it). Anything else the run wrote
    stays, marked as ours, so the next run resumes from it."""
    out = Path(out_dir)
    try:
        if [p.name for p in out.iterdir()] != [OUTPUT_MARKER]:
            return
        (out / OUTPUT_MARKER).unlink()
        if remove:
            out.rmdir()
    except OSError:
        pass


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _carry_over(old: Path, new: Path, kind: str) -> None:
    """Put what the user added to a previous output (what its marker does not list) into the new one,
    as hard links (the old directory keeps them until the swap: a kill loses nothing). A marker that
    lists nothing (an older version wrote it) is taken as listing what the new output writes; what
    else is there is refused, since it may be a stale file of ours that would change what loads."""
    marker = output_marker(old) or {}
    ours = marker.get("files")
    entries = sorted(p.name for p in old.iterdir())
    if not isinstance(ours, list):
        written = {p.name for p in new.iterdir()} | {OUTPUT_MARKER}
        unknown = [name for name in entries if name not in written]
        if unknown:
            raise UnsafeOutputError(f"output directory {old.name}: a previous {kind} output from an older version holds "
                                    f"{', '.join(unknown)}, which it does not list as its own: nothing was changed; "
                                    "move them or choose a new directory")
        return
    for name in entries:
        if name in ours:
            continue
        src, dst = old / name, new / name
        if dst.exists() or dst.is_symlink():
            raise UnsafeOutputError(f"output directory {old}: your {name} has the name of a file this command writes: "
                                    "nothing was changed; move it or choose a new directory")
        if src.is_dir() and not src.is_symlink():
            shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
        elif src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            _link_or_copy(str(src), str(dst))


def _readable(directory: Path) -> None:
    """An output directory (a draft, a target version, a model cache: weights, never traffic) readable
    by every user: a serving engine may run as another user, and some writers (safetensors) make 0600."""
    for root, dirs, files in os.walk(directory):
        for name in dirs:
            path = Path(root) / name
            path.chmod(path.stat().st_mode & 0o777 | 0o755)
        for name in files:
            path = Path(root) / name
            if not path.is_symlink():
                path.chmod(path.stat().st_mode & 0o777 | 0o644)


@contextlib.contextmanager
def atomic_dir(out_dir: Path, kind: str, *, replace: bool = True, force: bool = True) -> Iterator[Path]:
    """Build a directory beside `out_dir`, then rename it into place: after a kill there is either
    the old directory or the complete new one, never half a checkpoint. With `replace` False an
    existing output is kept (someone else finished first); files a user added beside one are kept."""
    out_dir = Path(out_dir)
    if replace:
        check_output_dir(out_dir, kind, force=force)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    tmp.chmod(0o755)
    try:
        yield tmp
        _readable(tmp)
        write_marker(tmp, kind, [p.name for p in tmp.iterdir()])
        if out_dir.exists() and any(out_dir.iterdir()):
            if not replace:  # someone else finished first: theirs is as good as ours
                shutil.rmtree(tmp)
                return
            check_output_dir(out_dir, kind, force=force)  # again: it may have appeared meanwhile
            _carry_over(out_dir, tmp, kind)
            old = Path(tempfile.mkdtemp(prefix=out_dir.name + ".old-", dir=out_dir.parent))
            os.replace(out_dir, old / "previous")  # two renames: the previous output is gone only once ours is in
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
            return
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()
