"""Streaming readers for production traffic: ShareGPT, OpenAI chat-completions logs, JSONL, HumanEval.

`read_records(path, fmt)` yields, in file order, one `Conversation` or one `Rejected` per record and
never loads a whole file: the shipped ShareGPT file (125 MB, cut off mid-record) is scanned element
by element. A record is a JSONL line or an element of the ShareGPT JSON array. Locations are
1-based: `name.jsonl:5` is line 5, `name.json#record=17` is the 17th array element.

Truncation: an unfinished last record (a JSON array element that never closes, or a last JSONL line
with no newline that does not parse) is not a record yet, because a log that is still being written
looks exactly like that. The reader stops before it and sets `reader.truncation` (a `Truncation`
with the byte offset and the size of the tail) once iteration is over; `reader.end_offset` is where
an incremental read resumes. Nothing in the tail is silently dropped: it is reported, and read
again when the file has grown.

Normalization rules (every record that breaks one becomes a `Rejected` with the reason; nothing is
repaired silently):

1. Roles: `human`/`user` -> user, `gpt`/`assistant`/`chatgpt`/`bard`/`model` -> assistant,
   `system`/`developer` -> system. Any other role (`tool`, `function`, ...) is rejected.
2. Content must be a string; OpenAI content-part lists are joined when every part is text, and
   rejected otherwise (images, audio). An assistant turn with `tool_calls` and no content is rejected.
3. A conversation with no turns, or with an empty (whitespace-only) turn, is rejected: an empty turn
   means a scrape or log went wrong and the surrounding turns cannot be trusted.
4. System turns may only come first. Assistant turns before the first user turn are dropped and the
   drop is written in the conversation's `notes` (ShareGPT splits long chats into parts `ID_1`,
   `ID_2`, ... whose first turn is the answer closing the previous part: about a third of the shipped
   file). After that, user and assistant turns must alternate, or the record is rejected (chat
   templates need it). A conversation may end with a user turn: it is then a prompt without a
   response (like HumanEval), which the target can answer later.
5. Over-long records are rejected: more than `max_record_bytes` of raw input (not even parsed) or
   more than `max_chars` characters of content.
6. Text that a database cannot hold is rejected: NUL characters, lone surrogates, invalid UTF-8.

Format checks: if none of the first `SNIFF_RECORDS` records of a file is valid for `--format`, the
file is in another (or an unknown) format: `FormatMismatchError` names the file, the first offending
line or record, its reason, and the format the file looks like when one matches.
"""

from __future__ import annotations

import gzip
import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator

FORMATS = ("sharegpt", "openai", "jsonl", "humaneval")
SNIFF_RECORDS = 20
RAW_KEEP_CHARS = 2000
DEFAULT_MAX_RECORD_BYTES = 4 << 20
DEFAULT_MAX_CHARS = 1_000_000

ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
    "developer": "system",
}


@dataclass(frozen=True)
class Message:
    role: str  # "system" | "user" | "assistant"
    content: str


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
    notes: list[str] = field(default_factory=list)  # what normalization changed (rule 4)


@dataclass
class Rejected:
    source: str
    location: str
    reason: str
    raw: str  # the record as text, cut to RAW_KEEP_CHARS, NULs and bad bytes escaped
    offset: int = 0
    end_offset: int = 0


@dataclass(frozen=True)
class Truncation:
    offset: int  # where the unfinished tail starts
    tail_bytes: int  # how many bytes it holds
    location: str  # where the unfinished record would be


class FormatMismatchError(ValueError):
    pass


class _Invalid(ValueError):
    """A record that parses but breaks a rule; the message is the quarantine reason."""


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


# ----------------------------------------------------------------------------------------------
# normalization


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _Invalid(f"{where}: non-text content part ({kind})")
        return "".join(parts)
    raise _Invalid(f"{where}: content is {type(content).__name__}, not a string")


def normalize_messages(
    turns: list[tuple[Any, Any]], max_chars: int = DEFAULT_MAX_CHARS, notes: list[str] | None = None
) -> list[Message]:
    """Apply the module's rules to (role, content) pairs; raise _Invalid with the reason.

    What the rules changed (dropped leading assistant turns) is appended to `notes`.
    """
    if not turns:
        raise _Invalid("no turns")
    messages: list[Message] = []
    total = 0
    for i, (role, content) in enumerate(turns):
        if not isinstance(role, str):
            raise _Invalid(f"turn {i}: role is {type(role).__name__}, not a string")
        norm = ROLE_MAP.get(role.strip().lower())
        if norm is None:
            raise _Invalid(f"turn {i}: unknown role {role[:40]!r}")
        text = _content_text(content, f"turn {i}")
        if not text.strip():
            raise _Invalid(f"turn {i}: empty {norm} turn")
        if "\x00" in text:
            raise _Invalid(f"turn {i}: NUL character in content")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise _Invalid(f"turn {i}: invalid unicode (lone surrogate) in content") from None
        total += len(text)
        messages.append(Message(norm, text))
    if total > max_chars:
        raise _Invalid(f"too long: {total} characters of content (limit {max_chars})")
    first = next((i for i, m in enumerate(messages) if m.role != "system"), None)
    if first is None:
        raise _Invalid("no user turn (only system turns)")
    if any(m.role == "system" for m in messages[first:]):
        i = next(i for i, m in enumerate(messages) if i >= first and m.role == "system")
        raise _Invalid(f"turn {i}: system turn after the conversation started")
    user = next((i for i, m in enumerate(messages) if m.role == "user"), None)
    if user is None:
        raise _Invalid("no user turn")
    shift = user - first  # turn numbers in reasons refer to the record as written
    if shift:
        if notes is not None:
            notes.append(f"dropped {user - first} leading assistant turn(s)")
        messages = messages[:first] + messages[user:]
    for i in range(first, len(messages)):
        expected = "user" if (i - first) % 2 == 0 else "assistant"
        if messages[i].role != expected:
            raise _Invalid(f"turn {i + shift}: two {messages[i - 1].role} turns in a row")
    return messages


def _require(obj: Any, key: str, kind: type, where: str = "") -> Any:
    if not isinstance(obj, dict):
        raise _Invalid(f"{where}is {type(obj).__name__}, not an object")
    if key not in obj:
        raise _Invalid(f"{where}missing key {key!r}")
    value = obj[key]
    if not isinstance(value, kind):
        raise _Invalid(f"{where}{key!r} is {type(value).__name__}, not {kind.__name__}")
    return value


def _turns_from_openai(messages: list, where: str) -> list[tuple[Any, Any]]:
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _Invalid(f"{where}messages[{i}] is {type(m).__name__}, not an object")
        if m.get("tool_calls") and not m.get("content"):
            raise _Invalid(f"{where}messages[{i}]: tool calls are not supported")
        if "role" not in m or "content" not in m:
            raise _Invalid(f"{where}messages[{i}] needs 'role' and 'content'")
        turns.append((m["role"], m["content"]))
    return turns


def _parse_sharegpt(obj: Any, max_chars: int) -> dict:
    convs = _require(obj, "conversations", list)
    turns = []
    for i, t in enumerate(convs):
        if not isinstance(t, dict) or "from" not in t or "value" not in t:
            raise _Invalid(f"conversations[{i}] needs 'from' and 'value'")
        turns.append((t["from"], t["value"]))
    rid = obj.get("id")
    notes: list[str] = []
    messages = normalize_messages(turns, max_chars, notes)
    return {"messages": messages, "record_id": None if rid is None else str(rid), "notes": notes}


def _parse_openai(obj: Any, max_chars: int) -> dict:
    if isinstance(obj, dict) and "request" in obj:
        request = _require(obj, "request", dict)
        response = _require(obj, "response", dict)
        messages = _require(request, "messages", list, "request: ")
        choices = _require(response, "choices", list, "response: ")
        if not choices:
            raise _Invalid("response: no choices")
        # n > 1 choices are alternative samples of one prompt; the first one is the logged answer.
        message = _require(choices[0], "message", dict, "response.choices[0]: ")
        turns = _turns_from_openai(messages, "request.") + _turns_from_openai([message], "response.choices[0].")
        served_by = response.get("model") or request.get("model")
        created = response.get("created") if isinstance(response.get("created"), (int, float)) else None
        rid = response.get("id")
    else:
        messages = _require(obj, "messages", list)
        turns = _turns_from_openai(messages, "")
        if not turns or ROLE_MAP.get(str(turns[-1][0]).lower()) != "assistant":
            raise _Invalid("flat form: the last message must be the assistant's")
        served_by = obj.get("model")
        created = obj.get("created") if isinstance(obj.get("created"), (int, float)) else None
        rid = obj.get("id")
    notes: list[str] = []
    return {
        "messages": normalize_messages(turns, max_chars, notes),
        "notes": notes,
        "served_by": served_by if isinstance(served_by, str) else None,
        "timestamp": float(created) if created is not None and not isinstance(created, bool) else None,
        "record_id": rid if isinstance(rid, str) else None,
    }


def _parse_jsonl(obj: Any, max_chars: int) -> dict:
    prompt = _require(obj, "prompt", str)
    response = _require(obj, "response", str)
    turns = []
    if "system" in obj and obj["system"] is not None:
        turns.append(("system", obj["system"]))
    turns += [("user", prompt), ("assistant", response)]
    return {"messages": normalize_messages(turns, max_chars)}


def _parse_humaneval(obj: Any, max_chars: int) -> dict:
    task_id = _require(obj, "task_id", str)
    prompt = _require(obj, "prompt", str)
    return {"messages": normalize_messages([("user", prompt)], max_chars), "record_id": task_id}


_PARSERS = {"sharegpt": _parse_sharegpt, "openai": _parse_openai, "jsonl": _parse_jsonl, "humaneval": _parse_humaneval}


def looks_like(obj: Any) -> str | None:
    """The format whose records have this shape, for error messages."""
    if isinstance(obj, list):
        return "sharegpt (a JSON array)"
    if not isinstance(obj, dict):
        return None
    if "conversations" in obj:
        return "sharegpt"
    if "request" in obj or "messages" in obj:
        return "openai"
    if "task_id" in obj:
        return "humaneval"
    if "prompt" in obj and "response" in obj:
        return "jsonl"
    return None


# ----------------------------------------------------------------------------------------------
# record framing


@dataclass
class _Frame:
    """One record's raw bytes and where it sits in the file."""

    data: bytes
    location: str
    offset: int
    end_offset: int
    index: int  # line number (JSONL) or element number (ShareGPT), 1-based
    reason: str | None = None  # rejected before parsing (too long, bytes after the array)


def _open_binary(path: Path, fmt: str) -> BinaryIO:
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def _line_frames(f: BinaryIO, name: str, start: int, start_index: int, max_bytes: int, state: dict) -> Iterator[_Frame]:
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
        frame = _Frame(line, f"{name}:{lineno}", offset, offset + size, lineno, reason)
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


def _array_frames(f: BinaryIO, name: str, start: int, start_index: int, max_bytes: int, state: dict) -> Iterator[_Frame]:
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
            rest = buf[pos:].strip()
            if rest:
                end = base + len(buf)
                yield _Frame(rest, f"{name}#after-array", base + pos, end, index, "bytes after the closing ']'")
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
        yield _Frame(data, location, base + pos, base + end, index, reason)
        pos = end


# ----------------------------------------------------------------------------------------------
# the reader


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
        self._iter: Iterator[Conversation | Rejected] | None = None

    def __iter__(self) -> RecordReader:
        return self

    def __next__(self) -> Conversation | Rejected:
        if self._iter is None:
            self._iter = self._records()
        return next(self._iter)

    def _records(self) -> Iterator[Conversation | Rejected]:
        name = self.path.name
        parse = _PARSERS[self.fmt]
        state: dict = {}
        sniffed: list[tuple[Conversation | Rejected, Any, int]] = []  # held back until one record is valid
        checked = self.start_offset > 0  # a resumed read already passed the format check
        with _open_binary(self.path, self.fmt) as f:
            if self.start_offset:
                f.seek(self.start_offset)
            framer = _array_frames if self.fmt == "sharegpt" else _line_frames
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

    def _decode(self, frame: _Frame, parse) -> tuple[Conversation | Rejected, Any]:
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
        except _Invalid as exc:
            return reject(str(exc)), obj
        return Conversation(source=self.source, location=frame.location, offset=frame.offset,
                            end_offset=frame.end_offset, **fields), obj


def read_records(path: str | Path, fmt: str, **options: Any) -> RecordReader:
    """Stream `path` as Conversation / Rejected records; `.truncation` is set after iteration."""
    return RecordReader(path, fmt, **options)


def read_conversations(path: str | Path, fmt: str, **options: Any) -> Iterator[Conversation]:
    """Only the valid conversations (for training data); use read_records to see the rejects."""
    for record in read_records(path, fmt, **options):
        if isinstance(record, Conversation):
            yield record
