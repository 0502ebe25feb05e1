"""The acceptance formulas every layer shares (docs/metrics.md): the i.i.d. model's expected tokens
per round and ideal speedup, so the trainer's held-out estimate, the bench and the γ search cannot
drift apart. The red line and every decision taken on these numbers are in `ops.policy`."""

from __future__ import annotations

from dataclasses import dataclass, field

# Draft tokens per round where nothing chose γ yet (a first benchmark, the command line). The nightly then
# measures each drafter's own γ (`speculative.gamma`), and serving and the monitor use the measured one.
DEFAULT_GAMMA = 4
# Prompt lookup's n-gram window (min n, max n) where none was chosen: what plain `ngram` measures, so what
# serving.json names for it (vLLM's prompt_lookup_min/max, SGLang's match window, llama.cpp's ngram_n).
NGRAM_WINDOW = (1, 3)


@dataclass(frozen=True)
class DraftCounts:
    """The raw counts every acceptance number is computed from, as a serving engine's counters name them
    (vLLM's `spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`,
    `..._num_accepted_tokens_per_pos`): what the engine's requests, a replay and the log store's samples
    carry to the metrics exporter."""

    drafts: int  # drafting rounds (target forwards that verified at least one draft token)
    draft_tokens: int  # draft tokens proposed
    accepted: int  # draft tokens accepted (bonus tokens not counted)
    accepted_per_position: list[int] = field(default_factory=list)  # rounds whose draft token i was accepted

    @property
    def acceptance_rate(self) -> float | None:
        """α = accepted / draft tokens; None when nothing was proposed."""
        return self.accepted / self.draft_tokens if self.draft_tokens else None

    @property
    def accepted_length(self) -> float | None:
        """τ = 1 + accepted / drafts; None without a drafting round."""
        return 1 + self.accepted / self.drafts if self.drafts else None

    @property
    def first_position_acceptance(self) -> float | None:
        """Accepted at position 1 / drafts (the red line's quantity); None without per-position counts."""
        return self.accepted_per_position[0] / self.drafts if self.drafts and self.accepted_per_position else None


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """Tokens per target forward, bonus included: (1 − α^(γ+1)) / (1 − α) under i.i.d. acceptance."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def ideal_speedup(alpha: float, gamma: int, cost_ratio: float) -> float:
    """Expected tokens per round over the round's cost in target forwards (γ draft steps at c each)."""
    return expected_tokens_per_round(alpha, gamma) / (gamma * cost_ratio + 1)
