"""Framing a traffic file into records before any parsing: JSONL lines, the elements of a ShareGPT JSON
array (brackets and strings framed, nothing parsed until an element closes), over a plain or gzip file
whose decompressed size is capped (`readers` parses the frames; its docstring says what each case means).
"""

from __future__ import annotations

import gzip
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from specdistill import paths

RAW_KEEP_CHARS = 2000
DEFAULT_MAX_RECORD_BYTES = 4 << 20
# a .gz inflates at most this many times its size unless told otherwise: JSON logs compress 3-20x, a
# decompression bomb thousands of times
DECOMPRESSION_RATIO = 100
DECOMPRESSION_FLOOR = 1 << 20


@dataclass(frozen=True)
class Truncation:
    offset: int  # where the unfinished tail starts
    tail_bytes: int  # how many bytes it holds
    location: str  # where the unfinished record would be
    # None: the file just ends early (maybe still being written). Else why the rest cannot be read:
    # a gzip stream that is corrupt ("corrupt gzip data: CRC check failed"), never a normal state.
    corrupt: str | None = None


COMPRESSED_READ_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error)  # a gzip stream cut short or corrupt


class FormatMismatchError(ValueError):
    pass


class DecompressedTooLarge(Exception):
    """A compressed file inflated past its cap (`max_decompressed_bytes`)."""

    def __init__(self, cap: int):
        super().__init__(cap)
        self.cap = cap


class CappedStream:
    """A decompressed stream that refuses to read past `cap` bytes (raises `DecompressedTooLarge`)."""

    def __init__(self, f: BinaryIO, cap: int):
        self.f, self.cap = f, cap

    def _check(self, data: bytes) -> bytes:
        if self.f.tell() > self.cap:
            raise DecompressedTooLarge(self.cap)
        return data

    def read(self, n: int = -1) -> bytes:
        room = self.cap + 1 - self.f.tell()
        return self._check(self.f.read(room if n is None or n < 0 else min(n, max(room, 0) + 1)))

    def readline(self, n: int = -1) -> bytes:
        room = self.cap + 1 - self.f.tell()
        return self._check(self.f.readline(room if n is None or n < 0 else min(n, max(room, 0) + 1)))

    def peek(self, n: int = 1) -> bytes:
        return self.f.peek(n)

    def seek(self, offset: int) -> int:
        if offset > self.cap:
            raise DecompressedTooLarge(self.cap)
        return self.f.seek(offset)

    def tell(self) -> int:
        return self.f.tell()

    def __enter__(self) -> CappedStream:
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


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
    data: bytes
    location: str
    offset: int
    end_offset: int
    index: int  # line number (JSONL) or element number (ShareGPT), 1-based
    reason: str | None = None  # rejected before parsing (too long, bytes after the array)


def is_gzip(path: Path) -> bool:
    with paths.open_regular(path, "traffic file") as f:
        return f.read(2) == b"\x1f\x8b"


def decompression_cap(path: Path, max_decompressed_bytes: int | None = None) -> int:
    """How much a compressed file may inflate: the given cap, else `DECOMPRESSION_RATIO` times its size."""
    if max_decompressed_bytes is not None:
        return max_decompressed_bytes
    return max(DECOMPRESSION_RATIO * Path(path).stat().st_size, DECOMPRESSION_FLOOR)


def open_binary(path: Path, max_decompressed_bytes: int | None = None) -> BinaryIO:
    """The file's bytes, decompressed when it is a gzip (capped: `decompression_cap`)."""
    if is_gzip(path):
        return CappedStream(gzip.GzipFile(fileobj=paths.open_regular(path, "traffic file")),  # type: ignore[return-value]
                            decompression_cap(path, max_decompressed_bytes))
    return paths.open_regular(path, "traffic file")


_WHITESPACE = b" \t\r\n\f\v"  # what bytes.strip() strips: a line of only these is blank


def _skip_blank_lines(f: BinaryIO) -> tuple[int, int]:
    """Consume the blank lines that follow, a buffer at a time: (bytes, lines)."""
    size = lines = 0
    peek = getattr(f, "peek", None)
    while peek is not None:
        ahead = peek(1 << 16)[: 1 << 16]
        lead = len(ahead) - len(ahead.lstrip(_WHITESPACE))
        cut = ahead.rfind(b"\n", 0, lead) + 1  # through the last newline of the leading whitespace
        if cut == 0:
            break
        f.read(cut)
        size, lines = size + cut, lines + ahead.count(b"\n", 0, cut)
        if lead < len(ahead):
            break
    return size, lines


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
        elif line.endswith(b"\n") and not line.strip():  # blank: the run of blank lines it starts is one frame
            more, lines = _skip_blank_lines(f)
            size, lineno = size + more, lineno + lines
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
