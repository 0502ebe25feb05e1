"""Stage: a configured source's traffic into the log store (`data.ingest`), under the file the source names."""

from __future__ import annotations

from specdistill.data.ingest import IngestResult, ingest
from specdistill.data.logstore import LogStore
from specdistill.pipeline.layout import resolve_source_path
from specdistill.pipeline.nightly_recipe import SourceConfig


def ingest_source(source: SourceConfig, log_db: str | None) -> IngestResult:
    with LogStore(log_db) as store:
        return ingest(resolve_source_path(source), source.format, store, progress=True,
                      max_decompressed_bytes=source.max_decompressed_bytes)
