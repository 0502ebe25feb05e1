"""Ingest a traffic file into the log store: idempotent, incremental, resumable, and counted.

Every run conserves its counts: read = stored + duplicates + quarantined, where read is the number
of records (JSONL lines that are not blank, ShareGPT array elements) the run looked at.

Records are committed in batches; each batch moves the source's watermark (the byte offset after
its last record) in the same transaction. So a rerun on an unchanged file reads nothing, a grown
file is read from where the last run stopped, and a run killed mid-file leaves the store consistent
and is completed by the next run. A file whose first bytes, or whose bytes just before the
watermark, changed was rewritten: it is read again from the start, and what is already stored
counts as duplicates.
"""

from __future__ import annotations

import hashlib
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from specdistill import paths
from specdistill.data.logstore import LogStore, Watermark
from specdistill.data.readers import (
    DEFAULT_MAX_CHARS,
    DEFAULT_MAX_RECORD_BYTES,
    Conversation,
    Rejected,
    is_gzip,
    read_records,
)
from specdistill.env import mask_secrets

FINGERPRINT_BYTES = 4096


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


def file_fingerprint(path: Path, offset: int) -> str:
    """Hash of the file's first bytes and of the bytes just before `offset` (on disk, as stored).

    For compressed files only the first bytes count: their offsets are in the decompressed stream.
    """
    digest = hashlib.sha256()
    with paths.open_regular(path, "traffic file") as f:
        head = f.read(FINGERPRINT_BYTES)
        compressed = head[:2] == b"\x1f\x8b"
        if not compressed:
            head = head[:offset]
        digest.update(head)
        if not compressed and offset > FINGERPRINT_BYTES:
            f.seek(offset - FINGERPRINT_BYTES)
            digest.update(f.read(FINGERPRINT_BYTES))
    return digest.hexdigest()


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


class _BatchWriter:
    """One batch is written while the next is read: the database's time (a server's, or SQLite's in C, both
    outside the GIL) overlaps the parsing. Batches commit one at a time, in file order, each with its
    watermark, so a kill still leaves the store at a batch boundary; a batch that failed stops every later
    one from moving the watermark past it. `settle` adds a written batch's counts to the result."""

    def __init__(self, store: LogStore, result: IngestResult, bar: tqdm) -> None:
        self.store, self.result, self.bar = store, result, bar
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ingest-writer")
        self.pending: tuple[Future, int, int] | None = None  # (the batch being written, its size, its end offset)
        self.reached = result.start_offset  # the end offset of the last batch handed to the writer
        self.failed: list[BaseException] = []

    def _write(self, records: list, wm: Watermark):
        if self.failed:
            raise RuntimeError("an earlier batch was not stored") from self.failed[0]
        try:
            return self.store.add_batch(self.result.run_id, records, wm, checked=True)  # the readers checked them
        except BaseException as exc:
            self.failed.append(exc)
            raise

    def submit(self, records: list, wm: Watermark) -> None:
        """Hand a batch to the writer thread, then wait for the one before it."""
        future = self.pool.submit(self._write, records, wm)
        self.settle()
        self.pending, self.reached = (future, len(records), wm.offset), wm.offset

    def settle(self) -> None:
        if self.pending is None:
            return
        future, size, end_offset = self.pending
        self.pending = None
        counts = future.result()
        result = self.result
        result.read += size
        result.stored += counts.stored
        result.duplicates += counts.duplicates
        result.quarantined += counts.quarantined
        result.end_offset = end_offset
        self.bar.set_postfix(stored=result.stored, dup=result.duplicates, quarantined=result.quarantined,
                             refresh=False)

    def close(self) -> None:
        self.pool.shutdown(wait=True)  # a batch in flight commits (or fails) before the run ends


def _read_batches(reader, writer: _BatchWriter, path: Path, fmt: str, batch_size: int, note: str | None) -> None:
    """Read every record into batches of `batch_size` and write them; the last (maybe empty) batch moves the
    watermark to where the reader stopped. The run is opened with the first batch."""
    result, store = writer.result, writer.store
    batch: list[Conversation | Rejected] = []
    position = result.start_offset

    def flush(end_offset: int) -> None:
        nonlocal batch
        if result.run_id is None:
            result.run_id = store.begin_run(result.source, fmt, result.start_offset, note)
        writer.submit(batch, Watermark(result.source, fmt, end_offset, reader.index, file_fingerprint(path, end_offset)))
        batch = []

    for record in reader:
        batch.append(record)
        writer.bar.update(record.end_offset - position)
        position = record.end_offset
        if len(batch) >= batch_size:
            flush(record.end_offset)
    if batch or reader.end_offset != writer.reached or result.run_id is None:
        flush(reader.end_offset)
    writer.settle()


def _close_run(store: LogStore, result: IngestResult, reader, path: Path, start: int) -> None:
    """What the reader found at the end (a cap, a truncated or corrupt tail, blank lines only) onto the
    result and the run, which is closed."""
    result.capped = reader.capped
    if result.read == 0 and reader.end_offset > start and reader.truncation is None:
        result.note = "; ".join(filter(None, [result.note, f"no record in bytes {start}..{reader.end_offset}: blank lines only"]))
    t = reader.truncation
    if t is not None:
        result.truncation = asdict(t)
        if t.corrupt:
            result.corrupt = (f"{path}: {t.corrupt}; unreadable from {t.location} on (the {reader.records} records "
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
) -> IngestResult:
    """Ingest what is new in `path`; see the module docstring for the guarantees. A `.gz` inflates to at most
    `max_decompressed_bytes` (default: `readers.DECOMPRESSION_RATIO` times its size); the rest is quarantined."""
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
    writer = _BatchWriter(store, result, bar)
    try:
        _read_batches(reader, writer, path, fmt, batch_size, note)
    except BaseException as exc:  # an error or an interrupt: the committed batches stand, the run is closed
        writer.close()  # the batch in flight commits (or fails) before the run is closed
        if result.run_id is not None:
            _close_failed(store, result.run_id, exc)
        raise
    finally:
        writer.close()
        bar.close()
    _close_run(store, result, reader, path, start)
    result.seconds = time.perf_counter() - began
    result.__post_init__()
    if not result.conserved:  # a bug, never bad input: bad input is quarantined and counted
        raise RuntimeError(f"count conservation broken: {result.to_dict()}")
    return result
