"""The EAGLE-3 drafter in the engine: lossless greedy and sampled, rollback, and proposals equal to a
from-scratch recomputation of the head over the target's features (no stale cache)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdistill.modeling.eagle3 import Eagle3Cache, FeatureHooks, init_eagle3_from_target
from specdistill.modeling.vocab import DraftVocab
from specdistill.speculative import SamplingConfig, generate
from specdistill.speculative.eagle import EagleDrafter
from tests.conftest import lively, make_tiny_llama
from tests.test_speculative import chi_square_pvalue, exact_two_token_distribution, sampled_two_token_counts

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 8  # small, so that a random head's drafts are accepted in some rounds and rejected in others


def tiny_target(seed: int, vocab: int = VOCAB, layers: int = 4, hidden: int = 32, std: float = 0.4):
    return lively(make_tiny_llama(vocab_size=vocab, hidden=hidden, layers=layers, seed=seed), seed, std=std)


def random_head(target, seed: int, keep: list[int] | None = None, layers: list[int] | None = None, noise: float = 0.3):
    """An untrained head started from the target, with noise so that every input matters."""
    vocab = target.config.vocab_size
    head = init_eagle3_from_target(target, DraftVocab(torch.tensor(keep if keep else range(vocab)), vocab), layers)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * noise)
    return head.eval()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    reduced=st.booleans(),
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
    gamma=st.integers(1, 6),
    max_new=st.integers(1, 16),
    stop=st.sampled_from([None, [], [2], [2, 5]]),
)
def test_greedy_eagle_equals_target_only(seed, reduced, prompt, gamma, max_new, stop):
    target = tiny_target(seed)
    drafter = EagleDrafter(random_head(target, seed, [0, 2, 3, 5, 6] if reduced else None), target)
    base = generate(target, prompt, max_new_tokens=max_new, stop_token_ids=stop)
    spec = generate(target, prompt, max_new_tokens=max_new, drafter=drafter, gamma=gamma, stop_token_ids=stop)
    assert spec.output_ids == base.output_ids
    s = spec.stats
    assert 0 <= s.accepted <= s.proposed <= gamma * s.rounds
    if stop == []:
        assert s.generated_tokens == s.accepted + s.target_forwards
    assert not any(layer._forward_pre_hooks for layer in target.model.layers)  # hooks removed after generate


def test_rounds_with_acceptance_and_rejection_occur():
    """The property test means something only if both accepted and rejected drafts occur."""
    accepted = rejected = 0
    for seed in range(4):
        target = tiny_target(seed)
        stats = generate(target, [1, 4, 3], max_new_tokens=24, drafter=EagleDrafter(random_head(target, seed), target),
                         gamma=3, stop_token_ids=[]).stats
        accepted += stats.accepted
        rejected += stats.proposed - stats.accepted
    assert accepted > 5 and rejected > 5


class RecordingDrafter(EagleDrafter):
    """Remembers what it was asked and what it proposed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[list[int], list[int]]] = []

    def propose(self, tokens, k, config, generator):
        ids, q = super().propose(tokens, k, config, generator)
        self.calls.append((tokens.tolist(), ids.tolist()))
        return ids, q


@torch.inference_mode()
def from_scratch(head, target, tokens: list[int], k: int) -> list[int]:
    """The k greedy drafts after `tokens`, recomputed with a fresh cache from a full target forward."""
    L = len(tokens)
    with FeatureHooks(target, head.aux_layers) as hooks:
        target(input_ids=torch.tensor([tokens[: L - 1]]))
        features = hooks.take()
    cache = Eagle3Cache()
    ids = torch.tensor([tokens])
    hidden = head(ids[:, 1:L], head.project(features), torch.arange(L - 1)[None], cache)[:, -1:]
    out = []
    for i in range(k):
        d = int(head.logits(hidden)[0, -1].argmax())
        out.append(d + int(head.d2t[d]))
        hidden = head(torch.tensor([[out[-1]]]), hidden, torch.tensor([[L - 1 + i]]), cache)
    return out


@pytest.mark.parametrize("reduced", [False, True])
def test_proposals_equal_a_from_scratch_recomputation(reduced):
    target = tiny_target(7)
    head = random_head(target, 7, [0, 1, 2, 4, 6, 7] if reduced else None)
    drafter = RecordingDrafter(head, target)
    out = generate(target, [3, 1, 4, 1, 5], max_new_tokens=30, drafter=drafter, gamma=4, stop_token_ids=[])
    assert out.stats.rounds >= 5 and 0 < out.stats.accepted < out.stats.proposed
    for tokens, ids in drafter.calls:
        assert ids == from_scratch(head, target, tokens, len(ids)), f"stale drafting state after {len(tokens)} tokens"


def test_rollback_keeps_only_entries_built_from_target_features():
    target = tiny_target(5)
    drafter = EagleDrafter(random_head(target, 5), target)
    prompt = [1, 2, 3, 4]
    out = generate(target, prompt, max_new_tokens=20, drafter=drafter, gamma=4, stop_token_ids=[])
    total = len(prompt) + len(out.output_ids)
    # after the last round: features for every token but the newest, speculative entries dropped
    assert drafter.featured == total - 1
    assert drafter.cache.length == drafter.committed <= total - 1

    # by hand: a round proposes 4 (3 speculative entries), the target keeps 1 draft plus its own token
    drafter.reset()
    tokens = torch.tensor(prompt)
    with FeatureHooks(target, drafter.feature_layers) as hooks:
        target(input_ids=tokens[None, :-1])
        drafter.add_features(hooks.take()[0])
    greedy = SamplingConfig()
    drafter.propose(tokens, 4, greedy, None)
    assert drafter.cache.length == 3 + 3  # committed entries 0..2, then 3 speculative ones
    drafter.rollback(len(prompt) + 1)
    assert drafter.cache.length == drafter.committed == 3
    with pytest.raises(RuntimeError, match="features for 3 positions, needs 5"):
        drafter.propose(torch.tensor(prompt + [6, 7]), 2, greedy, None)
    with pytest.raises(RuntimeError, match="3 positions are committed"):
        drafter.rollback(3)


def test_hooks_are_removed_when_drafting_fails(monkeypatch):
    target = tiny_target(2)
    drafter = EagleDrafter(random_head(target, 2), target)

    def broken(*args, **kwargs):
        raise RuntimeError("draft failed")

    monkeypatch.setattr(drafter, "propose", broken)
    with pytest.raises(RuntimeError, match="draft failed"):
        generate(target, [1, 2], max_new_tokens=5, drafter=drafter, gamma=2)
    assert not any(layer._forward_pre_hooks for layer in target.model.layers)


@pytest.mark.e2e  # seconds of sampling: the slow tier
def test_eagle_sampling_matches_target_distribution():
    torch.manual_seed(0)
    target = tiny_target(11, vocab=6, layers=2, hidden=16, std=0.2)
    drafter = EagleDrafter(random_head(target, 11, [0, 1, 3, 4], layers=[0, 1, 1], noise=0.5), target)
    config = SamplingConfig(temperature=1.0, top_p=0.95)
    prompt = [1, 3, 1, 3]
    expected = exact_two_token_distribution(target, prompt, config)
    counts = sampled_two_token_counts(target, drafter, prompt, config, 500)
    assert chi_square_pvalue(counts, expected) > 1e-3
