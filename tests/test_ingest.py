"""Ingestion: idempotent, incremental, resumable after a kill, conserved counts, concurrent ingests."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdistill.data.ingest import ingest
from specdistill.data.logstore import LogStore
from specdistill.data.readers import FormatMismatchError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def store(store_url):
    s = LogStore(store_url)
    yield s
    s.close()


def good_line(i: int, tag: str = "") -> bytes:
    return json.dumps({"prompt": f"prompt {tag}{i}", "response": f"response {i}"}).encode() + b"\n"


def write_jsonl(path: Path, ids, tag: str = "") -> None:
    path.write_bytes(b"".join(good_line(i, tag) for i in ids))


def counts(result) -> tuple[int, int, int, int]:
    return result.read, result.stored, result.duplicates, result.quarantined


def test_reingest_adds_nothing_and_duplicates_across_files_are_counted(store, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_jsonl(a, range(0, 30))
    write_jsonl(b, range(20, 50))
    assert counts(ingest(a, "jsonl", store, batch_size=7, progress=False)) == (30, 30, 0, 0)
    assert counts(ingest(a, "jsonl", store, batch_size=7, progress=False)) == (0, 0, 0, 0)
    assert counts(ingest(b, "jsonl", store, batch_size=7, progress=False)) == (30, 20, 10, 0)
    assert store.count() == 50
    assert store.stats()["ingested"] == {"read": 60, "stored": 50, "duplicates": 10, "quarantined": 0}


def test_grown_file_reads_only_what_is_new(store, tmp_path):
    path = tmp_path / "log.jsonl"
    write_jsonl(path, range(10))
    first = ingest(path, "jsonl", store, progress=False)
    with open(path, "ab") as f:
        f.write(b"\n" + good_line(10) + b"not json\n" + good_line(11)[:12])  # the writer is mid-line
    second = ingest(path, "jsonl", store, progress=False)
    assert counts(second) == (2, 1, 0, 1) and second.start_offset == first.end_offset
    assert second.truncation["location"] == "log.jsonl:14"
    assert store.quarantined()[0]["location"] == "log.jsonl:13"  # line numbers continue across runs
    with open(path, "ab") as f:
        f.write(good_line(11)[12:])
    third = ingest(path, "jsonl", store, progress=False)
    assert counts(third) == (1, 1, 0, 0) and third.truncation is None
    assert store.count() == 12


def test_truncated_sharegpt_is_reported_and_completed_when_the_file_grows(store, tmp_path):
    records = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}
               for i in range(50)]
    full = json.dumps(records, indent=2).encode()
    path = tmp_path / "share.json"
    path.write_bytes(full[: full.index(b'"r40"') + 2])
    first = ingest(path, "sharegpt", store, batch_size=8, progress=False)
    assert counts(first) == (40, 40, 0, 0)
    assert first.truncation["location"] == "share.json#record=41"
    assert store.run(first.run_id)["truncated_at"] == first.truncation["offset"]
    path.write_bytes(full)
    second = ingest(path, "sharegpt", store, batch_size=8, progress=False)
    assert counts(second) == (10, 10, 0, 0) and second.truncation is None
    assert {c.record_id for c in store.window()} == {f"r{i}" for i in range(50)}


def test_corrupt_gzip_keeps_what_was_read_and_is_a_named_error(store, tmp_path, capsys):
    from specdistill.cli import main

    good = gzip.compress(b"".join(good_line(i) for i in range(30)))
    path = tmp_path / "log.jsonl.gz"
    path.write_bytes(good + b"garbage!" * 8)  # a second gzip member that is not one
    result = ingest(path, "jsonl", store, batch_size=7, progress=False)
    assert counts(result) == (30, 30, 0, 0) and result.conserved
    assert str(path) in result.corrupt and "corrupt gzip data" in result.corrupt
    assert result.truncation["location"] == "log.jsonl.gz:31"
    bad_crc = bytearray(gzip.compress(b"".join(good_line(i, "c") for i in range(20))))
    bad_crc[-8] ^= 0xFF  # the trailer's CRC: every block inflates, the check at the end fails
    other = tmp_path / "crc.jsonl.gz"
    other.write_bytes(bytes(bad_crc))
    assert main(["ingest", str(other), "--format", "jsonl", "--db", store.url, "--no-progress", "--json"]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out)["read"] == 20 and store.count() == 50
    assert err.startswith(f"specdistill: error: {other}: corrupt gzip data: CRC check failed")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_gzip_cut_short_is_a_truncation(store, tmp_path):
    whole = gzip.compress(b"".join(good_line(i, f"{i}-" * 40) for i in range(400)))
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(whole[: len(whole) // 2])
    first = ingest(path, "jsonl", store, batch_size=50, progress=False)
    assert 0 < first.read < 400 and first.conserved and first.corrupt is None
    assert first.truncation["location"] == f"cut.jsonl.gz:{first.read + 1}"
    path.write_bytes(whole)
    second = ingest(path, "jsonl", store, batch_size=50, progress=False)
    assert second.truncation is None and store.count() == 400


def test_a_gzip_past_the_decompression_cap_is_quarantined_past_it_in_seconds(store, tmp_path):
    """A 65 KB gzip of 64 MiB of newlines took 68 s and stored nothing; 1 GiB ran past 120 s."""
    bomb = tmp_path / "bomb.jsonl.gz"
    with gzip.open(bomb, "wb", compresslevel=9) as f:
        for _ in range(64):
            f.write(b"\n" * (1 << 20))
    started = time.perf_counter()
    result = ingest(bomb, "jsonl", store, progress=False)  # the default cap: 100x the compressed size
    assert time.perf_counter() - started < 10
    assert counts(result) == (1, 0, 0, 1) and result.conserved
    (row,) = store.quarantined()
    assert row["location"].startswith("bomb.jsonl.gz:") and "decompressed past" in row["reason"]
    assert "--max-decompressed-bytes" in row["reason"]
    assert "quarantined 1" in result.render() and "decompressed past" in result.render()

    # records before the cap are kept; a rerun with a higher cap reads on from them
    path = tmp_path / "log.jsonl.gz"
    data = b"".join(good_line(i) for i in range(200))
    path.write_bytes(gzip.compress(data))
    cap = len(b"".join(good_line(i) for i in range(120))) + 10
    first = ingest(path, "jsonl", store, progress=False, max_decompressed_bytes=cap)
    assert counts(first) == (121, 120, 0, 1) and first.end_offset == cap - 10
    assert counts(ingest(path, "jsonl", store, progress=False, max_decompressed_bytes=cap)) == (1, 0, 0, 1)  # again: said again
    rest = ingest(path, "jsonl", store, progress=False, max_decompressed_bytes=len(data))
    assert counts(rest) == (80, 80, 0, 0) and store.count() == 200
    blank = ingest(bomb, "jsonl", store, progress=False, max_decompressed_bytes=1 << 30)  # under the cap: said too
    assert counts(blank) == (0, 0, 0, 0) and "blank lines only" in blank.render()


def test_the_cli_takes_the_decompression_cap(store, tmp_path, capsys):
    from specdistill.cli import main

    path = tmp_path / "log.jsonl.gz"
    path.write_bytes(gzip.compress(b"".join(good_line(i) for i in range(50))))
    assert main(["ingest", str(path), "--format", "jsonl", "--db", store.url, "--no-progress", "--json",
                 "--max-decompressed-bytes", "60"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["stored"], out["quarantined"]) == (1, 1)


def test_a_one_line_json_of_another_format_is_an_error_and_does_not_block_the_right_one(store, tmp_path):
    """A one-line .json ingested as --format jsonl stored nothing with rc 0, then blocked --format sharegpt."""
    path = tmp_path / "chats.json"
    path.write_text(json.dumps([{"id": "a", "conversations": [{"from": "human", "value": "hi"},
                                                               {"from": "gpt", "value": "hello"}]}]))  # no newline
    with pytest.raises(FormatMismatchError, match=r"chats.json: no valid jsonl record.*chats.json:1.*looks like sharegpt"):
        ingest(path, "jsonl", store, progress=False)
    assert store.stats()["ingest_runs"] == 0
    assert counts(ingest(path, "sharegpt", store, progress=False)) == (1, 1, 0, 0)


def test_a_format_that_read_nothing_does_not_block_another(store, tmp_path):
    path = tmp_path / "partial.log"
    path.write_text('{"prompt": "a", "resp')  # an unfinished first line: a tail, nothing read yet
    first = ingest(path, "jsonl", store, progress=False)
    assert counts(first) == (0, 0, 0, 0) and first.truncation is not None
    second = ingest(path, "openai", store, progress=False)  # nothing was read as jsonl: another format may try
    assert second.truncation is not None and "jsonl" in second.note
    write_jsonl(path, range(3))
    ingest(path, "jsonl", store, progress=False)
    with pytest.raises(ValueError, match="was ingested as 'jsonl'"):  # records read: the format is settled
        ingest(path, "openai", store, progress=False)


def test_rewritten_file_is_read_again_from_the_start(store, tmp_path):
    path = tmp_path / "log.jsonl"
    write_jsonl(path, range(10))
    ingest(path, "jsonl", store, progress=False)
    write_jsonl(path, range(100, 120))  # rotated in place: same name, new content
    again = ingest(path, "jsonl", store, progress=False)
    assert counts(again) == (20, 20, 0, 0) and again.start_offset == 0 and "changed" in again.note


def test_shipped_humaneval_ingests_all_164_prompts(store):
    from specdistill.data.datasets import humaneval_path

    result = ingest(humaneval_path(), "humaneval", store, progress=False)
    assert counts(result) == (164, 164, 0, 0)
    assert counts(ingest(humaneval_path(), "humaneval", store, progress=False)) == (0, 0, 0, 0)
    assert {c.record_id for c in store.window()} >= {"HumanEval/0", "HumanEval/163"}


def test_wrong_format_is_an_error_naming_the_file_and_line(store, tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    with pytest.raises(FormatMismatchError, match=r"chat.jsonl.*chat.jsonl:1: missing key 'prompt'.*openai"):
        ingest(path, "jsonl", store, progress=False)
    assert store.stats()["ingest_runs"] == 0 and store.count() == 0


def test_failure_mid_ingest_leaves_the_store_consistent_and_a_rerun_completes(store, tmp_path, monkeypatch):
    path = tmp_path / "log.jsonl"
    write_jsonl(path, range(100))
    real = store.write_batch
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("connection lost")
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "write_batch", failing)
    with pytest.raises(RuntimeError, match="connection lost"):
        ingest(path, "jsonl", store, batch_size=10, progress=False)
    assert store.count() == 30 and store.watermark(str(path.resolve())).index == 30
    monkeypatch.setattr(store, "write_batch", real)
    rest = ingest(path, "jsonl", store, batch_size=10, progress=False)
    assert counts(rest) == (70, 70, 0, 0) and store.count() == 100


def _ingest_command(url: str, path: Path, batch: int, barrier: Path | None = None) -> list[str]:
    """An ingest in its own process. With `barrier`, it touches `barrier.<pid>` once imported and waits for
    `barrier` itself before reading; then, after its first stored batch, it touches `barrier.first.<pid>` and
    waits until every process has stored one. So processes started together really ingest at the same time,
    however loaded the machine (3,000 lines take a quarter second: without the second wait one could finish
    before the other began)."""
    code = (
        "import sys, json, os, time, pathlib\n"
        "from specdistill.data.ingest import ingest\n"
        "from specdistill.data.logstore import LogStore\n"
    )
    if barrier is not None:
        code += (
            f"b = pathlib.Path({str(barrier)!r})\n"
            "pathlib.Path(f'{b}.{os.getpid()}').touch()\n"
            "t = time.time() + 120\n"
            "while not b.exists() and time.time() < t:\n"
            "    time.sleep(0.01)\n"
            "n = len(list(b.parent.glob(b.name + '.[0-9]*')))\n"
            "add = LogStore.write_batch\n"
            "def first_batch_together(self, *a, _done=[], **k):\n"
            "    out = add(self, *a, **k)\n"
            "    if not _done:\n"
            "        _done.append(1)\n"
            "        pathlib.Path(f'{b}.first.{os.getpid()}').touch()\n"
            "        t = time.time() + 120\n"
            "        while len(list(b.parent.glob(b.name + '.first.*'))) < n and time.time() < t:\n"
            "            time.sleep(0.01)\n"
            "    return out\n"
            "LogStore.write_batch = first_batch_together\n"
        )
    code += (
        f"r = ingest({str(path)!r}, 'jsonl', LogStore(sys.argv[1]), batch_size={batch}, progress=False)\n"
        "print(json.dumps(r.to_dict()))\n"
    )
    return [sys.executable, "-c", code, url]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_kill_mid_ingest_then_rerun_stores_everything_once(store, store_url, tmp_path):
    path = tmp_path / "big.jsonl"
    n = 10_000
    write_jsonl(path, range(n))
    proc = subprocess.Popen(_ingest_command(store_url, path, 100), env=_env(), stdout=subprocess.PIPE)
    source = str(path.resolve())
    deadline = time.time() + 60
    while time.time() < deadline:
        wm = store.watermark(source)
        if wm is not None and wm.index >= 500:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = store.count()
    assert 0 < killed_at < n, "the kill came too late to test anything"
    assert killed_at == store.watermark(source).index  # every committed batch moved the watermark with it
    rest = ingest(path, "jsonl", store, batch_size=500, progress=False)
    assert rest.start_offset > 0 and rest.read == n - killed_at
    assert store.count() == n
    total = store.stats()["ingested"]
    assert total["read"] == n and total["stored"] == n and total["duplicates"] == 0


def test_concurrent_ingests_of_overlapping_files_store_each_conversation_once(store, store_url, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_jsonl(a, range(0, 3000))
    write_jsonl(b, range(1500, 4500))
    go = tmp_path / "go"  # both import first, then start together: on a loaded machine one could finish before the other started
    procs = [subprocess.Popen(_ingest_command(store_url, p, 50, barrier=go), env=_env(), stdout=subprocess.PIPE, text=True)
             for p in (a, b)]
    deadline = time.time() + 120
    while len(list(tmp_path.glob("go.*"))) < len(procs) and time.time() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.01)
    go.touch()
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0
        results.append(json.loads(out))
    assert store.count() == 4500
    assert sum(r["stored"] for r in results) == 4500
    assert sum(r["duplicates"] for r in results) == 1500
    assert all(r["conserved"] and r["read"] == 3000 for r in results)
    runs = [store.run(r["run_id"]) for r in results]  # the two really ran at the same time
    assert runs[0]["started_at"] < runs[1]["finished_at"] and runs[1]["started_at"] < runs[0]["finished_at"]


def test_cli_ingest_stats_quarantine_json(store_url, tmp_path, capsys):
    from specdistill.cli import main

    path = tmp_path / "log.jsonl"
    path.write_bytes(good_line(1) + b"{broken\n" + good_line(2))
    assert main(["ingest", str(path), "--format", "jsonl", "--db", store_url, "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["read"], out["stored"], out["duplicates"], out["quarantined"]) == (3, 2, 0, 1)
    assert main(["logs", "stats", "--db", store_url, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["conversations"] == 2 and stats["quarantined"] == 1
    assert main(["logs", "quarantine", "--db", store_url, "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    rows = listing["records"]
    assert listing["total"] == 1 and listing["shown"] == 1
    assert rows[0]["location"] == "log.jsonl:2" and rows[0]["reason"].startswith("invalid JSON")
    assert main(["ingest", str(path), "--format", "sharegpt", "--db", store_url, "--no-progress"]) == 2
    assert "was ingested as 'jsonl'" in capsys.readouterr().err
    other = tmp_path / "other.jsonl"
    other.write_bytes(path.read_bytes())
    assert main(["ingest", str(other), "--format", "sharegpt", "--db", store_url, "--no-progress"]) == 2
    assert "other.jsonl: line 1" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# corrupted traffic: conservation, and every good record stored


def _corrupt(kind: str, i: int, tag: str) -> bytes:
    line = good_line(i, tag).rstrip(b"\n")
    if kind == "bad_json":
        return line[: len(line) // 2]
    if kind == "wrong_type":
        return json.dumps({"prompt": i, "response": f"r{i}"}).encode()
    if kind == "missing_field":
        return json.dumps({"prompt": f"p{tag}{i}"}).encode()
    if kind == "invalid_utf8":
        return line.replace(b"prompt ", b"prompt \xff\xfe", 1)
    if kind == "huge":
        return json.dumps({"prompt": "x" * 9000 + f"{tag}{i}", "response": "r"}).encode()
    if kind == "nul_byte":
        return line.replace(b"prompt ", b"prompt \x00", 1)
    if kind == "nul_escape":
        return line.replace(b"prompt ", b"prompt \\u0000", 1)
    if kind == "not_object":
        return b"[1, 2, 3]"
    if kind == "huge_integer":  # past the digits Python's json converts: a ValueError, not a JSONDecodeError
        return line.replace(b"{", b'{"n": 1' + b"0" * 5000 + b", ", 1)
    raise AssertionError(kind)


KINDS = ["bad_json", "wrong_type", "missing_field", "invalid_utf8", "huge", "nul_byte", "nul_escape", "not_object",
         "huge_integer"]
LINE = st.one_of(
    st.tuples(st.just("good"), st.integers(0, 30)),
    st.tuples(st.just("dup"), st.integers(0, 30)),
    st.tuples(st.sampled_from(KINDS), st.integers(0, 30)),
    st.tuples(st.just("blank"), st.just(0)),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(LINE, min_size=1, max_size=40))
def test_corrupted_jsonl_conserves_counts_and_stores_every_good_record(store, tmp_path, lines):
    tag = uuid.uuid4().hex[:8] + "-"  # examples share one store: keep their records apart
    path = tmp_path / f"{tag}.jsonl"
    data, good, bad, records = [], set(), 0, 0
    for kind, i in lines:
        if kind == "blank":
            data.append(b"\n")
            continue
        records += 1
        if kind in ("good", "dup"):
            data.append(good_line(i, tag))
            good.add(f"prompt {tag}{i}")
        else:
            data.append(_corrupt(kind, i, tag) + b"\n")
            bad += 1
    path.write_bytes(b"".join(data))

    first_records = [kind for kind, _ in lines if kind != "blank"][:20]
    if first_records and not {"good", "dup"} & set(first_records):  # nothing valid: not a jsonl file
        with pytest.raises(FormatMismatchError, match=path.name):
            ingest(path, "jsonl", store, progress=False, max_record_bytes=8000)
        return
    result = ingest(path, "jsonl", store, progress=False, max_record_bytes=8000)
    assert result.read == records
    assert result.read == result.stored + result.duplicates + result.quarantined
    assert result.quarantined == bad
    assert result.stored == len(good)
    stored = {c.messages[0].content for c in store.window(source=str(path.resolve()))}
    assert stored == good
    assert len(store.quarantined(source=str(path.resolve()), limit=None)) == bad


# ----------------------------------------------------------------------------------------------
# one bad field is one quarantined record, in every format, and the rest of the file is read


def _openai(i: int, tag: str, flat: bool = False, **fields) -> dict:
    q = {"role": "user", "content": f"q {tag}{i}"}
    a = {"role": "assistant", "content": f"a {i}"}
    if flat:
        return {"messages": [q, a], **fields}
    request = {"messages": [q], **{k: v for k, v in fields.items() if k == "temperature"}}
    response = {"choices": [{"message": a}], **{k: v for k, v in fields.items() if k != "temperature"}}
    return {"request": request, "response": response}


BAD_NUMBERS = ["1e300", "-1e18", "Infinity", "-Infinity", "NaN", "1" + "0" * 400, "1" + "0" * 5000, "true", '"soon"']
BAD_LABELS = ['"' + "x" * 300 + '"', '"a\\u0000b"', '"\\ud800"', "[1]", "1.5"]


def _bad_openai_lines(tag: str) -> list[str]:
    """One record per bad value of every field the openai parser reads, nested and flat."""
    lines = []
    for flat in (False, True):
        for field, bad in ([("created", v) for v in BAD_NUMBERS] + [("temperature", v) for v in BAD_NUMBERS + ["-1"]]
                           + [("id", v) for v in BAD_LABELS] + [("model", v) for v in BAD_LABELS if v != "1.5"]):
            text = json.dumps(_openai(len(lines), tag, flat, **{field: "BAD"}))
            lines.append(text.replace('"BAD"', bad))
    return lines


@pytest.mark.parametrize("fmt", ["openai", "sharegpt", "humaneval"])
def test_a_bad_field_is_one_quarantined_record_and_the_rest_of_the_file_is_read(store, tmp_path, fmt):
    tag = uuid.uuid4().hex[:8]
    if fmt == "openai":
        good = [json.dumps(_openai(i, tag, created=1700000000 + i, temperature=0.7, id=f"c{i}", model="m"))
                for i in (1000, 1001)]
        bad = _bad_openai_lines(tag)
        path = tmp_path / "o.jsonl"
        path.write_text("\n".join([good[0], *bad, good[1]]) + "\n")
    elif fmt == "sharegpt":
        def conv(i, rid):
            return ('{"id": ' + rid + ', "conversations": [{"from": "human", "value": "q ' + f"{tag}{i}"
                    + '"}, {"from": "gpt", "value": "a"}]}')
        good = [conv(1000, '"g1"'), conv(1001, "7")]
        bad = [conv(i, v) for i, v in enumerate(BAD_LABELS + ["NaN", "1" + "0" * 5000])]
        path = tmp_path / "s.json"
        path.write_text("[" + ",\n".join([good[0], *bad, good[1]]) + "]\n")
    else:
        def task(i, tid):
            return '{"task_id": ' + tid + ', "prompt": "def f' + f"{tag}{i}" + '(): pass"}'
        good = [task(1000, '"t/1"'), task(1001, '"t/2"')]
        bad = [task(i, v) for i, v in enumerate(BAD_LABELS + ["NaN", "Infinity"])]
        path = tmp_path / "h.jsonl"
        path.write_text("\n".join([good[0], *bad, good[1]]) + "\n")

    result = ingest(path, fmt, store, progress=False, batch_size=4)
    assert counts(result) == (len(bad) + 2, 2, 0, len(bad))
    reasons = [q["reason"] for q in store.quarantined(source=str(path.resolve()), limit=None)]
    assert len(reasons) == len(bad) and all(reasons)
    assert store.run(result.run_id)["status"] == "done"
    if fmt == "openai":
        kept = sorted(store.window(source=str(path.resolve())), key=lambda c: c.arrived_at)
        assert [c.arrived_at.timestamp() for c in kept] == [1700001000, 1700001001]
        assert any("response.created is NaN" in r for r in reasons)
        assert any("created 1e+300 is not a time" in r for r in reasons)
    assert counts(ingest(path, fmt, store, progress=False)) == (0, 0, 0, 0)  # nothing blocks a rerun either


def test_a_conversation_built_in_code_with_a_field_no_backend_holds_is_quarantined(store, tmp_path):
    from specdistill.data.formats import Message
    from specdistill.data.readers import Conversation

    run = store.begin_run("code", "openai", 0)
    messages = [Message("user", "q"), Message("assistant", "a")]
    records = [Conversation(messages, "code", "code:1", timestamp=float("inf")),
               Conversation(messages, "code", "code:2", served_by="m\x00"),
               Conversation(messages, "code", "code:3", timestamp=1e9)]
    got = store.add_batch(run, records)
    assert (got.stored, got.duplicates, got.quarantined) == (1, 0, 2)


def test_a_failed_or_interrupted_ingest_closes_its_run(store, tmp_path, monkeypatch):
    path = tmp_path / "log.jsonl"
    write_jsonl(path, range(30))
    real = store.write_batch
    for error, status in ((RuntimeError("connection lost"), "failed"), (KeyboardInterrupt(), "interrupted")):
        def failing(*args, _error=error, calls={"n": 0}, **kwargs):  # noqa: B006 (a fresh count each error)
            calls["n"] += 1
            if calls["n"] == 2:
                raise _error
            return real(*args, **kwargs)

        monkeypatch.setattr(store, "write_batch", failing)
        with pytest.raises(type(error)):
            ingest(path, "jsonl", store, batch_size=5, progress=False)
        monkeypatch.setattr(store, "write_batch", real)
        with store.engine.connect() as conn:
            import sqlalchemy as sa

            from specdistill.data.logschema import ingest_runs
            last = conn.execute(sa.select(ingest_runs).order_by(ingest_runs.c.id.desc())).mappings().first()
        assert last["status"] == status and last["finished_at"] is not None and "goes on from" in last["note"]
    rest = ingest(path, "jsonl", store, batch_size=5, progress=False)
    assert store.count() == 30 and rest.conserved
