"""Prometheus metrics, named after vLLM's so one dashboard reads both, their exporter, and the live
acceptance sampler.

Counters carry the raw counts (drafts, draft tokens, accepted tokens, accepted per position): a
recording rule computes acceptance as a ratio of rates, never an average of ratios. The exporter
(`specdistill monitor serve`) feeds them from the log store, which the monitor and the flows write; it
keeps serving through a bad serving config (the last good one stays, `specdistill_serving_config_errors_total`
counts the bad reads) and reports no value where nothing has been measured yet. The live sampler reads a
serving engine's own `vllm:spec_decode_*` or `llamacpp:spec_decode_*` counters from two scrapes of its
`/metrics` page (parsed in `engines.client`).
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    push_to_gateway,
    start_http_server,
)

from specdistill.acceptance import DraftCounts
from specdistill.data.record import FLAT, Record, from_dict
from specdistill.engines.client import EngineRequestError, Scrape, delta, scrape
from specdistill.env import mask_url
from specdistill.ops.serving import ServingConfigError, read_serving_config
from specdistill.speculative.specs import serving_modes

log = logging.getLogger(__name__)

PREFIX = "specdistill"
MIN_REFRESH_S = 0.1  # the exporter's shortest refresh interval


class SpecDecodeMetrics:
    """The metrics of docs/metrics.md on their own registry (so tests and several monitors never collide)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.num_drafts = Counter(f"{PREFIX}_spec_decode_num_drafts", "Drafting rounds verified by the target.", registry=r)
        self.num_draft_tokens = Counter(f"{PREFIX}_spec_decode_num_draft_tokens", "Draft tokens proposed.", registry=r)
        self.num_accepted_tokens = Counter(f"{PREFIX}_spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r)
        self.accepted_per_pos = Counter(
            f"{PREFIX}_spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position.", ["position"], registry=r
        )
        # gauges of a measurement are registered at their first value: before it they have none
        # (a scrape shows no series), never a made-up 0.0
        self.acceptance_rate = Gauge(f"{PREFIX}_acceptance_rate", "Last measured acceptance rate (accepted / proposed).",
                                     registry=None)
        self.first_position_acceptance = Gauge(
            f"{PREFIX}_first_position_acceptance",
            "Last measured first-position acceptance (accepted at position 1 / drafting rounds): the red line's quantity.",
            registry=None)
        self.mean_accepted_length = Gauge(
            f"{PREFIX}_mean_accepted_length", "Last measured mean accepted length (tokens per target forward, bonus included).",
            registry=None,
        )
        self.serving_mode = Gauge(f"{PREFIX}_serving_mode", "1 for the serving mode in force.", ["mode"], registry=r)
        self.target_version = Gauge(f"{PREFIX}_target_version_info", "The target version being served.", ["fingerprint"], registry=r)
        self.draft_version = Gauge(f"{PREFIX}_draft_version_info", "The champion draft version.", ["version"], registry=r)
        self.pipeline_last_success = Gauge(
            f"{PREFIX}_pipeline_last_success_timestamp_seconds", "Unix time of the last successful nightly pipeline.",
            registry=None,
        )
        self.serving_config_errors = Counter(
            f"{PREFIX}_serving_config_errors", "Refreshes that found the serving config unreadable (the last good one is kept).",
            registry=r,
        )
        self._shown: set[int] = set()

    def _set(self, gauge: Gauge, value: float) -> None:
        """Set a gauge that has no value until its first one (registered then)."""
        if id(gauge) not in self._shown:
            self.registry.register(gauge)
            self._shown.add(id(gauge))
        gauge.set(value)

    def record(self, counts: DraftCounts) -> None:
        """Add one sample's raw counts, and set the gauges to that sample's α and τ."""
        c = counts
        if c.accepted > c.proposed or min(c.rounds, c.proposed, c.accepted) < 0:
            raise ValueError(f"inconsistent counts: rounds={c.rounds} proposed={c.proposed} accepted={c.accepted}")
        self.num_drafts.inc(c.rounds)
        self.num_draft_tokens.inc(c.proposed)
        self.num_accepted_tokens.inc(c.accepted)
        for position, count in enumerate(c.accepted_per_position):
            self.accepted_per_pos.labels(position=str(position)).inc(count)
        if c.acceptance_rate is not None:
            self._set(self.acceptance_rate, c.acceptance_rate)
        if c.accepted_length is not None:
            self._set(self.mean_accepted_length, c.accepted_length)
        if c.first_position_acceptance is not None:
            self._set(self.first_position_acceptance, c.first_position_acceptance)

    def set_serving(self, mode: str, *, target_fingerprint: str | None = None, draft_version: str | None = None) -> None:
        modes = serving_modes()  # one per servable drafter kind, and off
        if mode not in modes:
            raise ValueError(f"serving mode {mode!r} is not one of {modes}")
        for m in modes:
            self.serving_mode.labels(mode=m).set(1 if m == mode else 0)
        if target_fingerprint:
            self.target_version.clear()
            self.target_version.labels(fingerprint=target_fingerprint).set(1)
        if draft_version is not None:
            self.draft_version.clear()
            self.draft_version.labels(version=str(draft_version)).set(1)

    def mark_pipeline_success(self, when: float | None = None) -> None:
        self._set(self.pipeline_last_success, when if when is not None else time.time())

    def serve(self, port: int, host: str = "127.0.0.1"):
        """Expose /metrics over HTTP (loopback by default); returns the server and its thread. A bad
        port or host, or a port in use, is a `ValueError` naming them."""
        check_listen_address(port, host)
        try:
            return start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise ValueError(f"cannot serve metrics on {host}:{port}: {reason}"
                             + (" (another process listens there: choose another --port)" if exc.errno == errno.EADDRINUSE
                                else "")) from None

    def push(self, job: str = "specdistill") -> bool:
        """Push to a Pushgateway when one is configured (batch flows end before a scrape would come)."""
        gateway = os.environ.get("SPECDISTILL_PUSHGATEWAY")
        if not gateway:
            return False
        push_to_gateway(gateway, job=job, registry=self.registry)
        return True


def check_listen_address(port: int, host: str) -> None:
    """A TCP port in 0..65535 (0: any free one) and a host that resolves: checked before anything binds."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port {port!r} is not a TCP port (1..65535)")
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"host {host!r} is not an address this machine can listen on: {exc}") from None


def listens_everywhere(host: str) -> bool:
    """Whether `host` is a wildcard address (0.0.0.0, ::, or empty): every interface, so every network
    that reaches the machine can read the metrics (target and draft versions, acceptance, serving mode)."""
    if host.strip() in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


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


@dataclass
class LiveSample(Record):
    """Acceptance between two scrapes, or `ok=False` with the reason there is no sample. It reads like a
    replay sample (`ops.replay.AcceptanceSample`): its counts are the counters' deltas (vLLM's drafts are
    drafting rounds, its draft tokens the proposed ones). Its JSON keeps the counters' names too
    (`drafts`, `draft_tokens`) and `rounds: null`, as it always had; older records are read back by either."""

    ok: bool
    reason: str = ""
    acceptance_rate: float | None = None  # α: Δaccepted / Δdraft tokens, at whatever γ the engine serves
    first_position_acceptance: float | None = None  # Δaccepted at position 0 / Δdrafts (None: no per-position counters)
    mean_accepted_length: float | None = None
    # the counters' deltas; accepted per position where the engine exports them (vLLM's `..._per_pos`)
    counts: DraftCounts = field(default_factory=DraftCounts, metadata=FLAT)
    source: str = "live"

    @property
    def per_position_acceptance(self) -> list[float]:
        """Δaccepted at draft position i / Δdrafts (empty where the engine exports no per-position counters)."""
        return self.counts.per_position_acceptance if self.counts.rounds else []

    @property
    def gamma(self) -> None:
        """The engine's γ is its own, not in its counters."""
        return None

    def extra(self) -> dict:
        return {"per_position_acceptance": self.per_position_acceptance, "drafts": self.counts.rounds,
                "draft_tokens": self.counts.proposed, "rounds": None}

    @classmethod
    def from_dict(cls, data: dict) -> LiveSample:
        """Also a record written before the counts were held: the counters' names, `rounds: null`."""
        renamed = {"rounds": data.get("drafts", 0.0), "proposed": data.get("draft_tokens", 0.0)}
        return from_dict(cls, {**data, **renamed})


def acceptance_between(first: Scrape, second: Scrape, min_draft_tokens: int = 1) -> LiveSample:
    """α = Δaccepted / Δdraft tokens and first-position acceptance = Δaccepted at position 0 / Δdrafts (the
    red line's quantity, where the engine exports per-position counters); a counter that went down means
    the engine restarted."""
    counts = delta(first, second).counts
    if counts.proposed < 0 or counts.accepted < 0 or counts.rounds < 0:
        return LiveSample(False, "counter reset between scrapes (engine restarted)")
    if counts.proposed < max(min_draft_tokens, 1):
        return LiveSample(False, f"only {counts.proposed:g} draft tokens between scrapes (minimum {min_draft_tokens})",
                          counts=counts)
    return LiveSample(True, acceptance_rate=counts.acceptance_rate, first_position_acceptance=counts.first_position_acceptance,
                      mean_accepted_length=counts.accepted_length, counts=counts)


def sample_live_acceptance(url: str, interval_s: float = 30.0, min_draft_tokens: int = 100) -> LiveSample:
    """Two scrapes `interval_s` apart (vLLM's or llama.cpp's counters, found by name). Any failure is a
    "no sample", never an acceptance of zero."""
    try:
        first = scrape(url)
        time.sleep(interval_s)
        second = scrape(url)
    except EngineRequestError as exc:  # names the page, masked
        return LiveSample(False, f"metrics page unreachable: {exc}")
    except (urllib.error.URLError, OSError) as exc:
        return LiveSample(False, f"metrics page unreachable: {mask_url(url)}: {exc}")
    except (ValueError, KeyError) as exc:
        return LiveSample(False, f"{mask_url(url)}: {exc}")
    return acceptance_between(first, second, min_draft_tokens)
