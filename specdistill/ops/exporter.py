"""The metrics exporter (`specdistill monitor serve`): the metrics of docs/metrics.md fed from the log
store, which the monitor and the flows write. It keeps serving through a bad serving config (the last
good one stays, `specdistill_serving_config_errors_total` counts the bad reads) and reports no value
where nothing has been measured yet."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from specdistill.ops.metrics import SpecDecodeMetrics, check_listen_address
from specdistill.ops.serving import ServingConfigError, read_serving_config

log = logging.getLogger(__name__)

MIN_REFRESH_S = 0.1  # the exporter's shortest refresh interval


def refresh_metrics(metrics, store, after_id: int = 0, serving_path: str | Path | None = None) -> int:
    """Add acceptance samples stored since `after_id` to the counters, set the serving gauges and the
    pipeline's last success; returns the newest sample id seen (pass it back next time, so nothing
    is counted twice). An unreadable serving config keeps the last good gauges, counts an error in
    `specdistill_serving_config_errors_total` and says why on stderr."""
    for sample_id, counts in store.acceptance_samples_after(after_id):
        metrics.record(counts)
        after_id = sample_id
    try:
        serving = read_serving_config(serving_path)
    except ServingConfigError as exc:
        metrics.serving_config_errors.inc()
        log.warning("%s; the metrics keep the last good serving config", exc)
        serving = None
    if serving is not None:
        metrics.set_serving(serving.mode, target_fingerprint=serving.target_fingerprint,
                            draft_version=serving.draft_version)
    last_success = store.last_pipeline_success()
    if last_success is not None:
        metrics.mark_pipeline_success(last_success.timestamp())
    return after_id


def serve_metrics(store, port: int = 9464, host: str = "127.0.0.1", interval_s: float = 15.0,
                  serving_path: str | Path | None = None, iterations: int | None = None,
                  on_listening: Callable[[str], None] | None = None):
    """`specdistill monitor serve`: the metrics of docs/metrics.md on http://host:port/metrics, refreshed
    from the log store every `interval_s` (forever, or `iterations` times). `on_listening` is called with
    the URL once the port is bound (never before: a bind error is the only word about it)."""
    if not interval_s >= MIN_REFRESH_S:  # also NaN
        raise ValueError(f"refresh interval {interval_s!r} s: at least {MIN_REFRESH_S:g} s (0 would spin a CPU)")
    check_listen_address(port, host)
    metrics = SpecDecodeMetrics()
    server = metrics.serve(port, host)
    if on_listening is not None:
        bound = server[0].server_port if isinstance(server, tuple) else port  # port 0: the one the system chose
        on_listening(f"http://{host if ':' not in host else f'[{host}]'}:{bound}/metrics")
    last = 0
    done = 0
    while iterations is None or done < iterations:
        last = refresh_metrics(metrics, store, last, serving_path)
        done += 1
        if iterations is None or done < iterations:
            time.sleep(interval_s)
    return metrics, server
