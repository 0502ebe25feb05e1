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

Decompression is capped: a `.gz` is read up to `max_decompressed_bytes` of decompressed data (default
`DECOMPRESSION_RATIO` times its size on disk, at least `DECOMPRESSION_FLOOR`), so a small file that
inflates without end (a gzip of gigabytes of newlines) costs seconds, not minutes. What lies past the
cap is one quarantined record naming it; the records before it are kept, and a rerun with a higher
cap reads on from them. Runs of blank lines are skipped a buffer at a time, not line by line.

Format checks: if none of the first `SNIFF_RECORDS` records of a file is valid for `--format`, the
file is in another (or an unknown) format: `FormatMismatchError` names the file, the first offending
line or record, its reason, and the format the file looks like when one matches.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from specdistill import paths
from specdistill.data.formats import (
    DEFAULT_MAX_CHARS,
    PARSERS,
    InvalidRecord,
    Message,
    looks_like,
)
from specdistill.data.framing import (  # noqa: F401  (readers' public names, as before the split)
    COMPRESSED_READ_ERRORS,
    DECOMPRESSION_FLOOR,
    DECOMPRESSION_RATIO,
    DEFAULT_MAX_RECORD_BYTES,
    RAW_KEEP_CHARS,
    DecompressedTooLarge,
    FormatMismatchError,
    Frame,
    Truncation,
    array_frames,
    decompression_cap,
    is_gzip,
    line_frames,
    open_binary,
    raw_text,
)

FORMATS = ("sharegpt", "openai", "jsonl", "humaneval")
SNIFF_RECORDS = 20
REASON_KEEP_CHARS = 1000


@dataclass
class Conversation:
    messages: list[Message]
    source: str
    location: str
    record_id: str | None = None  # the id the record carries in its file (ShareGPT id, HumanEval task_id)
    served_by: str | None = None  # model name logged with the response (OpenAI logs), if any
    timestamp: float | None = None  # when the traffic happened (unix seconds), if logged
    temperature: float | None = None  # the sampling temperature the request asked for (OpenAI logs), if logged
    user: str | None = None  # the request's `user` (OpenAI logs), if logged: what `logs forget --user` finds
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
        max_decompressed_bytes: int | None = None,
    ) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
        self.path = paths.check_regular(path, "traffic file")  # a FIFO or a device is said so, never opened
        self.fmt = fmt
        self.source = source or str(self.path.resolve())
        self.start_offset = start_offset
        self.start_index = start_index
        self.max_record_bytes = max_record_bytes
        self.max_chars = max_chars
        self.max_decompressed_bytes = max_decompressed_bytes
        self.capped: str | None = None  # after iteration: why the rest of a compressed file was not read
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
            with open_binary(self.path, self.max_decompressed_bytes) as f:
                if self.start_offset:
                    f.seek(self.start_offset)
                framer = array_frames if self.fmt == "sharegpt" else line_frames
                for frame in framer(f, name, self.start_offset, self.start_index, self.max_record_bytes, state):
                    if frame is state.get("unterminated"):
                        record, obj = self._decode(frame, parse)
                        if isinstance(record, Rejected) and obj is None:  # an unfinished last line: a tail, not a record
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
        except DecompressedTooLarge as exc:
            # past the cap: the records before it are kept, the rest is one quarantined record that says so
            for held, _, index in sniffed:
                yield from self._emit(held, index)
            where = f"{name}#record={self.index + 1}" if self.fmt == "sharegpt" else f"{name}:{self.index + 1}"
            self.capped = (f"{self.path}: decompressed past {exc.cap} bytes (the cap; --max-decompressed-bytes or a "
                           f"source's max_decompressed_bytes raises it): not read from {where} on")
            rest = Rejected(self.source, where, self.capped, f"[the decompressed data from byte {self.end_offset} on]",
                            self.end_offset, self.end_offset)
            yield from self._emit(rest, self.index)
            return
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
        def reject(reason: str) -> Rejected:  # a reason may quote the record: made as safe for a database as its text
            return Rejected(self.source, frame.location, raw_text(reason, REASON_KEEP_CHARS), raw_text(frame.data),
                            frame.offset, frame.end_offset)

        if frame.reason:
            return reject(frame.reason), None
        try:
            # orjson parses a line in about half json's time; what it refuses (bad UTF-8 or JSON, lone
            # surrogates, NaN, huge integers, deep nesting) goes through json below, as before, for the same reasons
            obj = orjson.loads(frame.data)
        except orjson.JSONDecodeError:
            pass
        else:
            return self._parsed(frame, parse, obj, reject)
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
        except ValueError as exc:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
            return reject(f"invalid JSON: {str(exc).split(';')[0]}"), None
        return self._parsed(frame, parse, obj, reject)

    def _parsed(self, frame: Frame, parse, obj: Any, reject) -> tuple[Conversation | Rejected, Any]:
        try:
            fields = parse(obj, self.max_chars)
        except InvalidRecord as exc:
            return reject(str(exc)), obj
        except RecursionError:  # a value nested deeper than a rule can look into
            return reject("a field is nested too deeply"), obj
        return Conversation(source=self.source, location=frame.location, offset=frame.offset,
                            end_offset=frame.end_offset, **fields), obj


def read_records(path: str | Path, fmt: str, **options: Any) -> RecordReader:
    """Stream `path` as Conversation / Rejected records; `.truncation` is set after iteration."""
    return RecordReader(path, fmt, **options)

