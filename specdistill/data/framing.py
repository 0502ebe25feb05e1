"""Record framing: a traffic file cut into one record's raw bytes at a time, with where each sits.

A JSONL file is framed by lines, a ShareGPT JSON array element by element (brackets and strings
scanned, nothing parsed), so a 125 MB file is never loaded whole, an incremental read resumes at a
byte offset, and a record still being written (an element that never closes, a last line without a
newline) is left for the next read. Parsing and normalization are `data.readers`' and `data.formats`'.
"""

from __future__ import annotations

import gzip
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

RAW_KEEP_CHARS = 2000


@dataclass(frozen=True)
class Truncation:
    offset: int  # where the unfinished tail starts
    tail_bytes: int  # how many bytes it holds
    location: str  # where the unfinished record would be
    # None: the file just ends early (maybe still being written). Else why the rest cannot be read:
    # a gzip stream that is corrupt ("corrupt gzip data: CRC check failed"), never a normal state.
    corrupt: str | None = None


COMPRESSED_READ_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error)  # a gzip stream cut short or corrupt


def compressed_read_error(exc: BaseException) -> str | None:
    """Why a gzip stream failed: None when it only ended early (a truncation, as for a plain file)."""
    if isinstance(exc, EOFError):
        return None
    return f"corrupt gzip data: {exc}"


class FormatMismatchError(ValueError):
    pass


def raw_text(data: bytes | str, limit: int = RAW_KEEP_CHARS) -> str:
    """Record text safe for any database: cut, invalid bytes and NULs escaped."""
    if isinstance(data, bytes):
        total = len(data)
        text = data[: limit * 4].decode("utf-8", errors="backslashreplace")
    else:
        total = len(data.encode("utf-8", errors="surrogatepass"))
        text = data
    text = text.encode("utf-8", errors="backslashreplace").decode("utf-8")
    text = text.replace("\x00", "\\x00")
    if len(text) > limit:
        text = text[:limit] + f"...[{total} bytes in all]"
    return text


@dataclass
class Frame:
    """One record's raw bytes and where it sits in the file."""

    data: bytes
    location: str
    offset: int
    end_offset: int
    index: int  # line number (JSONL) or element number (ShareGPT), 1-based
    reason: str | None = None  # rejected before parsing (too long, bytes after the array)


def is_gzip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def open_binary(path: Path) -> BinaryIO:
    if is_gzip(path):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def line_frames(f: BinaryIO, name: str, start: int, start_index: int, max_bytes: int, state: dict) -> Iterator[Frame]:
    """JSONL lines; a line over max_bytes is framed but not kept whole."""
    offset = start
    lineno = start_index
    while True:
        line = f.readline(max_bytes + 1)
        if not line:
            return
        lineno += 1
        too_long = False
        size = len(line)
        if not line.endswith(b"\n") and size > max_bytes:
            too_long = True
            while True:  # consume the rest of the over-long line without keeping it
                more = f.readline(1 << 20)
                size += len(more)
                if not more or more.endswith(b"\n"):
                    break
        reason = f"too long: {size} bytes (limit {max_bytes})" if too_long else None
        frame = Frame(line, f"{name}:{lineno}", offset, offset + size, lineno, reason)
        if not too_long and not line.endswith(b"\n"):
            state["unterminated"] = frame  # last line without newline: maybe still being written
        yield frame
        offset += size


_STRUCT = re.compile(rb'["{}\[\]]')
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_SPACE = re.compile(rb"[ \t\r\n]*")
_SEPARATOR = re.compile(rb"[,\]\n]")


class _Incomplete(Exception):
    pass


def _element_end(buf: bytes, pos: int) -> int:
    """End of the JSON value starting at buf[pos] ('{' or '['); _Incomplete if it runs past buf."""
    closers: list[int] = []
    i = pos
    while True:
        m = _STRUCT.search(buf, i)
        if m is None:
            raise _Incomplete
        c = buf[m.start()]
        if c == 0x22:  # '"'
            s = _STRING.match(buf, m.start())
            if s is None:
                raise _Incomplete
            i = s.end()
            continue
        i = m.end()
        if c in (0x7B, 0x5B):  # '{' '['
            closers.append(c + 2)  # '}' '['+2 = ']'
        elif closers.pop() != c or not closers:
            return i  # closed, or a mismatched bracket: the element ends here and fails to parse


def array_frames(f: BinaryIO, name: str, start: int, start_index: int, max_bytes: int, state: dict) -> Iterator[Frame]:
    """Elements of a top-level JSON array, streamed; sets state['truncated'] for an unfinished tail."""
    chunk = 1 << 22
    buf = f.read(chunk)
    base = start  # file offset of buf[0]
    pos = 0
    eof = not buf
    index = start_index
    expect_open = start == 0

    def need_more() -> bool:
        nonlocal buf, base, pos, eof
        if eof:
            return False
        more = f.read(max(chunk, len(buf) - pos))
        if not more:
            eof = True
            return False
        buf = buf[pos:] + more
        base += pos
        pos = 0
        return True

    while True:
        m = _SPACE.match(buf, pos)
        pos = m.end()
        if pos >= len(buf):
            if need_more():
                continue
            if expect_open or not state.get("closed"):
                if expect_open:
                    raise FormatMismatchError(f"{name}: empty file, expected a JSON array")
                state["truncated"] = Truncation(base + pos, 0, f"{name}#record={index + 1}")
            return
        c = buf[pos : pos + 1]
        if expect_open:
            if c != b"[":
                line = buf[pos : pos + 200].split(b"\n", 1)[0]
                raise FormatMismatchError(
                    f"{name}: line 1 is {raw_text(line, 80)!r}: a ShareGPT file is one JSON array, starting with '['"
                )
            expect_open = False
            pos += 1
            continue
        if c == b",":
            pos += 1
            continue
        if c == b"]":
            state["closed"] = True
            pos += 1
            rest = buf[pos:] + (b"" if eof else f.read(max_bytes))
            size = len(rest)
            while more := f.read(1 << 20):  # count, but do not keep, whatever else follows
                size += len(more)
            if rest.strip():
                yield Frame(rest[:max_bytes], f"{name}#after-array", base + pos, base + pos + size, index,
                             "bytes after the closing ']'")
            return
        index += 1
        location = f"{name}#record={index}"
        if c in (b"{", b"["):
            while True:
                try:
                    end = _element_end(buf, pos)
                    break
                except _Incomplete:
                    if not need_more():
                        state["truncated"] = Truncation(base + pos, len(buf) - pos, location)
                        return
        else:  # a scalar or stray bytes: up to the next separator
            sep = _SEPARATOR.search(buf, pos)
            while sep is None and need_more():
                sep = _SEPARATOR.search(buf, pos)
            end = sep.start() if sep else len(buf)
        data = buf[pos:end]
        reason = f"too long: {len(data)} bytes (limit {max_bytes})" if len(data) > max_bytes else None
        yield Frame(data, location, base + pos, base + end, index, reason)
        pos = end
