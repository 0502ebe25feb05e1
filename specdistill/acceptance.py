"""The acceptance definitions every layer shares (docs/metrics.md): the red line, and the i.i.d.
model's expected tokens per round and ideal speedup, so the trainer's held-out estimate, the bench,
the gate and the monitor cannot drift apart."""

from __future__ import annotations

# Below this acceptance rate the champion is no longer worth serving: the monitor falls back and
# retrains, and the default gate refuses a challenger.
ACCEPTANCE_RED_LINE = 0.5


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """Tokens per target forward, bonus included: (1 − α^(γ+1)) / (1 − α) under i.i.d. acceptance."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def ideal_speedup(alpha: float, gamma: int, cost_ratio: float) -> float:
    """Expected tokens per round over the round's cost in target forwards (γ draft steps at c each)."""
    return expected_tokens_per_round(alpha, gamma) / (gamma * cost_ratio + 1)
