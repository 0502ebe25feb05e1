"""Policy: every decision taken on measured numbers, in one place (docs/metrics.md has the definitions):
the gate (`evaluate`), the serving choice (`fastest_mode`) and the monitor's decision (`judge_acceptance`).

The red line reads first-position acceptance (accepted at draft position 1 / drafting rounds), not
α = accepted / proposed, which falls as γ grows (a good head at γ=5 shows α ≈ 0.25 while it gives 1.6x):
it does not depend on γ, and every engine exposes it (vLLM's `..._per_pos{position="0"}` / `num_drafts`).
"""

from specdistill.ops.policy.common import (
    CONFIDENCE,
    DEFAULT_MARGIN,
    FIRST_POSITION_TAG,
    MAX_RELATIVE_DROP,
    MIN_SERVED_PROMPTS,
    RED_LINE,
    SHAPE_GAMMA_TAG,
    SHAPE_TREE_TAG,
    Decision,
    Role,
    decide,
    first_position,
    judge_acceptance,
)
from specdistill.ops.policy.gate import PROFILES, Check, GateConfig, GateVerdict, evaluate, gate_config
from specdistill.ops.policy.serving_choice import (
    PLAUSIBLE_FACTOR,
    Candidate,
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
    "SHAPE_GAMMA_TAG",
    "SHAPE_TREE_TAG",
    "GateConfig",
    "GateVerdict",
    "MAX_RELATIVE_DROP",
    "MIN_SERVED_PROMPTS",
    "PLAUSIBLE_FACTOR",
    "PROFILES",
    "RED_LINE",
    "Role",
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
