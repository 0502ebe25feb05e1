"""Reading and writing one file without being led elsewhere.

Every file the project writes is either replaced (written beside under a new name, then renamed over:
a symbolic link at its name is replaced, never written through) or opened with `O_NOFOLLOW` (appended
logs, the state lock): a link planted where one of our files goes is refused with a sentence naming it,
and a user's file it points to is never truncated, overwritten or chmod-ed. What the project reads is
a regular file, opened without blocking (a FIFO or a device is refused, not waited on), and what it
reads whole (JSON and YAML) is capped in size and in nesting, with the file named.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import resource
import shutil
import stat
import tempfile
from pathlib import Path
from typing import IO, Any, BinaryIO

PRIVATE_FILE_MODE = 0o600
PUBLIC_FILE_MODE = 0o644  # a run's results and logs, a draft's files: no traffic
MAX_WHOLE_FILE_BYTES = 64 << 20  # a JSON or YAML file read whole (a config, a record, serving.json): 64 MiB


class UnsafeFileError(ValueError):
    """A path this command will not read or write as a file (a symbolic link where a file of ours goes, a
    FIFO, a device, a directory, a file too large to read whole); the message names it."""


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def _link_refusal(path: str | os.PathLike) -> UnsafeFileError:
    try:
        to = f" (to {os.readlink(path)})"
    except OSError:
        to = ""
    return UnsafeFileError(f"{path} is a symbolic link{to}, which specdistill never makes where it writes a file: "
                           "nothing was written through it; remove the link and run the same command again")


def open_no_follow(path: str | os.PathLike, flags: int, mode: int = PRIVATE_FILE_MODE) -> int:
    """`os.open` of a regular file that is never a symbolic link (refused, even dangling) and never blocks
    (a FIFO is refused); created with `mode` when `flags` holds `O_CREAT`. A file descriptor."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.ENOENT and os.path.islink(path)):
            raise _link_refusal(path) from None
        if exc.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO no one reads, a directory
            kind = file_kind(os.lstat(path).st_mode) if os.path.lexists(path) else "not a regular file"
            raise UnsafeFileError(f"{path} is {kind}, not a regular file: nothing was written; remove it or "
                                  "choose another path") from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise UnsafeFileError(f"{path} is {file_kind(info.st_mode)}, not a regular file: nothing was read or written")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def open_append(path: str | os.PathLike, *, mode: int = PUBLIC_FILE_MODE, encoding: str = "utf-8") -> IO[str]:
    """A log (JSONL) opened to append, created with `mode`; a symbolic link at its name is refused."""
    fd = open_no_follow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode)
    return os.fdopen(fd, "a", encoding=encoding)


def _replace_onto(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        raise UnsafeFileError(f"{path} is a directory, not a file this command writes: nothing was changed; "
                              "move it or choose another path")


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, mode: int = PRIVATE_FILE_MODE) -> Path:
    """Replace `path` with `data`: written beside it (a new file, `O_EXCL`), synced, renamed over it. Readers
    see the old content or the new; a symbolic link at `path` is replaced, never written through."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _replace_onto(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str, *, mode: int = PRIVATE_FILE_MODE) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), mode=mode)


def atomic_write_json(path: str | os.PathLike, data: Any, *, mode: int = PRIVATE_FILE_MODE, **dump: Any) -> Path:
    """Replace a small JSON file so that readers see the old content or the new, never a mix."""
    return atomic_write_text(path, json.dumps(data, **{"indent": 2, **dump}), mode=mode)


def atomic_copy(src: str | os.PathLike, dst: str | os.PathLike, *, mode: int = PRIVATE_FILE_MODE) -> Path:
    """Replace `dst` with a copy of `src` (a large file: copied in blocks), written beside it and renamed over."""
    dst = Path(dst)
    _replace_onto(dst)
    fd, tmp = tempfile.mkstemp(prefix=dst.name + ".", suffix=".tmp", dir=dst.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as out, open_regular(src) as f:
            shutil.copyfileobj(f, out, 1 << 20)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dst


def remove_entry(path: str | os.PathLike) -> None:
    """Remove what is at `path` whatever it is: a link is unlinked (never followed), a directory removed
    with what it holds, a file unlinked; nothing there is fine."""
    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path)


def open_regular(path: str | os.PathLike, what: str = "file") -> BinaryIO:
    """`path` opened to read, binary, if it is a regular file (a link to one is fine): a directory, a FIFO
    or a device is an `UnsafeFileError` naming it, found without blocking; a missing file is
    `FileNotFoundError`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except IsADirectoryError:
        raise UnsafeFileError(f"{what} {path} is a directory, not a regular file") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise UnsafeFileError(f"{what} {path} is {file_kind(info.st_mode)}, not a regular file")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return os.fdopen(fd, "rb")


def check_regular(path: str | os.PathLike, what: str = "file") -> Path:
    """`path`, if it names a regular file (a link to one is fine): missing is `FileNotFoundError`, anything
    else an `UnsafeFileError` saying what it is. Checked with `stat`, never by opening it."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"{path}: no such file", str(path)) from None
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeFileError(f"{what} {path} is {file_kind(info.st_mode)}, not a regular file")
    return Path(path)


def _size_words(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def read_whole(path: str | os.PathLike, what: str = "file", max_bytes: int = MAX_WHOLE_FILE_BYTES) -> bytes:
    """A regular file's bytes, read whole only up to `max_bytes`: a larger one is an `UnsafeFileError`
    naming it and its size before anything is read."""
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(max_bytes + 1) if size <= max_bytes else b""
        if size > max_bytes or len(data) > max_bytes:
            raise UnsafeFileError(f"{what} {path} is {_size_words(max(size, len(data)))}, more than the "
                                  f"{_size_words(max_bytes)} a {what} may be: not read; is it the right file?")
    return data


def parse_json(data: bytes | str, path: str | os.PathLike, what: str = "file") -> Any:
    """A JSON value; corrupt or nested too deep for Python to parse is a `ValueError` naming the file."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError(f"corrupt {what} {path}: nested too deep (arrays or objects inside one another past "
                         "what can be parsed)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"corrupt {what} {path}: {exc}") from None


def read_json(path: str | os.PathLike, what: str = "file", max_bytes: int = MAX_WHOLE_FILE_BYTES) -> Any:
    """A JSON file's value; unreadable, too large, nested too deep or corrupt is a `ValueError` naming the
    file (never a bare `Expecting value: line 2 column 1` or `maximum recursion depth exceeded`)."""
    return parse_json(read_whole(path, what, max_bytes), path, what)


def read_only_reason(path: str | os.PathLike) -> str | None:
    """Why `path` (or, while it does not exist, the directory it would be created in) cannot be written:
    "X is on a read-only file system" or "X is read-only for this user"; None when it can."""
    where = Path(path).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        if os.statvfs(where).f_flag & os.ST_RDONLY:
            return f"{where} is on a read-only file system"
    except OSError:
        pass
    return None if os.access(where, os.W_OK) else f"{where} is read-only for this user"


def os_error_reason(exc: BaseException) -> str:
    """A failed write or open in words (a safetensors error carries its OS code in its text): a full disk,
    a file-size limit, a read-only file system, a permission."""
    code = getattr(exc, "errno", None)
    if code is None and (m := re.search(r"(?:code: |os error )(\d+)", str(exc))):
        code = int(m.group(1))
    if code == errno.ENOSPC:
        return "no space left on device"
    if code == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        return "file too large" + (f" (the file-size limit, `ulimit -f`, is {limit} bytes)" if limit != resource.RLIM_INFINITY else "")
    if code == errno.EDQUOT:
        return "disk quota exceeded"
    if code == errno.EROFS:
        return "read-only file system"
    if code in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return os.strerror(code).lower() if code else (str(exc).strip().splitlines() or [type(exc).__name__])[0]
