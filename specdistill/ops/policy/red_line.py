"""The monitor's decision on a sample of the champion's acceptance: keep, fall back, or retrain."""

from __future__ import annotations

from typing import Any

from specdistill.ops.policy.common import MAX_RELATIVE_DROP, RED_LINE, _get, first_position


def judge_acceptance(sample: Any, red_line: float = RED_LINE, *, registered: float | None = None,
                     max_relative_drop: float = MAX_RELATIVE_DROP) -> tuple[str, str]:
    """(decision, why) for a sample of the champion's acceptance (a replay AcceptanceSample, a live
    LiveSample, or their dicts):

    - no-sample: nothing to decide on;
    - fallback: first-position acceptance under the red line: serve the fastest fallback and retrain;
    - retrain: above the line but more than `max_relative_drop` (relatively) under the champion's own
      first-position acceptance at registration (`registered`): the target drifted; keep serving the
      champion and start an incremental run;
    - keep."""
    if not _get(sample, "ok", False):
        return "no-sample", _get(sample, "reason", "") or "no sample"
    first, source = first_position(sample)
    if first is None:
        return "no-sample", "the sample carries no acceptance"
    alpha, gamma = _get(sample, "acceptance_rate"), _get(sample, "gamma")
    at = f"γ={gamma}" if gamma else "the served γ"
    seen = f"{source} acceptance {first:.3f}" + (f" (α {alpha:.3f} at {at})" if alpha is not None and source == "first-position" else "")
    if first < red_line:
        return "fallback", f"{seen} < red line {red_line:.2f}"
    if registered and first < registered * (1.0 - max_relative_drop):
        return "retrain", (f"{seen} is {1 - first / registered:.0%} under the champion's {registered:.3f} at registration "
                           f"(more than {max_relative_drop:.0%}): drift")
    return "keep", f"{seen} >= red line {red_line:.2f}" + (f", champion's at registration {registered:.3f}" if registered else "")


def decide(sample: Any, red_line: float | None = None, **kwargs: Any) -> str:
    """keep | fallback | retrain | no-sample (see `judge_acceptance`)."""
    return judge_acceptance(sample, RED_LINE if red_line is None else red_line, **kwargs)[0]
