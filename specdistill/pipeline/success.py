"""A flow that ran to its end says so: a row in the log store (what `monitor serve` reports as
`specdistill_pipeline_last_success_timestamp_seconds`) and, where a Pushgateway is configured, a push.
Without it the stale-pipeline alert fires whatever the nightly does."""

from __future__ import annotations

import time
from datetime import datetime, timezone

from specdistill.data.logstore import LogStore
from specdistill.ops.metrics import SpecDecodeMetrics


def mark_pipeline_success(log_db: str | None, flow: str, target_fingerprint: str = "",
                          when: float | None = None) -> float:
    when = time.time() if when is None else when
    with LogStore(log_db) as store:
        store.add_pipeline_success(flow, target_fingerprint, when=datetime.fromtimestamp(when, timezone.utc))
    metrics = SpecDecodeMetrics()
    metrics.mark_pipeline_success(when)
    metrics.push(job=f"specdistill-{flow}")
    return when
