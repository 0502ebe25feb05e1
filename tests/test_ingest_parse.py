"""Parsing in a child process: the same store, counts and watermark as parsing in the writer, and every way
it can end (a bad format, a writer that fails, a child that dies) leaves the store consistent."""

from __future__ import annotations

import gzip
import json
import os
import signal
from pathlib import Path

import pytest
import sqlalchemy as sa

from specdistill.data import ingest_parse
from specdistill.data.ingest import ingest
from specdistill.data.logschema import conversations, quarantine
from specdistill.data.logstore import LogStore
from specdistill.data.readers import FormatMismatchError, read_records


def _store(url: str) -> LogStore:
    return LogStore(url)


@pytest.fixture
def store(store_url):
    s = _store(store_url)
    yield s
    s.close()


def openai_line(i: int, user: str = "u", pad: int = 0) -> bytes:
    return json.dumps({
        "request": {"model": "m", "user": f"{user}{i % 7}", "temperature": 0.5,
                    "messages": [{"role": "user", "content": f"question {i % 150}\ttab\\slash\nline" + "." * pad}]},
        "response": {"id": f"r{i}", "created": 1_760_000_000 + i, "model": "m",
                     "choices": [{"message": {"role": "assistant", "content": f"answer {i % 150} é"}}]},
    }).encode() + b"\n"


def messy_log(path: Path, n: int = 400) -> Path:
    """Duplicates (every 150th question repeats), malformed lines, blank lines, and an unfinished last line."""
    lines = []
    for i in range(n):
        lines.append(openai_line(i))
        if i % 53 == 0:
            lines.append(b"{not json\n")
        if i % 71 == 0:
            lines.append(b"\n\n")
    path.write_bytes(b"".join(lines) + b'{"request": {"mess')
    return path


def contents(store: LogStore) -> tuple[list, list]:
    with store.engine.connect() as conn:
        rows = conn.execute(sa.select(conversations.c.content_hash, conversations.c.split, conversations.c.location,
                                      conversations.c.user, conversations.c.messages, conversations.c.arrived_at)
                            .order_by(conversations.c.content_hash)).all()
        bad = conn.execute(sa.select(quarantine.c.location, quarantine.c.reason).order_by(quarantine.c.location)).all()
    return [tuple(r) for r in rows], [tuple(r) for r in bad]


@pytest.mark.parametrize("gz", [False, True], ids=["jsonl", "gz"])
def test_a_child_parses_into_the_same_store_as_the_writer(store_url, tmp_path, gz):
    path = messy_log(tmp_path / "log.jsonl")
    if gz:
        data = path.read_bytes()
        path = tmp_path / "log.jsonl.gz"
        path.write_bytes(gzip.compress(data))
    results = {}
    for in_child in (False, True):
        url = store_url if in_child else f"sqlite:///{tmp_path / 'here.db'}"
        with _store(url) as s:
            r = ingest(path, "openai", s, batch_size=37, progress=False, source="log", parse_in_child=in_child)
            results[in_child] = (r.to_dict(), contents(s), s.watermark("log"))
    here, child = results[False], results[True]
    for key in ("read", "stored", "duplicates", "quarantined", "end_offset", "truncation", "conserved"):
        assert child[0][key] == here[0][key], key
    assert child[0]["stored"] == 150 and child[0]["quarantined"] == 8 and child[0]["truncation"] is not None
    assert child[1] == here[1]  # the same rows, splits, locations and quarantine
    assert (child[2].offset, child[2].index, child[2].fingerprint) == (here[2].offset, here[2].index, here[2].fingerprint)


def test_a_grown_file_is_read_on_in_a_child_from_the_watermark(store, tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b"".join(openai_line(i) for i in range(100)))
    first = ingest(path, "openai", store, batch_size=30, progress=False, parse_in_child=True)
    with path.open("ab") as f:
        f.write(b"".join(openai_line(i, user="v") for i in range(100, 140)))
    rest = ingest(path, "openai", store, batch_size=30, progress=False, parse_in_child=True)
    again = ingest(path, "openai", store, batch_size=30, progress=False, parse_in_child=True)
    assert (first.read, rest.read, again.read) == (100, 40, 0)
    assert rest.start_offset == first.end_offset and store.count() == 140


def test_a_wrong_format_is_said_from_the_child_and_opens_no_run(store, tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    with pytest.raises(FormatMismatchError, match=r"chat.jsonl.*chat.jsonl:1: missing key 'prompt'.*openai"):
        ingest(path, "jsonl", store, progress=False, parse_in_child=True)
    assert store.stats()["ingest_runs"] == 0 and store.count() == 0


def _children() -> list[int]:
    """This process's children that parse (their command line names the module)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"\nPPid:\t{os.getpid()}\n" in (entry / "status").read_text() \
                    and b"ingest_parse" in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("how", ["writer fails", "child dies"])
def test_a_stopped_ingest_leaves_batches_whole_and_no_child_and_a_rerun_completes(store, tmp_path, monkeypatch, how):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b"".join(openai_line(i, pad=10_000) for i in range(150)))  # a batch fills a pipe's buffer
    real = store.write_batch
    calls = {"n": 0}

    def stopping(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            if how == "writer fails":
                raise RuntimeError("connection lost")
            for pid in _children():
                os.kill(pid, signal.SIGKILL)
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "write_batch", stopping)
    monkeypatch.setattr(ingest_parse, "QUEUE_BATCHES", 1)  # the child cannot have sent every batch before it dies
    error = "connection lost" if how == "writer fails" else r"parsing the file stopped \(exit code -9\)"
    with pytest.raises(RuntimeError, match=error):
        ingest(path, "openai", store, batch_size=10, progress=False, parse_in_child=True)
    assert _children() == []
    stored = store.count()
    assert stored % 10 == 0 and 20 <= stored < 150  # whole batches only
    assert store.watermark(str(path.resolve())).index == stored
    monkeypatch.setattr(store, "write_batch", real)
    rest = ingest(path, "openai", store, batch_size=10, progress=False, parse_in_child=True)
    assert rest.read == 150 - stored and rest.conserved and store.count() == 150


def test_a_big_file_is_parsed_in_a_child_and_a_small_one_here(tmp_path, monkeypatch):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b"".join(openai_line(i) for i in range(20)))
    started = []
    real = ingest_parse._start_child
    monkeypatch.setattr(ingest_parse, "_start_child", lambda *a: started.append(1) or real(*a))
    for min_bytes, children in ((path.stat().st_size + 1, 0), (path.stat().st_size, 1)):
        monkeypatch.setattr(ingest_parse, "PROCESS_MIN_BYTES", min_bytes)
        got = list(ingest_parse.read_batches(read_records(path, "openai"), 8, 0.05))
        assert len(started) == children and [b.batch.read for b in got] == [8, 8, 4] and got[-1].end is not None


def test_without_a_child_to_be_had_the_writer_parses(tmp_path, monkeypatch):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b"".join(openai_line(i) for i in range(20)))

    def no_process(*args):
        raise OSError("fork: resource temporarily unavailable")

    monkeypatch.setattr(ingest_parse, "_start_child", no_process)
    got = list(ingest_parse.read_batches(read_records(path, "openai"), 8, 0.05, in_child=True))
    assert sum(b.batch.read for b in got) == 20
