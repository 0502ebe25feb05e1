"""The log store: production conversations, the target's own responses, quarantine, watermarks.

SQLite under `$SPECDISTILL_HOME/logs.db` by default; any SQLAlchemy URL (PostgreSQL through
psycopg: `postgresql+psycopg://user:pw@host/db`) through `url=` or `$SPECDISTILL_LOG_DB`. The
schema is created and upgraded only by the versioned migrations in `specdistill/data/migrations/`
(Alembic); `LogStore(...)` brings a database to the newest version under a lock, so two processes
opening a fresh database do not race.

A conversation is stored once per content hash (the normalized messages), whichever file it came
from. Its split is fixed by the hash of its prompt (the turns up to the first user turn), so
every multi-turn continuation of one opening prompt lands on the same side, and re-ingesting never
moves a conversation between train and eval.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from specdistill import paths
from specdistill.data.batch import PreparedBatch, prepare_batch
from specdistill.data.identity import (  # noqa: F401  (the log store's public names)
    DEFAULT_EVAL_FRACTION,
    content_hash,
    prompt_hash,
)
from specdistill.data.logschema import (
    LogStoreError,
    UTCDateTime,
    _revision,
    acceptance_samples,
    conversations,
    database_error,
    display_url,
    ingest_runs,
    make_engine,
    quarantine,
    responses,
    upgrade,
    watermarks,
    writing,
)
from specdistill.data.logstore_records import PipelineRecords, _now
from specdistill.data.logstore_retention import Retention
from specdistill.data.logstore_sql import insert_new, sample_key
from specdistill.data.readers import Conversation, Message, Rejected


@dataclass
class StoredConversation:
    id: int
    messages: list[Message]
    split: str
    source: str
    location: str
    record_id: str | None
    target_version: str | None
    arrived_at: datetime
    content_hash: str
    request_temperature: float | None = None  # what the logged request asked for (OpenAI logs)


@dataclass
class BatchCounts:
    stored: int = 0
    duplicates: int = 0
    quarantined: int = 0


@dataclass
class Watermark:
    source: str
    format: str
    offset: int
    index: int  # line / element number at `offset` (what RecordReader takes as start_index)
    fingerprint: str


class LogStore(PipelineRecords, Retention):
    """Conversations in, windows out; the pipeline's own records come from `PipelineRecords`."""

    def __init__(self, url: str | None = None, eval_fraction: float = DEFAULT_EVAL_FRACTION, *,
                 create: bool = True) -> None:
        """`create=False` (read commands): a SQLite file that does not exist is an error, not a new store."""
        self.url = url or os.environ.get("SPECDISTILL_LOG_DB") or f"sqlite:///{paths.ensure(paths.home()) / 'logs.db'}"
        self.eval_fraction = eval_fraction
        self.engine = make_engine(self.url, create=create)
        try:
            upgrade(self.engine)
        except sa.exc.DBAPIError as exc:  # unreachable server, bad credentials, a file that is no database
            self.engine.dispose()
            raise LogStoreError(f"cannot open {database_error(self.url, exc)}") from None
        except LogStoreError as exc:  # the migrations' write refused (a read-only file)
            self.engine.dispose()
            raise LogStoreError(f"cannot open {exc}") from None

    def __repr__(self) -> str:
        return f"LogStore({display_url(self.url)!r})"

    @property
    def display_url(self) -> str:
        return display_url(self.url)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> LogStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- ingestion ---------------------------------------------------------------------------

    def begin_run(self, source: str, fmt: str, start_offset: int, note: str | None = None) -> int:
        with writing(self.engine) as conn:
            return conn.execute(
                ingest_runs.insert().returning(ingest_runs.c.id),
                dict(source=source, format=fmt, status="running", started_at=_now(), start_offset=start_offset,
                     end_offset=start_offset, read=0, stored=0, duplicates=0, quarantined=0, note=note),
            ).scalar_one()

    def add_batch(
        self, run_id: int, records: Sequence[Conversation | Rejected], watermark: Watermark | None = None,
        *, checked: bool = False,
    ) -> BatchCounts:
        """Store one batch, count it on its run and move the watermark, in one transaction. `checked`: the
        conversations come from the readers, which checked their fields where they parsed them (a
        conversation built in code is checked here, and quarantined when a field is one no backend holds)."""
        return self.write_batch(run_id, prepare_batch(records, eval_fraction=self.eval_fraction, is_checked=checked),
                                watermark)

    def write_batch(self, run_id: int, batch: PreparedBatch, watermark: Watermark | None = None) -> BatchCounts:
        """The writing half of `add_batch`: a batch prepared elsewhere (by the process that parsed it) is
        stored, counted on its run and moves the watermark, in one transaction."""
        counts = BatchCounts(duplicates=batch.duplicates, quarantined=batch.quarantined)
        with writing(self.engine) as conn:
            if batch.rows:
                for row in batch.rows:
                    row["ingest_run_id"] = run_id
                counts.stored = insert_new(conn, batch.rows)
                counts.duplicates += len(batch.rows) - counts.stored
            if batch.quarantine:
                stmt = self._insert(quarantine).on_conflict_do_nothing(
                    index_elements=["source", "location", "raw_hash"])
                conn.execute(stmt, [{**row, "ingest_run_id": run_id} for row in batch.quarantine])
            values: dict[str, Any] = dict(
                read=ingest_runs.c.read + batch.read,
                stored=ingest_runs.c.stored + counts.stored,
                duplicates=ingest_runs.c.duplicates + counts.duplicates,
                quarantined=ingest_runs.c.quarantined + counts.quarantined)
            if watermark is not None:
                values["end_offset"] = watermark.offset
                self._set_watermark(conn, watermark, _now())
            conn.execute(ingest_runs.update().where(ingest_runs.c.id == run_id).values(**values))
        return counts

    def _set_watermark(self, conn: Connection, wm: Watermark, now: datetime) -> None:
        row = dict(source=wm.source, format=wm.format, byte_offset=wm.offset, record_index=wm.index,
                   fingerprint=wm.fingerprint, updated_at=now)
        stmt = self._insert(watermarks).values(**row)
        # A concurrent ingest of the same source may be further along: the watermark never moves back.
        further = stmt.excluded.byte_offset >= watermarks.c.byte_offset
        stmt = stmt.on_conflict_do_update(
            index_elements=["source"],
            set_={k: sa.case((further, getattr(stmt.excluded, k)), else_=getattr(watermarks.c, k))
                  for k in ("format", "byte_offset", "record_index", "fingerprint", "updated_at")})
        conn.execute(stmt)

    def finish_run(self, run_id: int, truncated_at: int | None = None, truncated_bytes: int | None = None) -> dict:
        with writing(self.engine) as conn:  # the run as closed, read back by the same statement (one round trip)
            return dict(conn.execute(ingest_runs.update().where(ingest_runs.c.id == run_id).values(
                status="done", finished_at=_now(), truncated_at=truncated_at, truncated_bytes=truncated_bytes,
            ).returning(*ingest_runs.c)).mappings().one())

    def fail_run(self, run_id: int, why: str, status: str = "failed") -> None:
        """Close a run that stopped early (an error, an interrupt): its batches stay committed and
        counted, and the next run goes on from its watermark; no run is left `running`."""
        with writing(self.engine) as conn:
            note = sa.func.coalesce(ingest_runs.c.note + "; ", "") + why
            conn.execute(ingest_runs.update().where(ingest_runs.c.id == run_id).values(
                status=status, finished_at=_now(), note=note))

    def run(self, run_id: int) -> dict:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(ingest_runs).where(ingest_runs.c.id == run_id)).mappings().one()
        return dict(row)

    def watermark(self, source: str) -> Watermark | None:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(watermarks).where(watermarks.c.source == source)).mappings().first()
        if row is None:
            return None
        return Watermark(row["source"], row["format"], row["byte_offset"], row["record_index"], row["fingerprint"])

    # -- windows -----------------------------------------------------------------------------

    def _where(self, since=None, until=None, source=None, split=None, target_version=None) -> list:
        c = conversations.c
        clauses = []
        if since is not None:
            clauses.append(c.arrived_at >= since)
        if until is not None:
            clauses.append(c.arrived_at < until)
        if source is not None:
            clauses.append(c.source == source)
        if split is not None:
            if split not in ("train", "eval"):
                raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
            clauses.append(c.split == split)
        if target_version is not None:
            clauses.append(c.target_version == target_version)
        return clauses

    def window(
        self,
        since: datetime | None = None,
        until: datetime | None = None,
        *,
        source: str | None = None,
        split: str | None = None,
        target_version: str | None = None,
        limit: int | None = None,
        newest_first: bool = True,
    ) -> list[StoredConversation]:
        """Conversations that arrived in [since, until), filtered; the recent-traffic window."""
        c = conversations.c
        order = (c.arrived_at.desc(), c.id.desc()) if newest_first else (c.arrived_at, c.id)
        query = sa.select(conversations).where(*self._where(since, until, source, split, target_version))
        query = query.order_by(*order).limit(limit)
        with self.engine.connect() as conn:
            return [_stored(row) for row in conn.execute(query).mappings()]

    def count(self, **filters: Any) -> int:
        query = sa.select(sa.func.count()).select_from(conversations).where(*self._where(**filters))
        with self.engine.connect() as conn:
            return conn.execute(query).scalar_one()

    def sample(self, n: int, seed: int = 0, **filters: Any) -> list[StoredConversation]:
        """A reproducible random sample of a window, in random order: its first k are a sample too, which is
        how the nightly and the monitor take the usable prompts they need from it. (Sorted by id, the first k
        were the oldest of it: every seed's window drew on the oldest quarter of the traffic, and the demo's
        nights answered the same prompts again: 300-660 of each two nights' 1,000-2,000 answers.)

        Drawn in SQL, so its memory is the sample's and its time the window's (reading every id of a window
        into Python cost seconds and gigabytes at tens of millions): the window's conversations ordered by a
        keyed hash of their id (`logstore_sql.sample_key`: three multiply-xor rounds modulo a prime, keys from the seed),
        the first `n`. Each conversation is in it with about the same probability n/N for a random seed, two
        seeds overlap as two independent samples do, and `sample(k, seed)` is the first k of `sample(n, seed)`."""
        c = conversations.c
        query = sa.select(c.id).where(*self._where(**filters)).order_by(sample_key(c.id, seed), c.id).limit(max(n, 0))
        with self.engine.connect() as conn:
            ids = conn.execute(query).scalars().all()
        return self.by_ids(ids)

    def sources(self) -> list[str]:
        """The sources the store holds conversations of, in order: a walk down the source index, one
        lookup per source (a loose index scan), not a scan of every conversation."""
        walk = sa.text("WITH RECURSIVE s(source) AS (SELECT min(source) FROM conversations UNION ALL "
                       "SELECT (SELECT min(source) FROM conversations WHERE source > s.source) FROM s "
                       "WHERE s.source IS NOT NULL) SELECT source FROM s WHERE source IS NOT NULL")
        with self.engine.connect() as conn:
            return list(conn.execute(walk).scalars())

    def by_ids(self, ids: Iterable[int]) -> list[StoredConversation]:
        """Conversations by id, in the order asked (a window chosen earlier, read again)."""
        ids = list(ids)
        found: dict[int, StoredConversation] = {}
        with self.engine.connect() as conn:
            for start in range(0, len(ids), 500):
                part = ids[start : start + 500]
                for row in conn.execute(sa.select(conversations).where(conversations.c.id.in_(part))).mappings():
                    found[row["id"]] = _stored(row)
        missing = [i for i in ids if i not in found]
        if missing:
            raise KeyError(f"conversations not in the log store: {missing[:10]}")
        return [found[i] for i in ids]

    def export_answered(self, ids: Iterable[int], path: str | Path) -> int:
        """The conversations among `ids` that carry a human-written answer, as JSONL `{"id",
        "messages"}` written atomically (the generic baseline's training data). Returns how many;
        none writes nothing."""
        answered = [row for row in self.by_ids(ids) if any(m.role == "assistant" for m in row.messages)]
        if answered:
            tmp = Path(path).with_suffix(".tmp")
            with paths.open_private(tmp, "w", encoding="utf-8") as f:  # production traffic: the owner only
                for row in answered:
                    messages = [{"role": m.role, "content": m.content} for m in row.messages]
                    f.write(json.dumps({"id": str(row.id), "messages": messages}, ensure_ascii=False) + "\n")
            tmp.replace(path)
        return len(answered)

    # -- reports -----------------------------------------------------------------------------

    def stats(self) -> dict:
        c = conversations.c
        with self.engine.connect() as conn:
            def scalar(q):
                return conn.execute(q).scalar_one()

            by_split = dict(conn.execute(sa.select(c.split, sa.func.count()).group_by(c.split)).all())
            by_source = [
                {"source": s, "conversations": n, "first_arrival": lo, "last_arrival": hi}
                for s, n, lo, hi in conn.execute(
                    sa.select(c.source, sa.func.count(), sa.func.min(c.arrived_at, type_=UTCDateTime()),
                              sa.func.max(c.arrived_at, type_=UTCDateTime()))
                    .group_by(c.source).order_by(c.source))
            ]
            runs = sa.select(sa.func.coalesce(sa.func.sum(ingest_runs.c.read), 0),
                             sa.func.coalesce(sa.func.sum(ingest_runs.c.stored), 0),
                             sa.func.coalesce(sa.func.sum(ingest_runs.c.duplicates), 0),
                             sa.func.coalesce(sa.func.sum(ingest_runs.c.quarantined), 0))
            read, stored, dups, quar = conn.execute(runs).one()
            return {
                "database": self.display_url,
                "schema_revision": _revision(conn),
                "conversations": scalar(sa.select(sa.func.count()).select_from(conversations)),
                "by_split": {"train": by_split.get("train", 0), "eval": by_split.get("eval", 0)},
                "by_source": by_source,
                "target_versions": dict(conn.execute(
                    sa.select(sa.func.coalesce(c.target_version, "unknown"), sa.func.count())
                    .group_by(c.target_version)).all()),
                "responses": scalar(sa.select(sa.func.count()).select_from(responses)),
                "quarantined": scalar(sa.select(sa.func.count()).select_from(quarantine)),
                "acceptance_samples": scalar(sa.select(sa.func.count()).select_from(acceptance_samples)),
                "ingest_runs": scalar(sa.select(sa.func.count()).select_from(ingest_runs)),
                "ingested": {"read": int(read), "stored": int(stored), "duplicates": int(dups),
                             "quarantined": int(quar)},
            }

    def count_quarantined(self, source: str | None = None) -> int:
        query = sa.select(sa.func.count()).select_from(quarantine)
        if source is not None:
            query = query.where(quarantine.c.source == source)
        with self.engine.connect() as conn:
            return conn.execute(query).scalar_one()

    def quarantined(self, source: str | None = None, limit: int | None = 100) -> list[dict]:
        q = quarantine.c
        query = sa.select(q.id, q.source, q.location, q.reason, q.raw, q.created_at).order_by(q.id).limit(limit)
        if source is not None:
            query = query.where(q.source == source)
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(query).mappings()]


def _stored(row) -> StoredConversation:
    return StoredConversation(
        id=row["id"], messages=[Message(m["role"], m["content"]) for m in json.loads(row["messages"])],
        split=row["split"], source=row["source"], location=row["location"], record_id=row["record_id"],
        target_version=row["target_version"], arrived_at=row["arrived_at"], content_hash=row["content_hash"],
        request_temperature=row.get("request_temperature"))
