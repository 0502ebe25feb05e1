"""The monitor's decision on a sample of the champion's acceptance: keep, fall back, or retrain."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from specdistill.ops.policy.common import MAX_RELATIVE_DROP, RED_LINE, Sample, first_position


class Decision(StrEnum):
    """What a monitor run decided; its value is what the log store, MLflow and the JSON record hold."""

    KEEP = "keep"  # the champion's first-position acceptance holds
    FALLBACK = "fallback"  # under the red line: serve the fastest fallback and retrain
    RETRAIN = "retrain"  # above the line but drifted from the champion's own at registration
    NO_SAMPLE = "no-sample"  # nothing to decide on
    NO_CHAMPION = "no-champion"  # nothing served to sample (the flow's, before any sample)


def judge_acceptance(sample: Sample, red_line: float = RED_LINE, *, registered: float | None = None,
                     max_relative_drop: float = MAX_RELATIVE_DROP) -> tuple[Decision, str]:
    """(decision, why) for a sample of the champion's acceptance (a replay AcceptanceSample or a live
    LiveSample):

    - no-sample: nothing to decide on;
    - fallback: first-position acceptance under the red line: serve the fastest fallback and retrain;
    - retrain: above the line but more than `max_relative_drop` (relatively) under the champion's own
      first-position acceptance at registration (`registered`): the target drifted; keep serving the
      champion and start an incremental run;
    - keep."""
    if not sample.ok:
        return Decision.NO_SAMPLE, sample.reason or "no sample"
    first, source = first_position(sample)
    if first is None:
        return Decision.NO_SAMPLE, "the sample carries no acceptance"
    alpha, gamma = sample.acceptance_rate, sample.gamma
    at = f"γ={gamma}" if gamma else "the served γ"
    seen = f"{source} acceptance {first:.3f}" + (f" (α {alpha:.3f} at {at})" if alpha is not None and source == "first-position" else "")
    if first < red_line:
        return Decision.FALLBACK, f"{seen} < red line {red_line:.2f}"
    if registered and first < registered * (1.0 - max_relative_drop):
        return Decision.RETRAIN, (f"{seen} is {1 - first / registered:.0%} under the champion's {registered:.3f} at "
                                  f"registration (more than {max_relative_drop:.0%}): drift")
    return Decision.KEEP, f"{seen} >= red line {red_line:.2f}" + (f", champion's at registration {registered:.3f}" if registered else "")


def decide(sample: Sample, red_line: float | None = None, **kwargs: Any) -> Decision:
    """keep | fallback | retrain | no-sample (see `judge_acceptance`)."""
    return judge_acceptance(sample, RED_LINE if red_line is None else red_line, **kwargs)[0]
