"""`specdistill ingest` and `specdistill logs stats|quarantine`: traffic into the log store, and what it holds."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdistill import bounds
from specdistill.cli.common import Subcommands, add_db, command, count_in, emit, group, log_store, printable


def cmd_ingest(args: argparse.Namespace) -> int:
    from specdistill.data.ingest import ingest  # lazy: CLI start-up

    with log_store(args, create=True) as store:
        result = ingest(args.path, args.format, store, batch_size=args.batch_size, source=args.source,
                        progress=not args.no_progress, max_decompressed_bytes=args.max_decompressed_bytes)
    emit(args, result.to_dict(), result.render())
    if result.corrupt:  # what was read is stored and counted; the file itself is an error
        print(printable(f"specdistill: error: {result.corrupt}"), file=sys.stderr)
        return 2
    return 0


def cmd_logs_stats(args: argparse.Namespace) -> int:
    with log_store(args) as store:
        stats = store.stats()
    lines = [f"log store {stats['database']} (schema {stats['schema_revision']})",
             f"conversations: {stats['conversations']} (train {stats['by_split']['train']}, "
             f"eval {stats['by_split']['eval']}); target responses: {stats['responses']}; "
             f"quarantined: {stats['quarantined']}; acceptance samples: {stats['acceptance_samples']}",
             "ingested (all runs): read {read} = stored {stored} + duplicates {duplicates} + "
             "quarantined {quarantined}".format(**stats["ingested"])]
    lines += [f"  {s['conversations']:>8}  {s['source']}  ({s['first_arrival']} .. {s['last_arrival']})"
              for s in stats["by_source"]]
    emit(args, stats, "\n".join(lines))
    return 0


def cmd_logs_quarantine(args: argparse.Namespace) -> int:
    with log_store(args) as store:
        rows = store.quarantined(source=args.source, limit=args.limit)
        total = store.count_quarantined(source=args.source)
    text = "\n".join(f"{r['location']}: {r['reason']}\n    {r['raw'][:160]!r}" for r in rows) or "quarantine is empty"
    if total > len(rows):
        text += f"\n({len(rows)} of {total} shown; --limit N for more)"
    emit(args, {"records": rows, "shown": len(rows), "total": total}, text)
    return 0


def cmd_logs_prune(args: argparse.Namespace) -> int:
    from specdistill.pipeline import retention  # lazy: CLI start-up

    report = retention.prune(retention.parse_age(args.older_than), log_db=args.db, force=args.force)
    emit(args, vars(report), report.render())
    return 0


def cmd_logs_forget(args: argparse.Namespace) -> int:
    from specdistill.pipeline import retention  # lazy: CLI start-up

    if not (args.id or args.user or args.source):
        print("specdistill: error: logs forget needs --id, --user or --source", file=sys.stderr)
        return 2
    source = str(Path(args.source).resolve()) if args.source and Path(args.source).exists() else args.source
    report = retention.forget(ids=args.id or [], user=args.user, source=source, log_db=args.db)
    emit(args, vars(report), report.render())
    return 0


def register(sub: Subcommands) -> None:
    p = command(sub, "ingest", cmd_ingest, "ingest a traffic file into the log store (idempotent, incremental)",
                example="ingest traffic.jsonl --format sharegpt --source prod-2026-11-29")
    p.add_argument("path")
    p.add_argument("--format", required=True, choices=["sharegpt", "openai", "jsonl", "humaneval"])
    add_db(p)
    p.add_argument("--source", default=None, help="source name (default: the file's absolute path)")
    p.add_argument("--batch-size", type=count_in(bounds.MAX_BATCH), default=1000, help="records per transaction")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--max-decompressed-bytes", type=count_in(bounds.MAX_BYTES), default=None, metavar="N",
                   help="a .gz is read up to N decompressed bytes, the rest quarantined "
                        "(default: 100 times its size on disk, at least 1 MiB)")

    logs = group(sub, "logs", "log store")
    p = command(logs, "stats", cmd_logs_stats, "what the log store holds", example="logs stats --db sqlite:///logs.db")
    add_db(p)
    p = command(logs, "quarantine", cmd_logs_quarantine, "rejected records with their reasons and locations",
                example="logs quarantine --source prod-2026-11-29 --limit 20")
    add_db(p)
    p.add_argument("--source", default=None, help="only this source")
    p.add_argument("--limit", type=count_in(bounds.MAX_PROMPTS), default=100)
    p = command(logs, "prune", cmd_logs_prune, "remove traffic older than an age, and what was derived from it",
                example="logs prune --older-than 30d")
    add_db(p)
    p.add_argument("--older-than", required=True, metavar="AGE", help="30d, 12h, or days")
    p.add_argument("--force", action="store_true", help="remove a registered draft's window and held-out prompts too")
    p = command(logs, "forget", cmd_logs_forget, "remove conversations from the store, the pool, suffix corpora "
                "and held-out files", example="logs forget --user user-000042")
    add_db(p)
    p.add_argument("--id", type=int, action="append", help="a conversation id (repeat for more)")
    p.add_argument("--user", default=None, help="every conversation whose request logged this user")
    p.add_argument("--source", default=None, help="every conversation ingested from this file or source name")
