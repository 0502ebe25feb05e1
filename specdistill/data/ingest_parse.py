"""The reading half of ingest: a traffic file's records into prepared batches, each with the watermark it
moves, in this process or, for a big file, in a child process beside the one that writes them.

Why a process: parsing and preparing a record costs about as much CPU as storing it (client and server
together), and a thread cannot overlap the two. Beside a parsing thread the writer's COPY ran 4x slower
(the GIL); a second process overlaps them. A small file is read here: a child's start would cost more
than it saves. Measured in benchmarks/README, "Ingest rate".
"""

from __future__ import annotations

import hashlib
import os
import pickle
import queue as queues
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import specdistill
from specdistill import paths
from specdistill.data.batch import PreparedBatch, prepare_batch
from specdistill.data.readers import RecordReader, Truncation, is_gzip

FINGERPRINT_BYTES = 4096
PROCESS_MIN_BYTES = 4 << 20  # left to read: from here a child process pays for its start
GZIP_INFLATION = 4  # a .gz of JSON logs inflates about this much: what its size on disk stands for
QUEUE_BATCHES = 4  # prepared batches the child may run ahead of the writer
CHILD_EXIT_S = 5.0  # how long a pipe's end waits for the child's exit code


@dataclass
class ReadEnd:
    """Where and how the reader stopped: what `RecordReader` holds after iteration."""

    end_offset: int
    index: int
    records: int
    truncation: Truncation | None
    capped: str | None


@dataclass
class ParsedBatch:
    """A prepared batch and the watermark it moves the source to; the last batch of a read (maybe empty)
    carries `end`."""

    batch: PreparedBatch
    end_offset: int
    index: int
    fingerprint: str
    end: ReadEnd | None = None


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


def parsed_batches(reader: RecordReader, batch_size: int, eval_fraction: float) -> Iterator[ParsedBatch]:
    """A batch every `batch_size` records, then a last one with what is left (maybe nothing) and `end`."""
    records: list = []

    def parsed(end_offset: int, end: ReadEnd | None = None) -> ParsedBatch:
        batch = prepare_batch(records, eval_fraction=eval_fraction, is_checked=True)  # the readers checked them
        return ParsedBatch(batch, end_offset, reader.index, file_fingerprint(reader.path, end_offset), end)

    for record in reader:
        records.append(record)
        if len(records) >= batch_size:
            yield parsed(record.end_offset)
            records = []
    yield parsed(reader.end_offset, ReadEnd(reader.end_offset, reader.index, reader.records, reader.truncation,
                                            reader.capped))


def left_to_read(reader: RecordReader) -> int:
    """About how many bytes of records the reader has ahead of it."""
    size = reader.path.stat().st_size
    return size * GZIP_INFLATION - reader.start_offset if is_gzip(reader.path) else size - reader.start_offset


def read_batches(reader: RecordReader, batch_size: int, eval_fraction: float, *,
                 in_child: bool | None = None) -> Iterator[ParsedBatch]:
    """`parsed_batches`, run in a child process when `in_child` (None: when the file is big enough). Close the
    iterator to stop the child early."""
    if in_child is None:
        in_child = left_to_read(reader) >= PROCESS_MIN_BYTES
    if in_child:
        try:
            child = _start_child(reader, batch_size, eval_fraction)
        except OSError:  # no process to be had here (a limit on processes, a locked-down sandbox): read in this one
            pass
        else:
            return _from_child(child)
    return parsed_batches(reader, batch_size, eval_fraction)


@dataclass
class _Failed:
    error: BaseException


def _start_child(reader: RecordReader, batch_size: int, eval_fraction: float) -> subprocess.Popen:
    # A fresh interpreter that imports only this module (multiprocessing's children import the parent's main
    # script again: the CLI's, with all it imports), given its work on stdin and sending batches on stdout.
    package_root = str(Path(specdistill.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    child = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        child.stdin.write(pickle.dumps((reader, batch_size, eval_fraction)))
        child.stdin.close()
    except OSError:
        child.kill()
        child.wait()
        raise
    return child


def _from_child(child: subprocess.Popen) -> Iterator[ParsedBatch]:
    ahead: queues.Queue = queues.Queue(maxsize=QUEUE_BATCHES)  # the child parses on while this process writes

    def receive() -> None:
        try:
            while True:
                ahead.put(pickle.load(child.stdout))
        except BaseException as exc:  # the end of the pipe, or a batch cut short or unreadable
            try:
                child.wait(timeout=CHILD_EXIT_S)
                ahead.put(None)  # the child is done (or died, said by its exit code)
            except subprocess.TimeoutExpired:  # it lives on but sent what does not unpickle here
                ahead.put(_Failed(exc))

    receiver = threading.Thread(target=receive, name="specdistill-ingest-receive", daemon=True)
    receiver.start()
    try:
        while (item := ahead.get()) is not None:
            if isinstance(item, _Failed):
                raise item.error
            yield item
            if item.end is not None:
                return
        code = child.wait()
        raise RuntimeError(f"the process parsing the file stopped (exit code {code}) before it finished; "
                           "the next ingest goes on from the last committed batch")
    finally:
        if child.poll() is None:
            child.kill()  # the writer stopped first (an error, an interrupt): the parser goes too
        child.wait()
        while receiver.is_alive():  # it reads on to the end of the pipe: room for its last put
            try:
                ahead.get(timeout=0.1)
            except queues.Empty:
                pass
        child.stdout.close()


def _child_main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C reaches the writer, which stops this process
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print goes to stderr, not into the batches
    reader, batch_size, eval_fraction = pickle.load(sys.stdin.buffer)
    try:
        for parsed in parsed_batches(reader, batch_size, eval_fraction):
            pickle.dump(parsed, out, protocol=pickle.HIGHEST_PROTOCOL)
            out.flush()
    except BrokenPipeError:  # the writer stopped reading: it stops this process too
        return
    except BaseException as exc:  # raised again in the writer, where the ingest is closed
        try:
            pickle.dumps(exc)
        except Exception:
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        pickle.dump(_Failed(exc), out)
        out.flush()


if __name__ == "__main__":  # batches pickle by this module's name, not `__main__`'s
    from specdistill.data.ingest_parse import _child_main as main

    main()
