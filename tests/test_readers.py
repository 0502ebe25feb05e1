"""Readers: framing, truncation, role normalization and the documented rules for odd records."""

from __future__ import annotations

import gzip
import json

import pytest

from specdistill.data.readers import (
    Conversation,
    FormatMismatchError,
    Message,
    Rejected,
    read_records,
)


def sharegpt_record(i: int, turns=None) -> dict:
    turns = turns or [("human", f"question {i}"), ("gpt", f"answer {i}")]
    return {"id": f"r{i}", "conversations": [{"from": f, "value": v} for f, v in turns]}


def write_sharegpt(path, records, cut: int | None = None) -> bytes:
    data = json.dumps(records, indent=2).encode()
    if cut is not None:
        data = data[:cut]
    path.write_bytes(data)
    return data


def write_lines(path, objs) -> None:
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))


def test_sharegpt_complete_file(tmp_path):
    path = tmp_path / "s.json"
    write_sharegpt(path, [sharegpt_record(i) for i in range(5)])
    reader = read_records(path, "sharegpt")
    records = list(reader)
    assert [r.record_id for r in records] == [f"r{i}" for i in range(5)]
    assert records[2].messages == [Message("user", "question 2"), Message("assistant", "answer 2")]
    assert records[2].location == "s.json#record=3"
    assert reader.truncation is None
    assert reader.end_offset == path.stat().st_size - 2  # before "\n]"


def test_sharegpt_truncated_mid_record_recovers_every_complete_record(tmp_path):
    path = tmp_path / "s.json"
    full = json.dumps([sharegpt_record(i) for i in range(10)], indent=2).encode()
    cut = full.index(b'"r7"') + 10  # inside record 8
    write_sharegpt(path, [sharegpt_record(i) for i in range(10)], cut=cut)
    reader = read_records(path, "sharegpt")
    records = list(reader)
    assert len(records) == 7 and all(isinstance(r, Conversation) for r in records)
    assert reader.truncation is not None
    assert reader.truncation.location == "s.json#record=8"
    assert reader.truncation.offset + reader.truncation.tail_bytes == cut
    assert path.read_bytes()[reader.truncation.offset : reader.truncation.offset + 1] == b"{"


def test_sharegpt_resume_from_end_offset_after_growth(tmp_path):
    path = tmp_path / "s.json"
    records = [sharegpt_record(i) for i in range(6)]
    full = json.dumps(records, indent=2).encode()
    path.write_bytes(full[: full.index(b'"r4"') + 3])
    first = read_records(path, "sharegpt")
    got = [r.record_id for r in first]
    assert got == ["r0", "r1", "r2", "r3"] and first.truncation is not None
    path.write_bytes(full)  # the writer finished the file
    second = read_records(path, "sharegpt", start_offset=first.end_offset, start_index=first.records)
    rest = list(second)
    assert [r.record_id for r in rest] == ["r4", "r5"]
    assert rest[0].location == "s.json#record=5"
    assert second.truncation is None


def test_sharegpt_roles_and_rules(tmp_path):
    path = tmp_path / "s.json"
    recs = [
        sharegpt_record(0, [("system", "be brief"), ("user", "hi"), ("chatgpt", "hello")]),
        sharegpt_record(1, [("gpt", "tail of part 0"), ("human", "next"), ("gpt", "ok")]),  # split part
        {"id": "empty", "conversations": []},
        sharegpt_record(3, [("human", "a"), ("gpt", "  ")]),
        sharegpt_record(4, [("human", "a"), ("human", "b")]),
        sharegpt_record(5, [("human", "a"), ("tool", "b")]),
        sharegpt_record(6, [("human", "a"), ("gpt", "b"), ("system", "late")]),
        sharegpt_record(7, [("human", "only a prompt")]),
        {"id": "x", "conversations": [{"from": "human", "value": 3}]},
        {"id": "nul", "conversations": [{"from": "human", "value": "a\u0000b"}]},
        [1, 2],
    ]
    write_sharegpt(path, recs)
    out = list(read_records(path, "sharegpt"))
    assert len(out) == len(recs)
    ok = {r.record_id: r for r in out if isinstance(r, Conversation)}
    assert [m.role for m in ok["r0"].messages] == ["system", "user", "assistant"]
    assert ok["r1"].messages[0] == Message("user", "next") and ok["r1"].notes == ["dropped 1 leading assistant turn(s)"]
    assert [m.role for m in ok["r7"].messages] == ["user"]
    reasons = [r.reason for r in out if isinstance(r, Rejected)]
    assert reasons == [
        "no turns",
        "turn 1: empty assistant turn",
        "turn 1: two user turns in a row",
        "turn 1: unknown role 'tool'",
        "turn 2: system turn after the conversation started",
        "turn 0: content is int, not a string",
        "turn 0: NUL character in content",
        "is list, not an object",
    ]
    assert list(ok) == ["r0", "r1", "r7"]  # only the valid conversations, in order


def test_sharegpt_bad_element_does_not_lose_the_rest(tmp_path):
    path = tmp_path / "s.json"
    good = json.dumps(sharegpt_record(0))
    path.write_text(f'[{good},\n{{"id": "bad", "conversations": [}},\n{json.dumps(sharegpt_record(2))}]\njunk')
    out = list(read_records(path, "sharegpt"))
    assert [type(r).__name__ for r in out] == ["Conversation", "Rejected", "Conversation", "Rejected"]
    assert out[1].reason.startswith("invalid JSON") and out[1].location == "s.json#record=2"
    assert out[3].reason == "bytes after the closing ']'"


def test_openai_nested_and_flat(tmp_path):
    path = tmp_path / "o.jsonl"
    nested = {
        "request": {"model": "m1", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]},
        "response": {"model": "m1-2024", "created": 1700000000,
                     "choices": [{"message": {"role": "assistant", "content": [{"type": "text", "text": "a"}]}}]},
    }
    flat = {"messages": [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}], "model": "m2"}
    flat_bad = {"messages": [{"role": "user", "content": "q3"}]}
    tool = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [{}]}]}
    write_lines(path, [nested, flat, flat_bad, tool])
    out = list(read_records(path, "openai"))
    assert out[0].messages == [Message("system", "s"), Message("user", "q"), Message("assistant", "a")]
    assert out[0].served_by == "m1-2024" and out[0].timestamp == 1700000000.0
    assert out[1].served_by == "m2" and out[1].location == "o.jsonl:2"
    assert out[2].reason == "flat form: the last message must be the assistant's"
    assert out[3].reason == "messages[1]: tool calls are not supported"


def test_jsonl_lines_and_locations(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(
        b'{"prompt": "p1", "response": "r1", "system": "sys"}\n'
        b"\n"
        b'{"prompt": "p2"}\n'
        b'{"prompt": "p\xff", "response": "r"}\n'
        b"not json\n"
        b'{"prompt": "p5", "response": "r5"}\n'
    )
    out = list(read_records(path, "jsonl"))
    assert [m.role for m in out[0].messages] == ["system", "user", "assistant"]
    assert [r.location for r in out] == ["p.jsonl:1", "p.jsonl:3", "p.jsonl:4", "p.jsonl:5", "p.jsonl:6"]
    assert out[1].reason == "missing key 'response'"
    assert out[2].reason.startswith("invalid UTF-8") and "\\xff" in out[2].raw
    assert out[3].reason.startswith("invalid JSON")


def test_runs_of_blank_lines_keep_every_location_and_offset(tmp_path):
    """Blank lines are skipped a buffer at a time (a gzip of gigabytes of newlines): locations stay exact."""
    import gzip

    good = b'{"prompt": "p", "response": "r"}\n'
    body = b"\n \n\t\r\n" + good + b"\n" * 100_000 + b"  " + good + b"\n\n"
    for path in (tmp_path / "p.jsonl", tmp_path / "p.jsonl.gz"):
        path.write_bytes(gzip.compress(body) if path.suffix == ".gz" else body)
        reader = read_records(path, "jsonl")
        out = list(reader)
        assert [r.location for r in out] == [f"{path.name}:4", f"{path.name}:100005"]
        assert out[1].offset == 6 + len(good) + 100_000 and reader.end_offset == len(body)
        assert reader.index == 100_007 and reader.truncation is None


def test_jsonl_unterminated_last_line_is_a_tail_until_complete(tmp_path):
    path = tmp_path / "p.jsonl"
    line = json.dumps({"prompt": "p", "response": "r"}) + "\n"
    path.write_text(line + line[:10])
    reader = read_records(path, "jsonl")
    assert len(list(reader)) == 1
    assert reader.truncation.location == "p.jsonl:2" and reader.end_offset == len(line)
    path.write_text(line + line)
    again = read_records(path, "jsonl", start_offset=reader.end_offset, start_index=reader.records)
    assert [r.location for r in again] == ["p.jsonl:2"] and again.truncation is None


def test_huge_line_is_rejected_without_keeping_it(tmp_path):
    path = tmp_path / "p.jsonl"
    good = json.dumps({"prompt": "p", "response": "r"})
    path.write_text(good + "\n" + json.dumps({"prompt": "x" * 5000, "response": "r"}) + "\n" + good + "\n")
    out = list(read_records(path, "jsonl", max_record_bytes=1000))
    assert isinstance(out[1], Rejected) and out[1].reason.startswith("too long") and len(out[1].raw) < 3000
    assert isinstance(out[2], Conversation) and out[2].location == "p.jsonl:3"
    out = list(read_records(path, "jsonl", max_chars=100))
    assert out[1].reason == "too long: 5001 characters of content (limit 100)"


def test_humaneval_gz(tmp_path):
    path = tmp_path / "h.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"task_id": "T/0", "prompt": "def f():\n"}) + "\n")
        f.write(json.dumps({"task_id": "T/1"}) + "\n")
    out = list(read_records(path, "humaneval"))
    assert out[0].messages == [Message("user", "def f():\n")] and out[0].record_id == "T/0"
    assert out[1].reason == "missing key 'prompt'"


def test_wrong_format_names_file_and_first_line(tmp_path):
    path = tmp_path / "o.jsonl"
    write_lines(path, [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}] * 3)
    with pytest.raises(FormatMismatchError, match=r"o.jsonl.*o.jsonl:1: missing key 'prompt'.*looks like openai"):
        list(read_records(path, "jsonl"))
    with pytest.raises(FormatMismatchError, match=r"o.jsonl: line 1 .*starting with '\['"):
        list(read_records(path, "sharegpt"))
    sg = tmp_path / "s.json"
    write_sharegpt(sg, [sharegpt_record(0)])
    with pytest.raises(FormatMismatchError, match=r"s.json:1: invalid JSON"):
        list(read_records(sg, "openai"))
    with pytest.raises(ValueError, match="unknown format 'csv'"):
        read_records(sg, "csv")


def test_shipped_sharegpt_file_streams_17671_records():
    from specdistill.data.datasets import sharegpt_path

    reader = read_records(sharegpt_path(), "sharegpt")
    n = sum(1 for _ in reader)
    assert n == 17_671
    assert reader.truncation is not None and reader.truncation.location.endswith("#record=17672")
    assert reader.truncation.offset + reader.truncation.tail_bytes == sharegpt_path().stat().st_size


def test_shipped_humaneval():
    from specdistill.data.datasets import humaneval_path

    out = list(read_records(humaneval_path(), "humaneval"))
    assert len(out) == 164 and all(isinstance(r, Conversation) for r in out)
