"""Policy: every decision taken on measured numbers, in one place (docs/metrics.md has the definitions).

- **the red line**: first-position acceptance (accepted at draft position 1 / drafting rounds) below
  `RED_LINE`. Unlike α = accepted / proposed, which falls as γ grows (a good head at γ=5 shows α ≈ 0.25
  while it gives 1.6x), it does not depend on γ, every engine exposes it (vLLM's
  `..._per_pos{position="0"}` / `num_drafts`) and for a one-token draft it is the seeds' per-token
  acceptance. α at the served γ is reported beside it.
- **the gate**: may a challenger replace the champion (`evaluate`)?
- **the serving choice and its no-slowdown guard** (`fastest_mode`): the fastest lossless mode, written
  only when a lower confidence bound of its per-prompt speedups (a seeded bootstrap over prompts)
  beats target-only by the margin, so a mean carried by a few prompts is not served.
- **the monitor's decision** (`judge_acceptance`): keep, fall back (under the red line), or retrain
  (a relative drop from the champion's own first-position acceptance at registration).
"""

from specdistill.ops.policy.common import (
    CONFIDENCE,
    DEFAULT_MARGIN,
    FIRST_POSITION_TAG,
    MAX_RELATIVE_DROP,
    MIN_SERVED_PROMPTS,
    RED_LINE,
    RESAMPLES,
    Role,
    Sample,
    first_position,
)
from specdistill.ops.policy.gate import PROFILES, Check, GateConfig, GateVerdict, evaluate, gate_config
from specdistill.ops.policy.red_line import Decision, decide, judge_acceptance
from specdistill.ops.policy.serving_choice import (
    PLAUSIBLE_FACTOR,
    Candidate,
    ServingChoice,
    fastest_mode,
    servable,
    speedup_lower_bound,
    unserved_faster_challenger,
)

__all__ = [
    "CONFIDENCE",
    "Candidate",
    "Check",
    "DEFAULT_MARGIN",
    "Decision",
    "FIRST_POSITION_TAG",
    "GateConfig",
    "GateVerdict",
    "MAX_RELATIVE_DROP",
    "MIN_SERVED_PROMPTS",
    "PLAUSIBLE_FACTOR",
    "PROFILES",
    "RED_LINE",
    "RESAMPLES",
    "Role",
    "Sample",
    "ServingChoice",
    "decide",
    "evaluate",
    "fastest_mode",
    "first_position",
    "gate_config",
    "judge_acceptance",
    "servable",
    "speedup_lower_bound",
    "unserved_faster_challenger",
]
