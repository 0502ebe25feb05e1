"""How many conversations a second does `ingest` store, and whose CPU does it spend: the client's or the server's?

    python benchmarks/ingest_rate.py DIR_OR_FILE [--pg-url URL | --sqlite PATH] [--format openai] [--batch-size N]
        [--parse auto|child|here]

Ingests every `.jsonl` / `.jsonl.gz` under DIR (sorted, as `traffic_month.py` writes them) or the one FILE into
a fresh store: a new schema of the PostgreSQL server at `--pg-url` (default $SPECDISTILL_TEST_PG_URL, set by
scripts/with_postgres.sh), dropped afterwards, or a new SQLite file. Prints one JSON line: records read, stored,
seconds, records/s, MB/s (decompressed bytes read), the CPU seconds of the ingesting process, of its parsing
child (when it parsed in one) and, for PostgreSQL, of the server (every process of the cluster, read from /proc:
the server must run on this machine), and the load average over the run. Run it alternately under two
checkouts (PYTHONPATH) to compare code on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import uuid
from pathlib import Path

import sqlalchemy as sa

from specdistill.data.ingest import ingest
from specdistill.data.logstore import LogStore

TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_of(pid: int, children: bool = False) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12]) + (int(fields[13]) + int(fields[14]) if children else 0)
    return ticks / TICKS


def server_cpu(postmaster: int) -> float:
    """CPU seconds of the cluster: the postmaster with its reaped children, and every live child."""
    total = _cpu_of(postmaster, children=True)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
                if f"\nPPid:\t{postmaster}\n" in status:
                    total += _cpu_of(int(entry.name))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return total


def client_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def parser_cpu() -> float:
    """CPU seconds of the child processes that parsed (ingest waits for each: they are counted once it has)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traffic", type=Path)
    parser.add_argument("--pg-url", default=os.environ.get("SPECDISTILL_TEST_PG_URL"))
    parser.add_argument("--sqlite", type=Path, default=None, help="ingest into a new SQLite file here instead")
    parser.add_argument("--format", default="openai")
    parser.add_argument("--batch-size", type=int, default=1000, help="records a transaction (ingest's default: 1000)")
    parser.add_argument("--parse", choices=("auto", "child", "here"), default="auto",
                        help="where records are parsed: a second process (child), this one (here), or as ingest "
                             "decides by the file's size (auto, the default)")
    parser.add_argument("--label", default="", help="a name for this run in the JSON line")
    args = parser.parse_args(argv)
    files = sorted(p for p in args.traffic.rglob("*") if p.name.endswith((".jsonl", ".jsonl.gz"))) \
        if args.traffic.is_dir() else [args.traffic]
    drop = None
    postmaster = None
    if args.sqlite:
        if args.sqlite.exists():
            sys.exit(f"{args.sqlite} exists: give a new path")
        url = f"sqlite:///{args.sqlite}"
    else:
        if not args.pg_url:
            sys.exit("no PostgreSQL URL: pass --pg-url or run under scripts/with_postgres.sh (or pass --sqlite)")
        schema = f"rate_{uuid.uuid4().hex[:8]}"
        admin = sa.create_engine(args.pg_url)
        with admin.begin() as conn:
            conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
            backend = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        postmaster = int(Path(f"/proc/{backend}/status").read_text().split("\nPPid:\t")[1].split()[0])
        url = sa.make_url(args.pg_url).update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(False)

        def drop() -> None:
            with admin.begin() as conn:
                conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
            admin.dispose()

    try:
        store = LogStore(url)
        load0 = os.getloadavg()[0]
        cpu0, parse0 = client_cpu(), parser_cpu()
        srv0, began = server_cpu(postmaster) if postmaster else 0.0, time.perf_counter()
        read = stored = size = 0
        for f in files:
            r = ingest(f, args.format, store, batch_size=args.batch_size, progress=False,
                       parse_in_child={"auto": None, "child": True, "here": False}[args.parse])
            read, stored, size = read + r.read, stored + r.stored, size + r.end_offset - r.start_offset
        seconds = time.perf_counter() - began
        cpu, srv = client_cpu() - cpu0, (server_cpu(postmaster) - srv0) if postmaster else None
        parse_cpu = parser_cpu() - parse0
        load1 = os.getloadavg()[0]
        store.close()
    finally:
        if drop:
            drop()
    print(json.dumps({
        "label": args.label, "batch_size": args.batch_size, "parse": args.parse,
        "backend": "sqlite" if args.sqlite else "postgresql", "files": len(files),
        "read": read, "stored": stored, "seconds": round(seconds, 2), "records/s": round(read / seconds),
        "MB/s": round(size / 1e6 / seconds, 2), "client_cpu_s": round(cpu, 2), "parser_cpu_s": round(parse_cpu, 2),
        "server_cpu_s": None if srv is None else round(srv, 2), "load": [round(load0, 2), round(load1, 2)]}))


if __name__ == "__main__":
    main()
