"""What the gate, the serving choice and the monitor share: the red line, the roles of drafts,
first-position acceptance read from a bench result or a sample (docs/metrics.md), and the monitor's
decision on a sample of the champion's acceptance: keep, fall back, or retrain."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Protocol

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
# the shape it was measured at (and is served at): draft tokens per round, first-position candidates (1: a chain);
# the monitor replays it at this shape, so the red line reads the same quantity at the gate and in production
SHAPE_GAMMA_TAG, SHAPE_TREE_TAG = "measured_gamma", "measured_tree_width"


class Role(StrEnum):
    """What a draft is to a nightly run; its benchmark entry is keyed by its role (draft-free modes by
    their own names: `self-spec:8`, `ngram`)."""

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


class Decision(StrEnum):
    """What a monitor run decided; its value is what the log store, MLflow and the JSON record hold."""

    KEEP = "keep"  # the champion's first-position acceptance holds
    FALLBACK = "fallback"  # under the red line: serve the fastest fallback and retrain
    RETRAIN = "retrain"  # above the line but drifted from the champion's own at registration: keep it, retrain
    NO_SAMPLE = "no-sample"  # nothing to decide on
    NO_CHAMPION = "no-champion"  # nothing served to sample (the flow's, before any sample)


def judge_acceptance(sample: Sample, red_line: float = RED_LINE, *, registered: float | None = None,
                     max_relative_drop: float = MAX_RELATIVE_DROP, target_changed: bool = True) -> tuple[Decision, str]:
    """(decision, why) for a sample of the champion's acceptance; `registered` is the champion's own
    first-position acceptance at registration, which a drop of more than `max_relative_drop` calls drift.
    With the champion's own target still served (`target_changed` false), a replay whose 95% interval still
    reaches the red line keeps it: a champion gated at 0.500 reads under the line on half of all 12-prompt
    replays by chance alone (the unchanged demo state fell back and retrained on 0.47), and falling back
    then would trade a gated draft for noise. After a target change the point estimate decides, as before."""
    if not sample.ok:
        return Decision.NO_SAMPLE, sample.reason or "no sample"
    first, source = first_position(sample)
    if first is None:
        return Decision.NO_SAMPLE, "the sample carries no acceptance"
    alpha, gamma = sample.acceptance_rate, sample.gamma
    at = f"γ={gamma}" if gamma else "the served γ"
    seen = f"{source} acceptance {first:.3f}" + (f" (α {alpha:.3f} at {at})" if alpha is not None and source == "first-position" else "")
    interval = getattr(sample, "interval", None)  # a replay's; a live engine's counters carry none
    if first < red_line and not target_changed and interval and interval[1] >= red_line:
        return Decision.KEEP, (f"{seen} < red line {red_line:.2f}, but its 95% interval {interval[0]:.3f}-{interval[1]:.3f} "
                               "reaches the line and the champion's target is unchanged: no evidence it fell under")
    if first < red_line:
        return Decision.FALLBACK, f"{seen} < red line {red_line:.2f}"
    if registered and first < registered * (1.0 - max_relative_drop):
        return Decision.RETRAIN, (f"{seen} is {1 - first / registered:.0%} under the champion's {registered:.3f} at "
                                  f"registration (more than {max_relative_drop:.0%}): drift")
    return Decision.KEEP, f"{seen} >= red line {red_line:.2f}" + (f", champion's at registration {registered:.3f}" if registered else "")


def decide(sample: Sample, red_line: float = RED_LINE, **kwargs: Any) -> Decision:
    return judge_acceptance(sample, red_line, **kwargs)[0]
