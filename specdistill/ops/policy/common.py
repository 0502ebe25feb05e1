"""What the gate, the serving choice and the monitor share: the red line, the roles of drafts, and
first-position acceptance read from a bench result or a sample of the champion's acceptance
(docs/metrics.md)."""

from __future__ import annotations

from enum import StrEnum
from typing import Protocol

from specdistill.data.results import BenchResult

RED_LINE = 0.5  # first-position acceptance below this: the draft is not worth serving
MAX_RELATIVE_DROP = 0.2  # first-position acceptance this far (relatively) under the champion's own at registration: drift
DEFAULT_MARGIN = 0.05  # a mode must beat target-only by more than this to be served
CONFIDENCE = 0.95  # one-sided level of the speedup's lower bound
RESAMPLES = 2000
# held-out prompts a decision reads: per-prompt numbers from fewer (a benchmark its time budget cut) are the
# mean of a few, not a measurement; the gate and the serving choice both want at least this many
MIN_SERVED_PROMPTS = 5
FIRST_POSITION_TAG = "first_position_acceptance"  # a registered draft version's own, at registration


class Role(StrEnum):
    """What a draft is to a nightly run; its benchmark entry is keyed by its role (draft-free modes by
    their own names: `self-spec@8`, `ngram`)."""

    CHALLENGER = "challenger"  # distilled this run
    CHAMPION = "champion"  # the registry's current best draft (its `champion` alias)
    GENERIC = "generic"  # the off-the-shelf baseline: measured to set a bar (`must_beat`), never served

    @classmethod
    def served(cls, name: str) -> bool:
        """May the entry named `name` be served at all (before the gate has its say)?"""
        return name != cls.GENERIC


class Sample(Protocol):
    """What the monitor's decision reads of a sample of the champion's acceptance: a replay's
    `ops.replay.AcceptanceSample` or a live engine's `ops.metrics.LiveSample` (whose γ is the engine's,
    unknown here: None)."""

    ok: bool
    reason: str
    acceptance_rate: float | None
    first_position_acceptance: float | None  # None: no per-position counts
    per_position_acceptance: list[float]

    @property
    def gamma(self) -> int | None: ...


def first_position(result: BenchResult | Sample) -> tuple[float | None, str]:
    """(first-position acceptance, where it came from) of a bench result or a sample.

    A sample's own `first_position_acceptance` wins, then `per_position_acceptance[0]`; a source that
    recorded no per-position counts (an engine without them) gives α in its place, said so. (A bench
    result's `first_position_acceptance` is derived from its per-position list, 0.0 without one: not read.)"""
    value = None if isinstance(result, BenchResult) else result.first_position_acceptance
    if value is not None:
        return float(value), "first-position"
    if result.per_position_acceptance:
        return float(result.per_position_acceptance[0]), "first-position"
    alpha = result.acceptance_rate
    return (None, "none") if alpha is None else (float(alpha), "α (no per-position counts)")
