"""The log store's two statements that are written per dialect or by hand: a batch's bulk insert and the
seeded sampling key (`LogStore.add_batch`, `LogStore.sample`)."""

from __future__ import annotations

import random

import sqlalchemy as sa
import sqlalchemy.dialects.sqlite
from sqlalchemy.engine import Connection

from specdistill.data.logschema import conversations

_STAGING = "specdistill_incoming"  # PostgreSQL: a session's temporary table a batch is copied into
_COLUMNS = [col.name for col in conversations.c if col.name != "id"]


def insert_new(conn: Connection, rows: list[dict]) -> int:
    """Insert the conversations not stored yet (by content hash); returns how many were. PostgreSQL: COPY into
    a temporary table and one INSERT .. SELECT .. ON CONFLICT DO NOTHING (a multi-row INSERT cost more in the
    driver building its SQL than the server took to run it); SQLite: the driver's executemany, counted by
    its row count. Neither returns rows."""
    if conn.dialect.name == "postgresql":
        names = ", ".join(f'"{c}"' for c in _COLUMNS)
        cur = conn.connection.driver_connection.cursor()
        try:
            cur.execute(f"CREATE TEMPORARY TABLE IF NOT EXISTS {_STAGING} ON COMMIT DELETE ROWS AS "
                        f"SELECT {names} FROM conversations WITH NO DATA")
            with cur.copy(f"COPY {_STAGING} ({names}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row([row[c] for c in _COLUMNS])
            cur.execute(f"INSERT INTO conversations ({names}) SELECT {names} FROM {_STAGING} ORDER BY content_hash "
                        "ON CONFLICT (content_hash) DO NOTHING")
            return cur.rowcount  # the staged rows go at commit (ON COMMIT DELETE ROWS)
        finally:
            cur.close()
    stmt = sa.dialects.sqlite.insert(conversations).on_conflict_do_nothing(index_elements=["content_hash"])
    return conn.execute(stmt, rows).rowcount


_SAMPLE_PRIME = 2_147_483_647  # 2^31 - 1: every product below stays under 2^62, in SQLite's and PostgreSQL's integers


def sample_key(column, seed: int):
    """A seeded hash of an integer column in portable SQL (SQLite has no hash function): three rounds of
    x -> ((x * a + b) mod p) xor c with a, b, c drawn from `seed`."""
    rng = random.Random(f"specdistill-sample:{seed}")
    x = column % sa.literal_column(str(_SAMPLE_PRIME))
    for _ in range(3):
        a, b, c = (sa.literal_column(str(rng.randrange(1, _SAMPLE_PRIME))) for _ in range(3))
        x = (x * a + b) % sa.literal_column(str(_SAMPLE_PRIME))
        x = x.bitwise_or(c) - x.bitwise_and(c)  # xor, which SQLite spells no other way
    return x
