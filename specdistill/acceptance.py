"""The acceptance formulas every layer shares (docs/metrics.md): the i.i.d. model's expected tokens
per round and ideal speedup, so the trainer's held-out estimate, the bench and the γ search cannot
drift apart. The red line and every decision taken on these numbers are in `ops.policy`."""

from __future__ import annotations

# Draft tokens per round where nothing chose γ yet (a first benchmark, the command line). The nightly then
# measures each drafter's own γ (`speculative.gamma`), and serving and the monitor use the measured one.
DEFAULT_GAMMA = 4
# Prompt lookup's n-gram window (min n, max n) where none was chosen: what plain `ngram` measures, so what
# serving.json names for it (vLLM's prompt_lookup_min/max, SGLang's match window, llama.cpp's ngram_n).
NGRAM_WINDOW = (1, 3)


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """Tokens per target forward, bonus included: (1 − α^(γ+1)) / (1 − α) under i.i.d. acceptance."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def ideal_speedup(alpha: float, gamma: int, cost_ratio: float) -> float:
    """Expected tokens per round over the round's cost in target forwards (γ draft steps at c each)."""
    return expected_tokens_per_round(alpha, gamma) / (gamma * cost_ratio + 1)
