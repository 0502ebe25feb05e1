"""How does each log-store stage's time grow with the store, in SQLite and PostgreSQL?

    python benchmarks/log_growth.py --sizes 10000,100000 [--pg-url URL] [--plot growth.png]

For each size, `traffic_month.py` writes that many OpenAI-format lines over 30 days of hourly `.jsonl.gz`
files; they are ingested into a fresh store (SQLite, and PostgreSQL when a URL is given or
$SPECDISTILL_TEST_PG_URL is set, e.g. under scripts/with_postgres.sh) and each stage is timed once:
ingest (records/s, MB/s), bytes per conversation, `logs stats`, the nightly's window (counts and the
seeded sample of the last day's train split, 1,024 prompts), its export (the sampled rows read back and
written as the generic baseline's JSONL), the monitor's prompt sample (16 eval prompts), and the suffix
corpus built from an answers file of the sample. The table ends with each row's slope: log(time ratio) /
log(size ratio) between the smallest and the largest size (1: grows with the store; ~0: with the window).
Peak memory is the process's resident maximum after the stage (it only grows). The answer pool's
selection over 30 nights is not measured here (it reads the pool's files, not the store).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path

import sqlalchemy as sa
from traffic_month import generate, hourly_files, source_texts

from specdistill.data.ingest import ingest
from specdistill.data.logstore import LogStore
from specdistill.data.prompts import prompts_from_logs
from specdistill.pipeline.stages.corpus import build_corpus

STAGES = ["ingest", "logs stats", "window counts", "window sample", "export", "monitor sample", "suffix corpus"]


class WordTokenizer:
    """Whitespace 'tokens' (no model): the window's prompt filter costs what it costs without a real tokenizer."""

    chat_template = None

    def __call__(self, text):
        return {"input_ids": [len(w) for w in text.split()][:512]}


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def fresh_pg(base: str) -> tuple[str, callable]:
    schema = f"growth_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(base)
    with admin.begin() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {schema}"))

    def drop() -> None:
        with admin.begin() as conn:
            conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()

    return sa.make_url(base).update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(False), drop


def db_bytes(store: LogStore, url: str) -> int:
    if url.startswith("sqlite"):
        path = Path(sa.make_url(url).database)
        return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))
    with store.engine.connect() as conn:
        return sum(conn.execute(sa.text(f"SELECT pg_total_relation_size('{t}')")).scalar_one()
                   for t in ("conversations", "quarantine", "ingest_runs", "watermarks"))


def measure(url: str, files: list[Path], work: Path) -> dict:
    row: dict = {}
    store = LogStore(url)
    t, read, size = time.perf_counter(), 0, 0
    for f in files:
        r = ingest(f, "openai", store, progress=False)
        read += r.read
        size += r.end_offset
    sec = time.perf_counter() - t
    row["ingest"] = (sec, peak_mb())
    row["records/s"], row["MB/s"] = read / sec, size / 1e6 / sec
    n = store.count()
    row["bytes/conversation"] = db_bytes(store, url) / max(n, 1)

    def timed(name, fn):
        began = time.perf_counter()
        out = fn()
        row[name] = (time.perf_counter() - began, peak_mb())
        return out

    timed("logs stats", store.stats)
    newest = store.window(limit=1)[0].arrived_at
    since = newest - timedelta(days=1)
    timed("window counts", lambda: [store.count(source=s, split="train", since=since) for s in store.sources()[-24:]])
    sample = timed("window sample", lambda: store.sample(1024, seed=0, split="train", since=since))
    timed("export", lambda: store.export_answered([c.id for c in store.by_ids([c.id for c in sample])],
                                                   work / "export.jsonl"))
    timed("monitor sample", lambda: prompts_from_logs(store, WordTokenizer(), "eval", 16, seed=0))
    answers = work / "train_generated.jsonl"
    answers.write_text("".join(json.dumps({"id": str(c.id), "response_ids": list(range(1, 60))}) + "\n" for c in sample))
    timed("suffix corpus", lambda: build_corpus([answers], work / "corpus.safetensors", target_fingerprint="fp",
                                                tokenizer="tok", log_db=url))
    store.close()
    row["conversations"] = n
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,100000", help="lines of traffic per store, comma-separated")
    parser.add_argument("--pg-url", default=os.environ.get("SPECDISTILL_TEST_PG_URL"))
    parser.add_argument("--plot", type=Path, default=None, help="write the log-log plot here (needs matplotlib)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    texts = source_texts()
    results: dict[str, dict[int, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            traffic = Path(tmp) / f"t{size}"
            generate(traffic, size, seed=args.seed, texts=texts)
            files = hourly_files(traffic)
            backends = {"sqlite": f"sqlite:///{Path(tmp) / f'logs{size}.db'}"}
            if args.pg_url:
                backends["postgresql"] = None
            for name, url in backends.items():
                drop = None
                if name == "postgresql":
                    url, drop = fresh_pg(args.pg_url)
                work = Path(tmp) / f"w{size}{name}"
                work.mkdir()
                print(f"[{time.strftime('%H:%M:%S')}] {name} {size}", file=sys.stderr, flush=True)
                try:
                    results.setdefault(name, {})[size] = measure(url, files, work)
                finally:
                    if drop:
                        drop()
    lo, hi = sizes[0], sizes[-1]
    head = f"{'backend':<11}{'stage':<16}" + "".join(f"{f'{s:,}':>18}" for s in sizes) + f"{'slope':>8}"
    print(f"seconds (peak MB) per stage; slope between {lo:,} and {hi:,} lines")
    print(head)
    print("-" * len(head))
    for name, by_size in results.items():
        for stage in STAGES:
            cells = "".join(f"{by_size[s][stage][0]:>10.3f} ({by_size[s][stage][1]:>4.0f})" for s in sizes)
            slope = (math.log(by_size[hi][stage][0] / by_size[lo][stage][0]) / math.log(hi / lo)) if hi != lo else float("nan")
            print(f"{name:<11}{stage:<16}{cells}{slope:>8.2f}")
        for key in ("records/s", "MB/s", "bytes/conversation"):
            print(f"{name:<11}{key:<16}" + "".join(f"{by_size[s][key]:>18,.1f}" for s in sizes))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 5))
        for name, by_size in results.items():
            for stage in STAGES:
                ax.plot(sizes, [by_size[s][stage][0] for s in sizes], marker="o", label=f"{name}: {stage}",
                        linestyle="-" if name == "sqlite" else "--")
        ax.set(xscale="log", yscale="log", xlabel="conversations (lines of traffic)", ylabel="seconds")
        ax.legend(fontsize=6)
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
