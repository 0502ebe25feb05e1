"""A batch of records made ready for the log store: the half of storing that needs no database.

`prepare_batch` hashes each conversation, fixes its split, serializes its messages, drops the batch's own
duplicates and turns rejected records into quarantine rows. It is pure and its result pickles, so a big
file's batches are prepared in the process that parses them (`ingest_parse`), beside the one that writes
them; `LogStore.write_batch` is the other half.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone

import orjson

from specdistill.data.formats import InvalidRecord, check_metadata
from specdistill.data.identity import DEFAULT_EVAL_FRACTION, hashes, split_of
from specdistill.data.readers import Conversation, Rejected, raw_text


@dataclass
class PreparedBatch:
    """`rows`: the batch's conversations, one per content hash, sorted by it (two concurrent batches then
    lock rows in the same order: no deadlock); `quarantine`: its rejected records, one per (source,
    location, raw). Neither names the ingest run: `write_batch` adds it."""

    read: int = 0
    rows: list[dict] = field(default_factory=list)
    quarantine: list[dict] = field(default_factory=list)
    duplicates: int = 0  # within the batch (the store counts those it already held when it writes)
    quarantined: int = 0


def checked(rec: Conversation) -> Conversation | Rejected:
    """A conversation built in code whose fields no backend can store is quarantined like a bad record
    read from a file (the readers check the same rules where they parse)."""
    try:
        check_metadata(record_id=rec.record_id, served_by=rec.served_by, timestamp=rec.timestamp,
                       temperature=rec.temperature, user=rec.user)
    except InvalidRecord as exc:
        raw = json.dumps([{"role": m.role, "content": m.content} for m in rec.messages], ensure_ascii=False)
        return Rejected(rec.source, rec.location, raw_text(str(exc), 1000), raw_text(raw), rec.offset, rec.end_offset)
    return rec


def prepare_batch(
    records: Iterable[Conversation | Rejected], *, eval_fraction: float = DEFAULT_EVAL_FRACTION,
    is_checked: bool = False, now: datetime | None = None,
) -> PreparedBatch:
    """`is_checked`: the conversations come from the readers, which checked their fields where they parsed
    them (a conversation built in code is checked here)."""
    now = now or datetime.now(timezone.utc)
    batch = PreparedBatch()
    rows: dict[str, dict] = {}
    bad: dict[tuple, dict] = {}
    for rec in records:
        batch.read += 1
        if not is_checked and isinstance(rec, Conversation):
            rec = checked(rec)
        if isinstance(rec, Rejected):
            batch.quarantined += 1
            raw_hash = hashlib.sha256(rec.raw.encode("utf-8")).hexdigest()
            bad[(rec.source, rec.location, raw_hash)] = dict(
                source=rec.source, location=rec.location, reason=rec.reason, raw=rec.raw,
                raw_hash=raw_hash, created_at=now)
            continue
        digest, p_hash = hashes(rec.messages)
        if digest in rows:
            batch.duplicates += 1
            continue
        arrived = datetime.fromtimestamp(rec.timestamp, timezone.utc) if rec.timestamp is not None else now
        rows[digest] = dict(
            content_hash=digest, prompt_hash=p_hash, split=split_of(p_hash, eval_fraction),
            messages=orjson.dumps([{"role": m.role, "content": m.content} for m in rec.messages]).decode(),
            num_messages=len(rec.messages), num_chars=sum(len(m.content) for m in rec.messages),
            source=rec.source, location=rec.location, record_id=rec.record_id, target_version=rec.served_by,
            request_temperature=rec.temperature, user=rec.user,
            notes=json.dumps(rec.notes) if rec.notes else None, arrived_at=arrived, ingested_at=now)
    batch.rows = [rows[k] for k in sorted(rows)]
    batch.quarantine = [bad[k] for k in sorted(bad)]
    return batch
