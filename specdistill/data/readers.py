"""Streaming readers for production traffic: ShareGPT, OpenAI chat-completions logs, JSONL, HumanEval.

`read_records(path, fmt)` yields, in file order, one `Conversation` or one `Rejected` per record and
never loads a whole file: the shipped ShareGPT file (125 MB, cut off mid-record) is scanned element
by element (brackets and strings framed, nothing parsed until an element closes). A record is a
JSONL line or an element of the ShareGPT JSON array. Locations are 1-based: `name.jsonl:5` is
line 5, `name.json#record=17` is the 17th array element.

Truncation: an unfinished last record (a JSON array element that never closes, or a last JSONL line
with no newline that does not parse) is not a record yet, because a log that is still being written
looks exactly like that. The reader stops before it and sets `reader.truncation` (a `Truncation`
with the byte offset and the size of the tail) once iteration is over; `reader.end_offset` is where
an incremental read resumes. Nothing in the tail is silently dropped: it is reported, and read
again when the file has grown. A `.gz` whose stream ends early is a truncation too; one whose data
is corrupt (a bad block, a CRC mismatch) keeps the records read before it and sets
`truncation.corrupt` to why.

Normalization: see `specdistill.data.formats`.

Format checks: if none of the first `SNIFF_RECORDS` records of a file is valid for `--format`, the
file is in another (or an unknown) format: `FormatMismatchError` names the file, the first offending
line or record, its reason, and the format the file looks like when one matches.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from specdistill.data.formats import (
    DEFAULT_MAX_CHARS,
    PARSERS,
    InvalidRecord,
    Message,
    looks_like,
)

RAW_KEEP_CHARS = 2000
FORMATS = ("sharegpt", "openai", "jsonl", "humaneval")
SNIFF_RECORDS = 20
DEFAULT_MAX_RECORD_BYTES = 4 << 20


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


@dataclass
class Conversation:
    messages: list[Message]
    source: str
    location: str
    record_id: str | None = None  # the id the record carries in its file (ShareGPT id, HumanEval task_id)
    served_by: str | None = None  # model name logged with the response (OpenAI logs), if any
    timestamp: float | None = None  # when the traffic happened (unix seconds), if logged
    offset: int = 0  # byte offset of the record's first byte (decompressed stream for .gz)
    end_offset: int = 0  # byte offset just past the record: where a resumed read starts
    notes: list[str] = field(default_factory=list)  # what normalization changed (formats, rule 4)


@dataclass
class Rejected:
    source: str
    location: str
    reason: str
    raw: str  # the record as text, cut to RAW_KEEP_CHARS, NULs and bad bytes escaped
    offset: int = 0
    end_offset: int = 0


class RecordReader:
    """Iterate a traffic file as Conversation / Rejected records; see the module docstring.

    After iteration: `truncation` (None or a Truncation), `end_offset` (resume point), `index`
    (line or element number at that point: pass both back as start_offset / start_index to resume)
    and `records` (how many records were yielded). During iteration the three describe the record
    just yielded.
    """

    def __init__(
        self,
        path: str | Path,
        fmt: str,
        *,
        source: str | None = None,
        start_offset: int = 0,
        start_index: int = 0,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        max_chars: int = DEFAULT_MAX_CHARS,
    ) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such file")
        self.fmt = fmt
        self.source = source or str(self.path.resolve())
        self.start_offset = start_offset
        self.start_index = start_index
        self.max_record_bytes = max_record_bytes
        self.max_chars = max_chars
        self.truncation: Truncation | None = None
        self.end_offset = start_offset
        self.index = start_index
        self.records = 0

    def __iter__(self) -> Iterator[Conversation | Rejected]:
        name = self.path.name
        parse = PARSERS[self.fmt]
        state: dict = {}
        sniffed: list[tuple[Conversation | Rejected, Any, int]] = []  # held back until one record is valid
        checked = self.start_offset > 0  # a resumed read already passed the format check
        try:
            with open_binary(self.path) as f:
                if self.start_offset:
                    f.seek(self.start_offset)
                framer = array_frames if self.fmt == "sharegpt" else line_frames
                for frame in framer(f, name, self.start_offset, self.start_index, self.max_record_bytes, state):
                    if frame is state.get("unterminated"):
                        record, obj = self._decode(frame, parse)
                        if isinstance(record, Rejected):  # an unfinished last line: a tail, not a record
                            self.truncation = Truncation(frame.offset, frame.end_offset - frame.offset, frame.location)
                            break
                    elif self.fmt != "sharegpt" and not frame.data.strip():
                        if not sniffed:  # blank lines are not records
                            self.end_offset, self.index = frame.end_offset, frame.index
                        continue
                    else:
                        record, obj = self._decode(frame, parse)
                    if not checked:
                        sniffed.append((record, obj, frame.index))
                        if isinstance(record, Conversation):
                            checked = True
                        elif len(sniffed) >= SNIFF_RECORDS:
                            self._mismatch(sniffed)
                        else:
                            continue
                        for held, _, index in sniffed:
                            yield from self._emit(held, index)
                        sniffed.clear()
                        continue
                    yield from self._emit(record, frame.index)
                if sniffed:
                    self._mismatch(sniffed)
        except COMPRESSED_READ_ERRORS as exc:
            # a .gz cut short or corrupt: what was read before the bad block is kept and counted,
            # the rest is reported as a truncation (with why, when the data is corrupt)
            for held, _, index in sniffed:
                yield from self._emit(held, index)
            where = f"{name}#record={self.index + 1}" if self.fmt == "sharegpt" else f"{name}:{self.index + 1}"
            why = None if isinstance(exc, EOFError) else f"corrupt gzip data: {exc}"  # EOFError: it only ended early
            self.truncation = Truncation(self.end_offset, 0, where, why)
            return
        if self.truncation is None and "truncated" in state:
            self.truncation = state["truncated"]

    def _emit(self, record: Conversation | Rejected, index: int) -> Iterator[Conversation | Rejected]:
        self.records += 1
        self.end_offset = record.end_offset
        self.index = index
        yield record

    def _mismatch(self, sniffed: list) -> None:
        first, obj, _ = sniffed[0]
        shape = looks_like(obj)
        hint = f"; it looks like {shape}" if shape and not shape.startswith(self.fmt) else ""
        raise FormatMismatchError(
            f"{self.path}: no valid {self.fmt} record in the first {len(sniffed)} records; "
            f"first offending record {first.location}: {first.reason}{hint}"
        )

    def _decode(self, frame: Frame, parse) -> tuple[Conversation | Rejected, Any]:
        def reject(reason: str) -> Rejected:
            return Rejected(self.source, frame.location, reason, raw_text(frame.data), frame.offset, frame.end_offset)

        if frame.reason:
            return reject(frame.reason), None
        try:
            text = frame.data.decode("utf-8")
        except UnicodeDecodeError as exc:
            return reject(f"invalid UTF-8 at byte {exc.start}"), None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            return reject(f"invalid JSON: {exc.msg} at column {exc.colno}"), None
        except RecursionError:
            return reject("invalid JSON: nested too deeply"), None
        try:
            fields = parse(obj, self.max_chars)
        except InvalidRecord as exc:
            return reject(str(exc)), obj
        return Conversation(source=self.source, location=frame.location, offset=frame.offset,
                            end_offset=frame.end_offset, **fields), obj


def read_records(path: str | Path, fmt: str, **options: Any) -> RecordReader:
    """Stream `path` as Conversation / Rejected records; `.truncation` is set after iteration."""
    return RecordReader(path, fmt, **options)

