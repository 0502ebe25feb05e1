"""Production traffic leaves the log store: retention (`prune_before`) and one user's or one file's
conversations forgotten (`forget`). A base of `LogStore`, beside `PipelineRecords`.

Set-based deletes in chunks of `CHUNK` rows (a window of the arrival index each), so a month of a busy
service leaves without one transaction holding SQLite's write lock for minutes while ingestion waits,
and with PostgreSQL doing the work (no row is read into Python). Not partitions by day on PostgreSQL:
a conversation is unique by its content hash across days, which a partitioned table cannot enforce
unless the day is part of the key.

What must stay (the ids a registered draft's held-out prompts and training window name) is passed in
as `keep` and staged in a temporary table. Forgotten content is overwritten, not only unlinked: SQLite
deletes with `secure_delete` and truncates its write-ahead log afterwards; PostgreSQL vacuums the tables.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from specdistill.data.logschema import acceptance_samples, conversations, quarantine, responses, writing

CHUNK = 50_000
_KEEP = "specdistill_keep"


class Retention:
    engine: sa.Engine

    def _stage_keep(self, conn: Connection, keep: Iterable[int]) -> sa.Table:
        table = sa.Table(_KEEP, sa.MetaData(), sa.Column("id", sa.BigInteger, primary_key=True), prefixes=["TEMPORARY"])
        table.create(conn, checkfirst=True)
        conn.execute(table.delete())
        ids = sorted(set(keep))
        for start in range(0, len(ids), 10_000):
            conn.execute(table.insert(), [{"id": i} for i in ids[start : start + 10_000]])
        return table

    def _delete_conversations(self, conn: Connection, chosen: sa.Select) -> int:
        """Delete the conversations whose ids `chosen` selects (at most CHUNK), with what refers to them."""
        ids = chosen.scalar_subquery()
        if conn.dialect.name == "sqlite":
            conn.exec_driver_sql("PRAGMA secure_delete=ON")  # the freed pages are zeroed, not left readable
        conn.execute(responses.delete().where(responses.c.conversation_id.in_(ids)))
        conn.execute(acceptance_samples.update().where(acceptance_samples.c.conversation_id.in_(ids))
                     .values(conversation_id=None))  # a sample's counts stay; its link to the text goes
        return conn.execute(conversations.delete().where(conversations.c.id.in_(ids))).rowcount

    def prune_before(self, cutoff: datetime, keep: Iterable[int] = ()) -> dict:
        """Delete conversations that arrived before `cutoff` (their target responses with them) but those in
        `keep`, and quarantine rows created before it. Returns counts by kind and how many were kept."""
        c = conversations.c
        removed = {"conversations": 0, "quarantine": 0}
        keep = list(keep)
        while True:
            with writing(self.engine) as conn:
                kept = self._stage_keep(conn, keep)
                old = sa.select(c.id).where(c.arrived_at < cutoff, ~sa.exists().where(kept.c.id == c.id)).limit(CHUNK)
                n = self._delete_conversations(conn, old)
            removed["conversations"] += n
            if n < CHUNK:
                break
        q = quarantine.c
        while True:
            with writing(self.engine) as conn:
                n = conn.execute(quarantine.delete().where(
                    q.id.in_(sa.select(q.id).where(q.created_at < cutoff).limit(CHUNK).scalar_subquery()))).rowcount
            removed["quarantine"] += n
            if n < CHUNK:
                break
        with self.engine.connect() as conn:
            removed["kept"] = conn.execute(sa.select(sa.func.count()).select_from(conversations)
                                           .where(c.arrived_at < cutoff)).scalar_one()
        self._scrub()
        return removed

    def forget(self, *, ids: Iterable[int] = (), user: str | None = None, source: str | None = None) -> list[int]:
        """Delete the conversations with these ids, of this logged user or from this source, with their target
        responses, and the quarantined records of that source (or that carry the user's id); returns the
        conversation ids deleted, sorted. Deleting what is gone already deletes nothing."""
        c, q = conversations.c, quarantine.c
        match = []
        ids = [int(i) for i in ids]
        if ids:
            match.append(c.id.in_(ids))
        if user is not None:
            match.append(c.user == user)
        if source is not None:
            match.append(c.source == source)
        if not match:
            raise ValueError("forget what: give conversation ids, a user or a source")
        gone: list[int] = []
        with writing(self.engine) as conn:
            gone = sorted(conn.execute(sa.select(c.id).where(sa.or_(*match))).scalars())
            for start in range(0, len(gone), 10_000):
                self._delete_conversations(conn, sa.select(c.id).where(c.id.in_(gone[start : start + 10_000])))
            bad = []
            if source is not None:
                bad.append(q.source == source)
            if user is not None:  # a malformed line of the user's: its raw text names the user
                bad.append(q.raw.contains(f'"user": "{user}"', autoescape=True))
                bad.append(q.raw.contains(f'"user":"{user}"', autoescape=True))
            if bad:
                conn.execute(quarantine.delete().where(sa.or_(*bad)))
        self._scrub()
        return gone

    def _scrub(self) -> None:
        """What was deleted leaves the files too: SQLite's freed pages zeroed (secure_delete) and the
        write-ahead log, which still holds the old pages, truncated; PostgreSQL's dead rows vacuumed."""
        if self.engine.dialect.name == "sqlite":
            with self.engine.connect() as conn:
                conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
        else:
            with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                for table in ("responses", "quarantine", "conversations"):
                    conn.exec_driver_sql(f"VACUUM {table}")
