"""How fast does the whole shipped ShareGPT file ingest into fresh log stores (SQLite, and PostgreSQL)?

    python benchmarks/ingest_sharegpt.py [--pg-url URL] [--repeats N] [--batch-size N]

Rows: streaming the file through the reader only, then a full ingest into a fresh SQLite store,
and into a fresh PostgreSQL schema when a URL is given (or $SPECDISTILL_TEST_PG_URL is set, e.g.
under scripts/with_postgres.sh). Backends run interleaved; times are medians of the repeats, and
the last column is each row's time relative to the reader alone, measured in the same process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import sqlalchemy as sa

from specdistill.data.datasets import sharegpt_path
from specdistill.data.ingest import ingest
from specdistill.data.logstore import LogStore, display_url
from specdistill.data.readers import read_records


def read_only(path: Path) -> dict:
    began = time.perf_counter()
    reader = read_records(path, "sharegpt")
    n = sum(1 for _ in reader)
    t = reader.truncation
    return {"seconds": time.perf_counter() - began, "read": n, "stored": "-", "duplicates": "-",
            "quarantined": "-", "truncated": t.location if t else None}


def ingest_into(url: str, path: Path, batch_size: int) -> dict:
    store = LogStore(url)
    result = ingest(path, "sharegpt", store, batch_size=batch_size, progress=False)
    store.close()
    return {"seconds": result.seconds, "read": result.read, "stored": result.stored,
            "duplicates": result.duplicates, "quarantined": result.quarantined,
            "truncated": result.truncation["location"] if result.truncation else None}


def fresh_pg_schema(base: str) -> tuple[str, callable]:
    schema = f"bench_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(base)
    with admin.begin() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {schema}"))

    def drop() -> None:
        with admin.begin() as conn:
            conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()

    url = sa.make_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
    return url.render_as_string(hide_password=False), drop


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pg-url", default=os.environ.get("SPECDISTILL_TEST_PG_URL"))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=1000)
    args = parser.parse_args(argv)

    path = sharegpt_path()
    size_mb = path.stat().st_size / 1e6
    rows: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            rows.setdefault("reader only", []).append(read_only(path))
            url = f"sqlite:///{Path(tmp) / f'logs{rep}.db'}"
            rows.setdefault("ingest -> SQLite", []).append(ingest_into(url, path, args.batch_size))
            if args.pg_url:
                url, drop = fresh_pg_schema(args.pg_url)
                try:
                    rows.setdefault("ingest -> PostgreSQL", []).append(ingest_into(url, path, args.batch_size))
                finally:
                    drop()

    print(f"file: {path.name} ({size_mb:.1f} MB), batch size {args.batch_size}, repeats {args.repeats}")
    if args.pg_url:
        print(f"PostgreSQL: {display_url(args.pg_url)}")
    header = (f"{'what':<22}{'seconds':>9}{'records/s':>11}{'MB/s':>7}{'read':>7}{'stored':>8}{'dups':>6}{'quar.':>7}"
              f"{'x reader':>10}  truncated")
    print(header)
    print("-" * len(header))
    base = statistics.median(r["seconds"] for r in rows["reader only"])
    for name, runs in rows.items():
        sec = statistics.median(r["seconds"] for r in runs)
        last = runs[-1]
        print(f"{name:<22}{sec:>9.1f}{last['read'] / sec:>11.0f}{size_mb / sec:>7.1f}{last['read']:>7}"
              f"{last['stored']:>8}{last['duplicates']:>6}{last['quarantined']:>7}{sec / base:>10.2f}  {last['truncated']}")


if __name__ == "__main__":
    main()
