"""How does the answer pool's selection (the view a night trains on) grow with the nights in the pool?

    python benchmarks/pool_growth.py --state .specdistill --nights 1,10,30 --work DIR

The newest night of the state's pool is copied into `max(nights)` nights of its own (each answer's id renamed, its
teacher and feature shards rewritten under the new ids, so no night duplicates another), then a pool of the first N
copies is built for each N and the view of its newest night is taken three times in a child process of its own:
cold (reads every night's answers and shard headers, writes the view's links and answers file), again (the view is
found and reused) and under an answer-token budget of 5 nights. Memory: the child's resident maximum over
what it held when it started (the parent's imports). The copies need about `max(nights)` x the night's disk
(features included): DIR is removed at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import shutil
import sys
import time
from pathlib import Path

from common import log
from safetensors.torch import load_file

from specdistill.distill import shards
from specdistill.distill.features import FEATURE_META
from specdistill.distill.pool import AnswerPool, pools
from specdistill.distill.teacher import CACHE_META


def copy_cache(src: Path, dst: Path, meta_name: str, suffix: str) -> None:
    """A cache directory whose entries are the source's under `ID{suffix}`, its record copied as it is."""
    dst.mkdir(parents=True)
    for shard in sorted(src.glob("shard-*.safetensors")):
        tensors = load_file(str(shard))
        renamed = {}
        for key, t in tensors.items():
            example, _, field = key.partition("/")
            renamed[f"{example}{suffix}/{field}"] = t
        shards.write_shard(dst / shard.name, renamed)
    shutil.copy2(src / meta_name, dst / meta_name)


def copy_night(night, dst: Path, suffix: str) -> tuple[Path, Path, Path | None]:
    dst.mkdir(parents=True)
    answers = dst / "train_generated.jsonl"
    with open(night.answers, encoding="utf-8") as src, open(answers, "w", encoding="utf-8") as out:
        for line in src:
            if line.strip():
                rec = json.loads(line)
                rec["id"] = f"{rec['id']}{suffix}"
                out.write(json.dumps(rec, ensure_ascii=False) + "\n")
    copy_cache(Path(night.teacher_cache), dst / "teacher_cache", CACHE_META, suffix)
    features = None
    if night.features:
        features = dst / "features"
        copy_cache(Path(night.features), features, FEATURE_META, suffix)
    return answers, dst / "teacher_cache", features


def resident_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 2**20


def timed_views(root: str, fingerprint: str, include: str, budget: int | None, queue) -> None:
    pool = AnswerPool.open(root, fingerprint)
    out = {"rss_before_mb": resident_mb()}
    for name, max_tokens in (("cold", None), ("again", None), ("budget", budget)):
        t0 = time.perf_counter()
        view = pool.view(include=include, max_tokens=max_tokens)
        out[name] = {"seconds": time.perf_counter() - t0, "answers": view.answers, "tokens": view.tokens}
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    queue.put(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state", default=".specdistill", help="a state directory whose pool holds a night")
    p.add_argument("--nights", default="1,10,30", help="pool sizes in nights, comma-separated")
    p.add_argument("--work", required=True, help="where the copies and pools are written")
    p.add_argument("--keep", action="store_true", help="keep the copies")
    args = p.parse_args(argv)
    sizes = sorted({int(x) for x in args.nights.split(",")})
    found = [q for q in pools(Path(args.state) / "nightly" / "pool") if q.nights]
    if not found:
        raise SystemExit(f"no answer pool with a night under {args.state}: run `make demo` first")
    template = found[0].nights[-1]
    work = Path(args.work)
    if work.exists():
        raise SystemExit(f"{work} exists: give a directory of its own")
    copies = []
    for i in range(max(sizes)):
        log(f"copying night {i + 1}/{max(sizes)}")
        copies.append(copy_night(template, work / "nights" / f"n{i:03d}", f"-n{i:03d}"))
    budget = 5 * template.tokens
    rows = []
    ctx = multiprocessing.get_context("fork")
    for n in sizes:
        root = work / f"pool-{n}"
        pool = AnswerPool.open(root, found[0].fingerprint)
        for i, (answers, teacher, features) in enumerate(copies[:n]):
            pool.add_night(f"n{i:03d}", answers, teacher, features)
        queue = ctx.Queue()
        child = ctx.Process(target=timed_views, args=(str(root), found[0].fingerprint, f"n{n - 1:03d}", budget, queue))
        child.start()
        result = queue.get()
        child.join()
        rows.append((n, result))
        log(f"{n} nights: {result}")
    print(f"the answer pool's view over N nights, each a copy of night {template.key} ({template.answers_count} answers, "
          f"{template.tokens:,} tokens); budget = 5 nights' tokens")
    print("| nights | answers in pool | view cold (s) | view again (s) | view under budget (s) | answers in view | peak MB over start |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n, r in rows:
        print(f"| {n} | {n * template.answers_count:,} | {r['cold']['seconds']:.2f} | {r['again']['seconds']:.2f} | "
              f"{r['budget']['seconds']:.2f} | {r['cold']['answers']:,} | {r['peak_rss_mb'] - r['rss_before_mb']:.0f} |")
    if not args.keep:
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
