"""Ingest a traffic file into the log store: idempotent, incremental, resumable, and counted.

Every run conserves its counts: read = stored + duplicates + quarantined, where read is the number
of records (JSONL lines that are not blank, ShareGPT array elements) the run looked at.

Records are committed in batches; each batch moves the source's watermark (the byte offset after
its last record) in the same transaction. So a rerun on an unchanged file reads nothing, a grown
file is read from where the last run stopped, and a run killed mid-file leaves the store consistent
and is completed by the next run. A file whose first bytes, or whose bytes just before the
watermark, changed was rewritten: it is read again from the start, and what is already stored
counts as duplicates.

A big file is parsed in a second process while this one writes (`ingest_parse`): batches still commit one at a
time, in file order, each with its watermark.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from specdistill import paths
from specdistill.data.ingest_parse import ParsedBatch, ReadEnd, file_fingerprint, read_batches
from specdistill.data.logstore import LogStore, Watermark
from specdistill.data.readers import DEFAULT_MAX_CHARS, DEFAULT_MAX_RECORD_BYTES, is_gzip, read_records
from specdistill.env import mask_secrets


@dataclass
class IngestResult:
    source: str
    format: str
    run_id: int | None
    read: int = 0
    stored: int = 0
    duplicates: int = 0
    quarantined: int = 0
    start_offset: int = 0
    end_offset: int = 0
    truncation: dict | None = None  # {"offset", "tail_bytes", "location", "corrupt"} of an unfinished tail
    corrupt: str | None = None  # one line naming the file, when its data is unreadable past a point (a bad .gz)
    capped: str | None = None  # one line naming the file, when a .gz inflated past its cap (the rest quarantined)
    note: str | None = None
    seconds: float = 0.0
    conserved: bool = field(init=False, default=True)

    def __post_init__(self) -> None:
        self.conserved = self.read == self.stored + self.duplicates + self.quarantined

    def to_dict(self) -> dict:
        self.__post_init__()
        return asdict(self)

    def render(self) -> str:
        lines = [
            f"{self.source} ({self.format}): read {self.read} = stored {self.stored} + duplicates "
            f"{self.duplicates} + quarantined {self.quarantined}  [bytes {self.start_offset}..{self.end_offset}, "
            f"{self.seconds:.1f} s]"
        ]
        if self.capped:
            lines.append(self.capped)
        if self.corrupt:
            lines.append(self.corrupt)
        elif self.truncation:
            t = self.truncation
            lines.append(
                f"truncated: the file ends inside {t['location']} (byte {t['offset']}, {t['tail_bytes']} bytes); "
                "that record is not read until the file is complete"
            )
        if self.note:
            lines.append(f"note: {self.note}")
        if self.quarantined:
            lines.append("see the rejected records with: specdistill logs quarantine")
        return "\n".join(lines)


def _resume_point(store: LogStore, path: Path, source: str, fmt: str) -> tuple[int, int, str | None]:
    wm = store.watermark(source)
    if wm is None:
        return 0, 0, None
    if wm.format != fmt and wm.offset == 0:  # nothing was read in that format: this one may try from the start
        return 0, 0, f"an earlier ingest as {wm.format!r} read no record of it: read again as {fmt!r}"
    if wm.format != fmt:
        raise ValueError(f"{path} was ingested as {wm.format!r}, not {fmt!r}; pass --format {wm.format}")
    compressed = is_gzip(path)
    if (not compressed and path.stat().st_size < wm.offset) or file_fingerprint(path, wm.offset) != wm.fingerprint:
        return 0, 0, "the file changed since the last ingest (rewritten or shrunk): read again from the start"
    return wm.offset, wm.index, None


def _close_failed(store: LogStore, run_id: int, exc: BaseException) -> None:
    interrupted = isinstance(exc, KeyboardInterrupt)
    why = "interrupted" if interrupted else f"failed: {type(exc).__name__}: {mask_secrets(str(exc))[:300]}"
    try:
        store.fail_run(run_id, f"{why}; the next ingest goes on from the last committed batch",
                       "interrupted" if interrupted else "failed")
    except Exception:  # the store itself is gone (a lost server): the original error is the one to report
        pass


def _write_batches(batches: Iterator[ParsedBatch], store: LogStore, result: IngestResult, fmt: str, note: str | None,
                   bar: tqdm) -> ReadEnd:
    """Write each batch with its watermark, in file order; the run is opened with the first. The last batch
    is written only when it holds records, moves the watermark, or is the run's only one.

    Each batch is written on a thread of its own while this one waits: Ctrl-C (raised in the main thread)
    then lands in the wait, and the `with` lets the batch in flight commit first. Cut inside its transaction,
    a write could leave SQLite's write lock held, and the run could not be closed as interrupted."""
    reached = result.start_offset
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ingest-writer") as writer:
        for parsed in batches:
            last = parsed.end is not None
            if last and not parsed.batch.read and parsed.end_offset == reached and result.run_id is not None:
                return parsed.end
            if result.run_id is None:
                result.run_id = store.begin_run(result.source, fmt, result.start_offset, note)
            watermark = Watermark(result.source, fmt, parsed.end_offset, parsed.index, parsed.fingerprint)
            counts = writer.submit(store.write_batch, result.run_id, parsed.batch, watermark).result()
            result.read += parsed.batch.read
            result.stored += counts.stored
            result.duplicates += counts.duplicates
            result.quarantined += counts.quarantined
            result.end_offset = parsed.end_offset
            bar.update(parsed.end_offset - reached)
            bar.set_postfix(stored=result.stored, dup=result.duplicates, quarantined=result.quarantined, refresh=False)
            reached = parsed.end_offset
            if last:
                return parsed.end
    raise RuntimeError("the reader stopped without saying where")  # parsed_batches always ends with `end`


def _close_run(store: LogStore, result: IngestResult, end: ReadEnd, path: Path, start: int) -> None:
    """What the reader found at the end (a cap, a truncated or corrupt tail, blank lines only) onto the
    result and the run, which is closed."""
    result.capped = end.capped
    if result.read == 0 and end.end_offset > start and end.truncation is None:
        result.note = "; ".join(filter(None, [result.note, f"no record in bytes {start}..{end.end_offset}: blank lines only"]))
    t = end.truncation
    if t is not None:
        result.truncation = asdict(t)
        if t.corrupt:
            result.corrupt = (f"{path}: {t.corrupt}; unreadable from {t.location} on (the {end.records} records "
                              "before it are counted above; replace the file and ingest it again)")
    store.finish_run(result.run_id, t and t.offset, t and t.tail_bytes)


def ingest(
    path: str | Path,
    fmt: str,
    store: LogStore | None = None,
    *,
    batch_size: int = 1000,
    progress: bool = True,
    source: str | None = None,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    max_chars: int = DEFAULT_MAX_CHARS,
    max_decompressed_bytes: int | None = None,
    parse_in_child: bool | None = None,
) -> IngestResult:
    """Ingest what is new in `path`; see the module docstring for the guarantees. A `.gz` inflates to at most
    `max_decompressed_bytes` (default: `readers.DECOMPRESSION_RATIO` times its size); the rest is quarantined.
    `parse_in_child`: parse in a second process while this one writes (None: when the file is big enough,
    see `ingest_parse`)."""
    path = paths.check_regular(path, "traffic file")  # a directory, a FIFO, a device: said so, never opened
    store = store or LogStore()
    source = source or str(path.resolve())
    start, start_index, note = _resume_point(store, path, source, fmt)
    reader = read_records(path, fmt, source=source, start_offset=start, start_index=start_index,
                          max_record_bytes=max_record_bytes, max_chars=max_chars,
                          max_decompressed_bytes=max_decompressed_bytes)
    result = IngestResult(source=source, format=fmt, run_id=None, start_offset=start, end_offset=start, note=note)
    began = time.perf_counter()
    total = None if is_gzip(path) else max(path.stat().st_size - start, 0)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"ingest {path.name}", disable=not progress,
               file=sys.stderr, mininterval=0.5)
    batches = read_batches(reader, batch_size, store.eval_fraction, in_child=parse_in_child)
    try:
        end = _write_batches(batches, store, result, fmt, note, bar)
    except BaseException as exc:  # an error or an interrupt: the committed batches stand, the run is closed
        if result.run_id is not None:
            _close_failed(store, result.run_id, exc)
        raise
    finally:
        batches.close()  # a child parsing ahead is stopped
        bar.close()
    _close_run(store, result, end, path, start)
    result.seconds = time.perf_counter() - began
    result.__post_init__()
    if not result.conserved:  # a bug, never bad input: bad input is quarantined and counted
        raise RuntimeError(f"count conservation broken: {result.to_dict()}")
    return result
