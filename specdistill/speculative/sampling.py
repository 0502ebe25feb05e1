"""Sampling and verification: the rule that makes speculative decoding lossless.

Greedy: a draft token is accepted while it equals the target's argmax; the first mismatch is
replaced by the target's own choice, so the output is the target's greedy output token for token.
Sampling (Leviathan et al., Chen et al.): accept x ~ q with probability min(1, p(x)/q(x)), on
rejection resample from norm(max(0, p - q)); when all drafts pass, the bonus token comes from p.
The output distribution is then exactly p, whatever q is, including a q that is zero outside a
reduced draft vocabulary or a one-hot q for copied (n-gram) drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingConfig:
    """temperature 0 means greedy; top_p < 1 keeps the smallest nucleus of mass >= top_p."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else torch.seed())
        return g


def probs_from_logits(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """The sampling distribution (temperature, then top-p) over the last dimension, in float32."""
    probs = torch.softmax(logits.float() / config.temperature, dim=-1)
    if config.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= config.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token id per row of `probs` (a 0-d tensor for a 1-d input)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def pick_token(
    logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A token from one row of logits (a drafter's or the target's), with the distribution q it was
    drawn from (None when greedy: q is then one-hot and verification needs no probabilities)."""
    if config.greedy:
        return logits.argmax(), None
    q = probs_from_logits(logits, config)
    return sample(q, generator), q


def verify(
    target_logits: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    config: SamplingConfig,
    generator: torch.Generator | None,
) -> tuple[int, torch.Tensor]:
    """Accept a prefix of the k drafts against the target's k+1 rows of logits.

    `draft_probs` is q over the full target vocabulary ([k, V]) or None for deterministic drafts
    (one-hot q: n-gram copies, or any greedy draft). Returns (accepted count n, the token that
    follows the accepted drafts: the target's correction, or the bonus token when n == k).
    """
    k = draft_ids.numel()
    if config.greedy:
        choice = target_logits.argmax(-1)
        n = int((draft_ids == choice[:k]).int().cumprod(0).sum())
        return n, choice[n]

    p = probs_from_logits(target_logits, config)
    rows = torch.arange(k)
    px = p[rows, draft_ids]
    qx = draft_probs[rows, draft_ids] if draft_probs is not None else torch.ones_like(px)
    u = torch.rand(k, generator=generator)
    rejected = (u * qx >= px).nonzero()  # accept with probability min(1, p/q)
    n = int(rejected[0, 0]) if rejected.numel() else k
    if n == k:
        return n, sample(p[k], generator)
    if draft_probs is not None:
        residual = (p[n] - draft_probs[n]).clamp_min_(0.0)
    else:
        residual = p[n].clone()
        residual[draft_ids[n]] = 0.0
    mass = residual.sum()
    if mass <= 0:  # p == q up to rounding: a rejection was (numerically) impossible; p is the answer
        return n, sample(p[n], generator)
    return n, sample(residual / mass, generator)
