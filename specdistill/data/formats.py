"""What one record of each traffic format means, and the rules that normalize it to messages.

Each parser takes one decoded JSON value and returns the fields of a `readers.Conversation`, or
raises `InvalidRecord` whose message is the quarantine reason.

Normalization rules (every record that breaks one becomes a `Rejected` with the reason; the one
repair, rule 4, is written down in the conversation's `notes`):

1. Roles: `human`/`user` -> user, `gpt`/`assistant`/`chatgpt`/`bard`/`bing`/`model` -> assistant,
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
7. Every other field that is read (ids, the serving model, `created`, `temperature`) is checked
   where it is read, not when it is stored: a number that is not finite (`NaN`, `Infinity`, an
   integer past a float's range), a time outside years 1 to 9999 (what every backend holds), a
   label longer than its column or holding text of rule 6, or a value of the wrong type rejects
   the record with the field's name. One bad field costs one record, never the rest of a file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

DEFAULT_MAX_CHARS = 1_000_000
MAX_LABEL_CHARS = 256  # the log store's columns for a record's id and its serving model
TEMPERATURE_RANGE = (0.0, 100.0)

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


class InvalidRecord(ValueError):
    """A record that parses but breaks a rule; the message is the quarantine reason."""


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
                raise InvalidRecord(f"{where}: non-text content part ({str(kind)[:40]!r})")
        return "".join(parts)
    raise InvalidRecord(f"{where}: content is {type(content).__name__}, not a string")


def normalize_messages(
    turns: list[tuple[Any, Any]], max_chars: int = DEFAULT_MAX_CHARS, notes: list[str] | None = None
) -> list[Message]:
    """Apply the module's rules to (role, content) pairs; raise InvalidRecord with the reason.

    What the rules changed (dropped leading assistant turns) is appended to `notes`.
    """
    if not turns:
        raise InvalidRecord("no turns")
    messages: list[Message] = []
    total = 0
    first = user = late_system = None  # the first non-system turn, the first user turn, a system turn after `first`
    for i, (role, content) in enumerate(turns):
        if not isinstance(role, str):
            raise InvalidRecord(f"turn {i}: role is {type(role).__name__}, not a string")
        norm = ROLE_MAP.get(role.strip().lower())
        if norm is None:
            raise InvalidRecord(f"turn {i}: unknown role {role[:40]!r}")
        text = _content_text(content, f"turn {i}")
        if not text.strip():
            raise InvalidRecord(f"turn {i}: empty {norm} turn")
        _storable(text, f"turn {i}: ", "content")
        total += len(text)
        messages.append(Message(norm, text))
        if norm == "system":
            if first is not None and late_system is None:
                late_system = i
        elif first is None:
            first = i
        if norm == "user" and user is None:
            user = i
    if total > max_chars:
        raise InvalidRecord(f"too long: {total} characters of content (limit {max_chars})")
    if first is None:
        raise InvalidRecord("no user turn (only system turns)")
    if late_system is not None:
        raise InvalidRecord(f"turn {late_system}: system turn after the conversation started")
    if user is None:
        raise InvalidRecord("no user turn")
    shift = user - first  # turn numbers in reasons refer to the record as written
    if shift:
        if notes is not None:
            notes.append(f"dropped {user - first} leading assistant turn(s)")
        messages = messages[:first] + messages[user:]
    for i in range(first, len(messages)):
        expected = "user" if (i - first) % 2 == 0 else "assistant"
        if messages[i].role != expected:
            raise InvalidRecord(f"turn {i + shift}: two {messages[i - 1].role} turns in a row")
    return messages


def _storable(text: str, where: str, what: str) -> None:
    if "\x00" in text:
        raise InvalidRecord(f"{where}NUL character in {what}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRecord(f"{where}invalid unicode (lone surrogate) in {what}") from None


def _number(value: Any, where: str) -> float:
    """A finite float from a JSON number; Python's json also reads NaN, Infinity and 400-digit integers."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRecord(f"{where} is {type(value).__name__}, not a number")
    try:
        number = float(value)
    except OverflowError:
        raise InvalidRecord(f"{where} is an integer of {value.bit_length()} bits, past any float") from None
    if not math.isfinite(number):  # named as JSON writes it
        written = "NaN" if math.isnan(number) else ("Infinity" if number > 0 else "-Infinity")
        raise InvalidRecord(f"{where} is {written}, not a finite number")
    return number


def unix_time(value: Any, where: str) -> float | None:
    """A logged time in unix seconds (None: not logged); one no backend can store is a bad record."""
    if value is None:
        return None
    seconds = _number(value, where)
    try:
        datetime.fromtimestamp(seconds, timezone.utc)
    except (OverflowError, OSError, ValueError):
        raise InvalidRecord(f"{where} {seconds:g} is not a time in unix seconds (years 1 to 9999)") from None
    return seconds


def temperature_of(value: Any, where: str) -> float | None:
    """A requested sampling temperature (None: not logged, the server's default)."""
    if value is None:
        return None
    number = _number(value, where)
    low, high = TEMPERATURE_RANGE
    if not low <= number <= high:
        raise InvalidRecord(f"{where} {number:g} is outside {low:g}..{high:g}")
    return number


def label(value: Any, where: str, *, integers: bool = False) -> str | None:
    """An id or a model name as the log store keeps it (None: absent or empty); `integers`: an id
    written as a JSON integer is its decimal text."""
    if value is None or value == "":
        return None
    if integers and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise InvalidRecord(f"{where} is {type(value).__name__}, not a string")
    _storable(value, f"{where}: ", "it")
    if len(value) > MAX_LABEL_CHARS:
        raise InvalidRecord(f"{where} is {len(value)} characters long (limit {MAX_LABEL_CHARS})")
    return value


def check_metadata(*, record_id: Any = None, served_by: Any = None, timestamp: Any = None,
                   temperature: Any = None, user: Any = None) -> None:
    """Rule 7 for fields set outside a parser (a `Conversation` built in code): raise InvalidRecord."""
    label(record_id, "record_id", integers=True)
    label(user, "user", integers=True)
    label(served_by, "served_by")
    unix_time(timestamp, "timestamp")
    temperature_of(temperature, "temperature")


def _require(obj: Any, key: str, kind: type, where: str = "") -> Any:
    if not isinstance(obj, dict):
        raise InvalidRecord(f"{where}is {type(obj).__name__}, not an object")
    if key not in obj:
        raise InvalidRecord(f"{where}missing key {key!r}")
    value = obj[key]
    if not isinstance(value, kind):
        raise InvalidRecord(f"{where}{key!r} is {type(value).__name__}, not {kind.__name__}")
    return value


def _turns_from_openai(messages: list, where: str) -> list[tuple[Any, Any]]:
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRecord(f"{where}messages[{i}] is {type(m).__name__}, not an object")
        if m.get("tool_calls") and not m.get("content"):
            raise InvalidRecord(f"{where}messages[{i}]: tool calls are not supported")
        if "role" not in m or "content" not in m:
            raise InvalidRecord(f"{where}messages[{i}] needs 'role' and 'content'")
        turns.append((m["role"], m["content"]))
    return turns


def _parse_sharegpt(obj: Any, max_chars: int) -> dict:
    convs = _require(obj, "conversations", list)
    turns = []
    for i, t in enumerate(convs):
        if not isinstance(t, dict) or "from" not in t or "value" not in t:
            raise InvalidRecord(f"conversations[{i}] needs 'from' and 'value'")
        turns.append((t["from"], t["value"]))
    rid = label(obj.get("id"), "id", integers=True)
    notes: list[str] = []
    messages = normalize_messages(turns, max_chars, notes)
    return {"messages": messages, "record_id": rid, "notes": notes}


def _parse_openai(obj: Any, max_chars: int) -> dict:
    if isinstance(obj, dict) and "request" in obj:
        request = _require(obj, "request", dict)
        response = _require(obj, "response", dict)
        messages = _require(request, "messages", list, "request: ")
        choices = _require(response, "choices", list, "response: ")
        if not choices:
            raise InvalidRecord("response: no choices")
        # n > 1 choices are alternative samples of one prompt; the first one is the logged answer.
        message = _require(choices[0], "message", dict, "response.choices[0]: ")
        turns = _turns_from_openai(messages, "request.") + _turns_from_openai([message], "response.choices[0].")
        served_by = label(response.get("model"), "response.model") or label(request.get("model"), "request.model")
        created = unix_time(response.get("created"), "response.created")
        rid = label(response.get("id"), "response.id", integers=True)
        temperature = temperature_of(request.get("temperature"), "request.temperature")
        user = label(request.get("user"), "request.user", integers=True)
    else:
        messages = _require(obj, "messages", list)
        turns = _turns_from_openai(messages, "")
        if not turns or ROLE_MAP.get(str(turns[-1][0]).lower()) != "assistant":
            raise InvalidRecord("flat form: the last message must be the assistant's")
        served_by = label(obj.get("model"), "model")
        created = unix_time(obj.get("created"), "created")
        rid = label(obj.get("id"), "id", integers=True)
        temperature = temperature_of(obj.get("temperature"), "temperature")
        user = label(obj.get("user"), "user", integers=True)
    notes: list[str] = []
    return {
        "messages": normalize_messages(turns, max_chars, notes),
        "notes": notes,
        "served_by": served_by,
        "timestamp": created,
        "record_id": rid,
        "user": user,  # OpenAI's end-user id, for `logs forget`
        "temperature": temperature,  # what the request asked for (absent: the server's default, unknown here)
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
    task_id = label(_require(obj, "task_id", str), "task_id")
    prompt = _require(obj, "prompt", str)
    return {"messages": normalize_messages([("user", prompt)], max_chars), "record_id": task_id}


PARSERS = {"sharegpt": _parse_sharegpt, "openai": _parse_openai, "jsonl": _parse_jsonl, "humaneval": _parse_humaneval}


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
