"""A serving engine's Prometheus `/metrics` page: its speculative-decoding counters.

vLLM (`vllm:spec_decode_*`) and llama.cpp (`llamacpp:spec_decode_*`) name them alike; acceptance
between two scrapes is Δaccepted / Δdraft tokens, a ratio of sums over every label set.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

ENGINE_PREFIXES = ("vllm:", "llamacpp:")
COUNTERS = {
    "spec_decode_num_drafts_total": "drafts",
    "spec_decode_num_draft_tokens_total": "draft_tokens",
    "spec_decode_num_accepted_tokens_total": "accepted",
}


@dataclass
class Scrape:
    drafts: float
    draft_tokens: float
    accepted: float
    prefix: str = ""  # the engine whose names were found ("vllm:", "llamacpp:", ...)
    accepted_per_position: list[float] = field(default_factory=list)  # accepted at draft position i (0-based)


PER_POSITION = "spec_decode_num_accepted_tokens_per_pos_total"


def _samples(text: str) -> tuple[dict[str, float], dict[str, dict[int, float]]]:
    """Totals per sample name (summed over label sets), and per-position counters by position."""
    totals: dict[str, float] = {}
    positions: dict[str, dict[int, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
                if sample.name.endswith(PER_POSITION) and "position" in sample.labels:
                    by_pos = positions.setdefault(sample.name, {})
                    pos = int(sample.labels["position"])
                    by_pos[pos] = by_pos.get(pos, 0.0) + float(sample.value)
    except Exception as exc:  # the parser raises ValueError and others on malformed pages
        raise ValueError(f"malformed metrics page: {exc}") from exc
    return totals, positions


def parse_spec_decode_counters(text: str, prefix: str | None = None) -> Scrape:
    """Sum the spec-decode counters over every label set (engines, models) of one /metrics page.
    `prefix=None` finds the engine by its names (vLLM's or llama.cpp's)."""
    totals, positions = _samples(text)
    candidates = [prefix] if prefix is not None else list(ENGINE_PREFIXES)
    for p in candidates:
        if all(p + name in totals for name in COUNTERS):
            by_pos = positions.get(p + PER_POSITION, {})
            per_position = [by_pos.get(i, 0.0) for i in range(max(by_pos) + 1)] if by_pos else []
            return Scrape(**{key: totals[p + name] for name, key in COUNTERS.items()}, prefix=p,
                          accepted_per_position=per_position)
    wanted = candidates[0] if len(candidates) == 1 else "{" + ",".join(candidates) + "}"
    missing = [wanted + name for name in COUNTERS if not any(p + name in totals for p in candidates)]
    raise KeyError(f"metrics page lacks {', '.join(missing or [wanted + 'spec_decode_* (incomplete set)'])}")


def delta(before: Scrape, after: Scrape) -> Scrape:
    pos = [a - (before.accepted_per_position[i] if i < len(before.accepted_per_position) else 0.0)
           for i, a in enumerate(after.accepted_per_position)]
    return Scrape(after.drafts - before.drafts, after.draft_tokens - before.draft_tokens,
                  after.accepted - before.accepted, prefix=after.prefix, accepted_per_position=pos)


def scrape(url: str, timeout_s: float = 5.0, prefix: str | None = None) -> Scrape:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return parse_spec_decode_counters(response.read().decode("utf-8", errors="replace"), prefix)
