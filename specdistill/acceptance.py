"""The acceptance formulas every layer shares (docs/metrics.md): the i.i.d. model's expected tokens
per round and ideal speedup, so the trainer's held-out estimate, the bench and the γ search cannot
drift apart. The red line and every decision taken on these numbers are in `ops.policy`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

# Draft tokens per round where nothing chose γ yet (a first benchmark, the command line). The nightly then
# measures each drafter's own γ (`speculative.gamma`), and serving and the monitor use the measured one.
DEFAULT_GAMMA = 4
# Prompt lookup's n-gram window (min n, max n) where none was chosen: what plain `ngram` measures, so what
# serving.json names for it (vLLM's prompt_lookup_min/max, SGLang's match window, llama.cpp's ngram_n).
NGRAM_WINDOW = (1, 3)


@dataclass
class DraftCounts:
    """The raw counts every acceptance number is computed from, and those numbers (docs/metrics.md), once:
    what the decoding loop counts per request, the benchmarks sum, a replay and a live engine's sample hold and the
    log store and the metrics exporter carry. A serving engine's counters name them `spec_decode_num_drafts`
    (rounds), `..._num_draft_tokens` (proposed), `..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`;
    a live engine's deltas are floats."""

    rounds: int = 0  # drafting rounds (target forwards that verified at least one draft token)
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted (bonus tokens not counted)
    accepted_per_position: list[int] = field(default_factory=list)  # rounds whose draft token i was accepted
    proposed_per_position: list[int] = field(default_factory=list)  # rounds that drafted a token at position i
    # tree rounds (greedy): tokens of runner-up branches accepted where the chain (the drafter's first choice)
    # was not; in τ, not in α (α stays the chain's acceptance, what a chain-verifying server sees)
    runner_ups_accepted: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """α = accepted / proposed draft tokens (bonus tokens not counted); None when nothing was proposed."""
        return self.accepted / self.proposed if self.proposed else None

    @property
    def accepted_length(self) -> float | None:
        """τ = 1 + accepted / drafting rounds: tokens per verifying target forward, bonus (and tree runner-ups)
        included; None without a drafting round."""
        return 1 + (self.accepted + self.runner_ups_accepted) / self.rounds if self.rounds else None

    @property
    def per_position_acceptance(self) -> list[float]:
        """Share of drafting rounds in which the draft token at position i was accepted."""
        return [a / self.rounds if self.rounds else 0.0 for a in self.accepted_per_position]

    @property
    def first_position_acceptance(self) -> float | None:
        """Accepted at position 1 / drafting rounds (the red line's quantity); None without per-position counts."""
        return self.accepted_per_position[0] / self.rounds if self.rounds and self.accepted_per_position else None

    def record_round(self, proposed: int, accepted: int) -> None:
        """One drafting round: `proposed` drafts verified, the first `accepted` of them kept."""
        self.rounds += 1
        self.proposed += proposed
        self.accepted += accepted
        grow = proposed - len(self.proposed_per_position)
        if grow > 0:
            self.proposed_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(proposed):
            self.proposed_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def __add__(self, other: DraftCounts) -> DraftCounts:
        """Counts of both, added position by position."""
        return DraftCounts(self.rounds + other.rounds, self.proposed + other.proposed, self.accepted + other.accepted,
                           _add_positions(self.accepted_per_position, other.accepted_per_position),
                           _add_positions(self.proposed_per_position, other.proposed_per_position),
                           self.runner_ups_accepted + other.runner_ups_accepted)

    def over(self, gamma: int) -> DraftCounts:
        """These counts with accepted per position over exactly `gamma` positions (a replay's, the log store's)."""
        return replace(self, accepted_per_position=(list(self.accepted_per_position) + [0] * gamma)[:gamma])

    def served(self, gamma: int) -> DraftCounts:
        """The counts a chain-verifying engine's counters show, over `gamma` positions: what the log store's
        samples and the metrics exporter carry (no tree runner-ups, no proposed per position)."""
        return DraftCounts(self.rounds, self.proposed, self.accepted, self.over(gamma).accepted_per_position)


def _add_positions(a: list, b: list) -> list:
    """Two per-position lists added position by position (the shorter one padded with zeros)."""
    return [x + y for x, y in itertools.zip_longest(a, b, fillvalue=0)]


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """Tokens per target forward, bonus included: (1 − α^(γ+1)) / (1 − α) under i.i.d. acceptance."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def ideal_speedup(alpha: float, gamma: int, cost_ratio: float) -> float:
    """Expected tokens per round over the round's cost in target forwards (γ draft steps at c each)."""
    return expected_tokens_per_round(alpha, gamma) / (gamma * cost_ratio + 1)
