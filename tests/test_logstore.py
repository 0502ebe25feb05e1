"""Log store on SQLite and PostgreSQL: migrations, dedup, split, windows, responses, acceptance."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st

from specdistill.acceptance import DraftCounts
from specdistill.data.identity import hashes, split_of
from specdistill.data.logschema import downgrade, metadata, schema_revision
from specdistill.data.logstore import (
    LogStore,
    Watermark,
    content_hash,
    display_url,
    prompt_hash,
    upgrade,
)
from specdistill.data.readers import Conversation, Message, Rejected


@pytest.fixture
def store(store_url):
    s = LogStore(store_url)
    yield s
    s.close()


def conv(prompt: str, answer: str = "answer", source: str = "src", location: str = "f:1", **kw) -> Conversation:
    return Conversation([Message("user", prompt), Message("assistant", answer)], source, location, **kw)


def test_migrations_build_exactly_the_declared_schema(store):
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    assert schema_revision(store.engine) == "0005"
    with store.engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), metadata) == []
    upgrade(store.engine)  # opening an up-to-date store again changes nothing
    assert schema_revision(store.engine) == "0005"
    downgrade(store.engine, "base")
    assert schema_revision(store.engine) is None
    assert "conversations" not in sa.inspect(store.engine).get_table_names()
    upgrade(store.engine)
    assert "conversations" in sa.inspect(store.engine).get_table_names()


def test_default_store_lives_under_specdistill_home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("SPECDISTILL_LOG_DB", raising=False)
    s = LogStore()
    assert (tmp_path / "state" / "logs.db").is_file()
    s.close()


def test_batch_dedups_within_and_across_batches_and_quarantines(store):
    run = store.begin_run("src", "jsonl", 0)
    bad = Rejected("src", "f:3", "invalid JSON: x", "{oops")
    counts = store.add_batch(run, [conv("a"), conv("b"), conv("a", location="f:4"), bad])
    assert (counts.stored, counts.duplicates, counts.quarantined) == (2, 1, 1)
    counts = store.add_batch(run, [conv("b", source="other"), conv("c"), bad])
    assert (counts.stored, counts.duplicates, counts.quarantined) == (1, 1, 1)
    assert store.count() == 3
    rows = store.quarantined()
    assert len(rows) == 1 and rows[0]["location"] == "f:3" and rows[0]["reason"] == "invalid JSON: x"
    info = store.finish_run(run)
    assert (info["read"], info["stored"], info["duplicates"], info["quarantined"]) == (7, 3, 2, 2)
    stats = store.stats()
    assert stats["ingested"] == {"read": 7, "stored": 3, "duplicates": 2, "quarantined": 2}
    assert stats["conversations"] == 3 and sum(stats["by_split"].values()) == 3


def test_a_sample_s_first_rows_are_a_sample_too_not_its_oldest(store):
    run = store.begin_run("src", "jsonl", 0)
    store.add_batch(run, [conv(f"prompt {i}", location=f"f:{i}") for i in range(200)])
    ids = sorted(c.id for c in store.window(limit=1000))
    rows = store.sample(100, seed=3)
    assert len({r.id for r in rows}) == 100
    first = [r.id for r in rows[:25]]
    # what the nightly keeps of it: sorted by id, the first 25 of 100 were the oldest ~50 of the 200
    assert max(first) > ids[100] and first != sorted(first)
    assert [r.id for r in store.sample(100, seed=3)] == [r.id for r in rows]  # reproducible, order included


def test_export_answered_writes_only_conversations_with_an_answer(store, tmp_path):
    import json

    run = store.begin_run("src", "jsonl", 0)
    prompt_only = Conversation([Message("user", "write fib")], "src", "f:2")
    store.add_batch(run, [conv("a", "yes"), prompt_only])
    ids = [row.id for row in store.sample(10, seed=0)]
    path = tmp_path / "answered.jsonl"
    assert store.export_answered(ids, path) == 1
    (line,) = path.read_text().splitlines()
    assert json.loads(line)["messages"][-1] == {"role": "assistant", "content": "yes"}
    only_prompts = [i for i in ids if i != int(json.loads(line)["id"])]
    assert store.export_answered(only_prompts, tmp_path / "none.jsonl") == 0
    assert not (tmp_path / "none.jsonl").exists()


def test_split_is_fixed_by_the_prompt_hash():
    first = [Message("user", "same opening"), Message("assistant", "x")]
    longer = first + [Message("user", "more"), Message("assistant", "y")]
    assert prompt_hash(first) == prompt_hash(longer) and content_hash(first) != content_hash(longer)
    assert split_of(prompt_hash(first)) == split_of(prompt_hash(longer))
    splits = [split_of(prompt_hash([Message("user", f"prompt {i}")])) for i in range(4000)]
    assert 0.03 < splits.count("eval") / len(splits) < 0.07
    assert split_of("0" * 64, 0.05) == "eval" and split_of("f" * 64, 0.05) == "train"


def test_windows_filter_by_time_source_split_and_target_version(store):
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    run = store.begin_run("mixed", "openai", 0)
    recs = [
        conv(f"p{i}", source="a" if i % 2 else "b", served_by="v1" if i < 6 else "v2",
             timestamp=(t0 + timedelta(hours=i)).timestamp())
        for i in range(10)
    ]
    store.add_batch(run, recs)
    recent = store.window(since=t0 + timedelta(hours=5))
    assert [c.messages[0].content for c in recent] == [f"p{i}" for i in range(9, 4, -1)]
    assert recent[0].arrived_at == t0 + timedelta(hours=9)
    assert [c.messages[0].content for c in store.window(until=t0 + timedelta(hours=2), newest_first=False)] == ["p0", "p1"]
    assert {c.source for c in store.window(source="a")} == {"a"} and store.count(source="a") == 5
    assert [c.messages[0].content for c in store.window(target_version="v2", limit=2)] == ["p9", "p8"]
    train, evals = store.count(split="train"), store.count(split="eval")
    assert train + evals == 10
    assert all(c.split == "eval" for c in store.window(split="eval"))
    with pytest.raises(ValueError, match="split must be"):
        store.window(split="test")
    a, b = store.sample(4, seed=1), store.sample(4, seed=1)
    assert [c.id for c in a] == [c.id for c in b] and len(a) == 4
    assert len(store.sample(100, source="b")) == 5


def test_target_responses_link_prompt_and_fingerprint(store):
    run = store.begin_run("src", "jsonl", 0)
    store.add_batch(run, [conv("q1"), conv("q2")])
    c1 = store.window(newest_first=False)[0]
    params = {"max_new_tokens": 64, "temperature": 0.0}
    assert store.add_response(c1.id, "fp-A", "target says", prompt_messages=1, params=params, token_ids=[5, 6, 2])
    assert not store.add_response(c1.id, "fp-A", "again", prompt_messages=1, params=params)  # already there
    assert store.add_response(c1.id, "fp-B", "new target says", prompt_messages=1, params=params)
    got = store.responses("fp-A")
    assert len(got) == 1 and got[0]["text"] == "target says" and got[0]["token_ids"] == [5, 6, 2]
    assert got[0]["params"] == params and got[0]["conversation_id"] == c1.id
    assert store.responses("fp-B", conversation_ids=[c1.id + 1000]) == []
    with pytest.raises(sa.exc.IntegrityError):  # a response must belong to a stored conversation
        store.add_response(10_000, "fp-A", "orphan", prompt_messages=1)


def test_acceptance_samples_give_the_design_definitions(store):
    store.add_acceptance_sample("fp", "draft-1", 4, DraftCounts(10, 40, 20, [8, 6, 4, 2]))
    store.add_acceptance_sample("fp", "draft-1", 4, DraftCounts(10, 40, 10, [5, 3, 1, 1]))
    got = store.acceptance("fp", "draft-1")
    assert got["samples"] == 2
    assert got["acceptance_rate"] == pytest.approx(30 / 80)
    assert got["mean_accepted_length"] == pytest.approx(1 + 30 / 20)
    assert store.acceptance("fp", "other")["acceptance_rate"] is None
    with pytest.raises(ValueError):
        store.add_acceptance_sample("fp", "d", 2, DraftCounts(1, 2, 3, [1, 1]))


def test_watermark_never_moves_back(store):
    run = store.begin_run("s", "jsonl", 0)
    store.add_batch(run, [], Watermark("s", "jsonl", 500, 10, "f1"))
    store.add_batch(run, [], Watermark("s", "jsonl", 200, 4, "f0"))  # a slower concurrent ingest
    wm = store.watermark("s")
    assert (wm.offset, wm.index, wm.fingerprint) == (500, 10, "f1")
    store.add_batch(run, [], Watermark("s", "jsonl", 900, 20, "f2"))
    assert store.watermark("s").offset == 900
    assert store.watermark("unknown") is None


def test_password_never_shown(store_url):
    shown = display_url("postgresql+psycopg://user:s3cret-pw@db.example:5432/logs")
    assert "s3cret-pw" not in shown and shown == "postgresql+psycopg://user:***@db.example:5432/logs"
    url = sa.make_url(store_url)
    s = LogStore(store_url)
    if url.password:  # the PostgreSQL test server has one
        assert url.password not in str(s.stats()) and url.password not in repr(s)
    assert s.stats()["database"] == display_url(store_url)
    s.close()


MESSAGES = st.lists(st.builds(Message, st.sampled_from(["system", "user", "assistant"]), st.text(max_size=8)),
                    min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(a=MESSAGES, b=MESSAGES)
def test_content_hash_is_equal_exactly_for_equal_messages(a, b):
    assert (content_hash(a) == content_hash(b)) == (a == b)
    shifted = [Message(m.role, m.content + "x") for m in a]  # boundaries cannot be moved unnoticed
    assert content_hash(shifted) != content_hash(a)


@settings(max_examples=300, deadline=None)
@given(messages=MESSAGES)
def test_both_hashes_in_one_pass_are_the_two_hashes(messages):
    if any(m.role == "user" for m in messages):
        assert hashes(messages) == (content_hash(messages), prompt_hash(messages))
    else:  # no user turn: the same error as prompt_hash's
        with pytest.raises(StopIteration):
            hashes(messages)


def test_a_checked_batch_stores_and_counts_as_an_unchecked_one(store):
    """`add_batch(checked=True)` (the readers' records) skips only the field checks the readers made."""
    got = []
    for checked, (a, b) in ((False, ("a", "b")), (True, ("c", "d"))):
        records = [conv(a), conv(b), conv(a, location="f:4"), Rejected("f.jsonl", "f:9", "invalid JSON", "{")]
        run = store.begin_run("f.jsonl", "jsonl", 0)
        counts = store.add_batch(run, records, checked=checked)
        run_row = store.finish_run(run)
        got.append(((counts.stored, counts.duplicates, counts.quarantined), (run_row["read"], run_row["stored"])))
    assert got[0] == got[1] == ((2, 1, 1), (4, 2))
