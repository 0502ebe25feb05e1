"""The log store as it grows: windows are sampled and counted in SQL, with the window's cost, not the store's."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdistill.data.logstore import LogStore
from specdistill.data.readers import Conversation, Message


@pytest.fixture
def store(store_url):
    s = LogStore(store_url)
    yield s
    s.close()


def fill(store: LogStore, n: int, source: str = "src", start: int = 0) -> None:
    run = store.begin_run(source, "jsonl", 0)
    store.add_batch(run, [Conversation([Message("user", f"{source} prompt {i}"), Message("assistant", "a")], source,
                                       f"f:{i}", timestamp=1_700_000_000 + i) for i in range(start, start + n)])


def statements(store: LogStore) -> list[str]:
    seen: list[str] = []
    sa.event.listen(store.engine, "before_cursor_execute", lambda conn, cur, stmt, *a: seen.append(stmt))
    return seen


def test_a_sample_reads_the_sample_not_every_id_of_its_window(store):
    fill(store, 300)
    seen = statements(store)
    rows = store.sample(10, seed=1)
    assert len(rows) == 10
    picks = [s for s in seen if "FROM conversations" in s]
    # the ids come from one ordered, limited query; then the ten rows by id
    assert picks and all("LIMIT" in s or " IN (" in s for s in picks), picks


def test_a_split_s_window_is_read_through_its_index_not_every_conversation_of_the_split(tmp_path):
    """SQLite without statistics took the index on split alone (two values) for the nightly's window sample and
    read every train conversation of the store: 7.6 s at 2M. Migration 0005's (split, arrived_at) reads the day."""
    from datetime import datetime, timezone

    with LogStore(f"sqlite:///{tmp_path / 'logs.db'}") as store:
        fill(store, 50)
        split = store.by_ids([1])[0].split
        seen: list[tuple] = []
        sa.event.listen(store.engine, "before_cursor_execute", lambda conn, cur, stmt, params, *a: seen.append((stmt, params)))
        since = datetime.fromtimestamp(1_700_000_040, tz=timezone.utc)
        rows = store.sample(5, seed=0, split=split, since=since)
        assert rows and all(r.arrived_at >= since for r in rows)
        query, params = next((stmt, params) for stmt, params in seen if "LIMIT" in stmt)
        with store.engine.connect() as conn:
            plan = " ".join(str(r) for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + query, params))
    assert "ix_conversations_split_arrived (split=? AND arrived_at>?)" in plan, plan


def test_a_sample_is_uniform_over_its_window_and_seeds_are_independent(tmp_path):
    with LogStore(f"sqlite:///{tmp_path / 'logs.db'}") as store:
        fill(store, 60)
        seen = {c.id: 0 for c in store.window()}
        overlap = 0
        previous: set[int] = set()
        for seed in range(300):
            picked = {c.id for c in store.sample(15, seed=seed)}
            for i in picked:
                seen[i] += 1
            overlap += len(picked & previous)
            previous = picked
    shares = [k / 300 for k in seen.values()]
    assert min(shares) > 0.1 and max(shares) < 0.42  # each conversation in about n/N = 0.25 of the samples
    assert 2.5 < overlap / 299 < 5.0  # two seeds share about n^2/N = 3.75, as independent samples do


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(0, 50), k=st.integers(0, 50), seed=st.integers(0, 10**6))
def test_a_sample_is_a_reproducible_prefix_closed_subset_of_its_window(tmp_path_factory, n, k, seed):
    path = tmp_path_factory.mktemp("s") / "logs.db"
    with LogStore(f"sqlite:///{path}") as store:
        fill(store, 30, "a")
        fill(store, 10, "b")
        window = {c.id for c in store.window(source="a", since=None)}
        rows = [c.id for c in store.sample(n, seed=seed, source="a")]
        assert len(rows) == len(set(rows)) == min(n, 30) and set(rows) <= window
        assert [c.id for c in store.sample(n, seed=seed, source="a")] == rows
        assert [c.id for c in store.sample(min(k, n), seed=seed, source="a")] == rows[: min(k, n)]


def test_sources_walk_the_index(store):
    assert store.sources() == []
    fill(store, 5, "b")
    fill(store, 3, "a")
    fill(store, 2, "c")
    assert store.sources() == ["a", "b", "c"]


def test_the_monitor_s_prompt_sample_reads_no_store_wide_statistics(store, monkeypatch):
    from specdistill.data.prompts import prompts_from_logs

    fill(store, 20)
    monkeypatch.setattr(LogStore, "stats", lambda self: pytest.fail("stats() scans the whole store"))

    class Tok:
        chat_template = None

        def __call__(self, text):
            return {"input_ids": list(range(len(text.split())))}

    prompts = prompts_from_logs(store, Tok(), "train", 4, seed=0)
    assert len(prompts) == 4 or store.count(split="train") < 4


@pytest.mark.parametrize("in_child", [False, True], ids=["parsed-here", "parsed-in-child"])
def test_ingest_keeps_running_while_the_nightly_s_window_and_sample_stages_read(store_url, tmp_path, in_child):
    """Ingestion takes no state lock: a nightly's window and sample stages and the monitor's prompt sample read
    the same store meanwhile (SQLite in WAL mode; PostgreSQL), and nothing is locked out, lost or doubled,
    whether the file is parsed in the writer or (a big file) in a child beside it."""
    import json
    import threading

    from specdistill.data.ingest import ingest
    from specdistill.data.prompts import prompts_from_logs

    path = tmp_path / "traffic.jsonl"
    lines = [json.dumps({"prompt": f"question {i}", "response": f"answer {i}"}) for i in range(1500)]
    lines[::97] = ["{not json"] * len(lines[::97])
    lines += lines[:200]  # a replayed hour: duplicates
    path.write_text("\n".join(lines) + "\n")

    class Tok:
        chat_template = None

        def __call__(self, text):
            return {"input_ids": [1] * len(text.split())}

    done, errors, reads = threading.Event(), [], {"n": 0}

    def read() -> None:
        with LogStore(store_url) as reader:
            while not done.is_set():
                try:
                    n = reader.count(split="train")
                    rows = reader.sample(50, seed=reads["n"], split="train")  # the window stage
                    assert len(rows) == min(50, n) or reader.count(split="train") > n
                    again = reader.by_ids([r.id for r in rows])  # a later stage reads the same ids back
                    assert [r.content_hash for r in again] == [r.content_hash for r in rows]
                    prompts_from_logs(reader, Tok(), "train", 8, seed=1)  # the monitor's sample
                    reads["n"] += 1
                except Exception as exc:  # noqa: BLE001 (reported by the main thread)
                    errors.append(exc)
                    return

    with LogStore(store_url) as writer:
        readers = [threading.Thread(target=read) for _ in range(2)]
        for t in readers:
            t.start()
        try:
            result = ingest(path, "jsonl", writer, batch_size=40, progress=False, parse_in_child=in_child)
        finally:
            done.set()
            for t in readers:
                t.join()
        assert not errors, errors
        assert reads["n"] >= 2  # the readers really ran beside it
        assert (result.read, result.quarantined) == (1700, len(lines[:1500][::97]) + len(lines[:200][::97]))
        assert result.read == result.stored + result.duplicates + result.quarantined
        assert writer.count() == result.stored == 1500 - len(lines[:1500][::97])
        assert ingest(path, "jsonl", writer, progress=False).read == 0  # the watermark is at the end
