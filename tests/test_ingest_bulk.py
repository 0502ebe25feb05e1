"""Ingestion's fast path (orjson, COPY on PostgreSQL, a parsing child for a big file) stores and rejects exactly what the
plain path did."""

from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdistill.data import readers
from specdistill.data.ingest import ingest
from specdistill.data.logstore import LogStore


def outcome(path, fmt: str) -> list:
    return [(type(r).__name__, r.location, getattr(r, "reason", None), getattr(r, "messages", None),
             getattr(r, "temperature", None)) for r in readers.read_records(path, fmt)]


ODD_LINES = st.sampled_from([
    b'{"prompt": "p", "response": "r"}', b'{"prompt": "\\ud800", "response": "r"}', b'{"prompt": NaN, "response": "r"}',
    b'\xef\xbb\xbf{"prompt": "bom", "response": "r"}', b'{"prompt": "p", "response": "r", "n": 1' + b'0' * 30 + b'}',
    b'{"prompt": "\xff", "response": "r"}', b'[' * 3000 + b']' * 3000, b'{"prompt": "a", "prompt": "b", "response": "r"}',
    b'{"prompt": "p"', b'{"prompt": "\\u0000", "response": "r"}', b'  {"prompt": "sp", "response": "r"}  ',
    b'{"request": {"messages": [{"role": "user", "content": "q"}], "temperature": 1e400}, '
    b'"response": {"choices": [{"message": {"role": "assistant", "content": "a"}}]}}',
])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(ODD_LINES, min_size=1, max_size=8), fmt=st.sampled_from(["jsonl", "openai"]))
def test_orjson_first_reads_every_line_as_json_alone_did(tmp_path_factory, monkeypatch, lines, fmt):
    path = tmp_path_factory.mktemp("r") / "log.jsonl"
    path.write_bytes(b'{"prompt": "first", "response": "ok", "messages": [{"role": "user", "content": "x"}, '
                     b'{"role": "assistant", "content": "y"}]}\n' + b"\n".join(lines) + b"\n")
    fast = outcome(path, fmt)

    def refuse(data):
        raise orjson.JSONDecodeError("off", "", 0)

    with monkeypatch.context() as m:
        m.setattr(readers.orjson, "loads", refuse)
        assert outcome(path, fmt) == fast


def test_a_logged_user_is_stored(store_url, tmp_path):
    path = tmp_path / "gateway.jsonl"
    rec = {"request": {"messages": [{"role": "user", "content": "hello"}], "user": "user-42"},
           "response": {"choices": [{"message": {"role": "assistant", "content": "hi"}}]}}
    path.write_text(json.dumps(rec) + "\n" + json.dumps({**rec, "request": {**rec["request"], "user": 7}}) + "\n")
    with LogStore(store_url) as store:
        result = ingest(path, "openai", store, progress=False)
        assert (result.stored, result.duplicates) == (1, 1)
        with store.engine.connect() as conn:
            from specdistill.data.logschema import conversations

            assert conn.execute(conversations.select()).mappings().one()["user"] == "user-42"


@pytest.mark.parametrize("batch", [1, 7, 1000])
def test_batches_in_flight_conserve_counts_and_end_at_the_file_s_end(store_url, tmp_path, batch):
    path = tmp_path / "log.jsonl"
    lines = [json.dumps({"prompt": f"q{i % 150}", "response": "r"}) for i in range(200)] + ["oops"]
    path.write_text("\n".join(lines) + "\n")
    with LogStore(store_url) as store:
        result = ingest(path, "jsonl", store, batch_size=batch, progress=False)
        assert (result.read, result.stored, result.duplicates, result.quarantined) == (201, 150, 50, 1)
        assert store.watermark(str(path.resolve())).offset == path.stat().st_size == result.end_offset
        assert store.stats()["ingested"] == {"read": 201, "stored": 150, "duplicates": 50, "quarantined": 1}


ODD_FIELDS = st.sampled_from([None, "", "m", "m\x00", "x" * 300, 7, 2**70, 1.5, -1e300, 1e20, True, [1], {"a": 1},
                              "\ud800", 0, 1764547200, -62135596801, 253402300800, 0.0, 100.0, 100.5])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=st.lists(st.tuples(ODD_FIELDS, ODD_FIELDS, ODD_FIELDS, ODD_FIELDS, ODD_FIELDS, ODD_FIELDS),
                       min_size=1, max_size=6))
def test_every_conversation_the_readers_make_passes_the_stores_field_checks(tmp_path_factory, fields):
    """`ingest` prepares the readers' records with `prepare_batch(is_checked=True)`, which skips `checked`: sound
    only if no conversation a reader yields is one `checked` would quarantine, whatever its logged fields."""
    from specdistill.data.batch import checked

    path = tmp_path_factory.mktemp("f") / "log.jsonl"
    lines = []
    for model, created, rid, temperature, user, request_model in fields:
        lines.append(json.dumps({
            "request": {"model": request_model, "messages": [{"role": "user", "content": "q"}], "temperature": temperature,
                        "user": user},
            "response": {"id": rid, "created": created, "model": model,
                         "choices": [{"message": {"role": "assistant", "content": "a"}}]}}))
    valid = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    path.write_text("\n".join([valid, *lines]) + "\n")  # a valid first record: the format check passes
    records = list(readers.read_records(path, "openai"))
    conversations = [r for r in records if isinstance(r, readers.Conversation)]
    assert all(checked(c) is c for c in conversations)
