"""The hybrid drafter: the suffix drafter where its match is confident, the distilled draft elsewhere.

As SuffixDecoding's hybrid with EAGLE: each round the suffix drafter looks up its proposal first (it
costs a fraction of a millisecond); when the proposal's score (the expected number of accepted
tokens under the corpus's frequencies) reaches `threshold`, it is verified as it is and the model
drafts nothing that round; otherwise the model drafts. The model drafter still sees every accepted
token (its cache catches up on its next round; an EAGLE head keeps receiving the target's features),
so switching costs nothing. `benchmarks/suffix.py` measures the threshold.
"""

from __future__ import annotations

import torch

from specdistill.speculative.drafters import Drafter
from specdistill.speculative.suffix import SuffixDrafter

HYBRID_THRESHOLD = 2.0  # expected accepted suffix tokens; benchmarks/suffix.py measures the sweep


class HybridDrafter(Drafter):
    def __init__(self, model, suffix: SuffixDrafter, threshold: float = HYBRID_THRESHOLD, name: str | None = None,
                 model_gamma: int | None = None):
        """`model_gamma` caps the model's draft (its own best γ) while the suffix drafts up to the round's γ."""
        if threshold < 0:
            raise ValueError(f"hybrid threshold (expected accepted suffix tokens) must be >= 0, got {threshold}")
        self.inner, self.suffix, self.threshold, self.model_gamma = model, suffix, threshold, model_gamma
        self.name = name or f"hybrid:{model.name}+{suffix.name}@{threshold:g}"
        self.model = model.model  # the decoding loop routes a draft model's attention by it
        self.tree_width = model.tree_width
        self.feature_layers = model.feature_layers
        self.suffix_rounds = self.model_rounds = 0

    def add_features(self, features: torch.Tensor) -> None:
        self.inner.add_features(features)

    def parts(self) -> list:
        return [self.inner, self.suffix]

    def reset(self) -> None:
        self.inner.reset()
        self.suffix.reset()

    def _confident(self, tokens: torch.Tensor, k: int, alternatives: int = 0):
        d = self.suffix.draft(tokens, k, alternatives)
        use = bool(d.tokens) and d.score >= self.threshold
        self.suffix_rounds += use
        self.model_rounds += not use
        return d if use else None

    def propose(self, tokens, k, config, generator):
        d = self._confident(tokens, k)
        if d is not None:
            return torch.tensor(d.tokens, dtype=torch.long), None
        return self.inner.propose(tokens, min(k, self.model_gamma or k), config, generator)

    def propose_tree(self, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, list[int]]:
        d = self._confident(tokens, k, self.tree_width - 1)
        if d is None:
            return self.inner.propose_tree(tokens, min(k, self.model_gamma or k))
        return self.suffix.tree(d, self.tree_width)

    def rollback(self, valid_len: int) -> None:
        self.inner.rollback(valid_len)
