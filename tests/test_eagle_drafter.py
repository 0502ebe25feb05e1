"""The EAGLE-3 drafter in the decoding loop: lossless greedy and sampled, rollback, and proposals equal to a
from-scratch recomputation of the head over the target's features (no stale cache)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdistill.modeling.eagle3 import Eagle3Cache
from specdistill.modeling.eagle3_init import init_eagle3_from_target
from specdistill.modeling.feature_hooks import FeatureHooks
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
    width=st.integers(1, 4),
)
def test_greedy_eagle_equals_target_only(seed, reduced, prompt, gamma, max_new, stop, width):
    target = tiny_target(seed)
    drafter = EagleDrafter(random_head(target, seed, [0, 2, 3, 5, 6] if reduced else None), target, tree_width=width)
    base = generate(target, prompt, max_new_tokens=max_new, stop_token_ids=stop)
    spec = generate(target, prompt, max_new_tokens=max_new, drafter=drafter, gamma=gamma, stop_token_ids=stop)
    assert spec.output_ids == base.output_ids
    s, c = spec.stats, spec.stats.counts
    assert 0 <= c.accepted <= c.proposed <= gamma * c.rounds
    if stop == []:
        assert s.generated_tokens == c.accepted + c.runner_ups_accepted + s.target_forwards
    assert not any(layer._forward_pre_hooks for layer in target.model.layers)  # hooks removed after generate


def test_rounds_with_acceptance_and_rejection_occur():
    """The property test means something only if both accepted and rejected drafts occur."""
    accepted = rejected = 0
    for seed in range(4):
        target = tiny_target(seed)
        stats = generate(target, [1, 4, 3], max_new_tokens=24, drafter=EagleDrafter(random_head(target, seed), target),
                         gamma=3, stop_token_ids=[]).stats.counts
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
    c = out.stats.counts
    assert c.rounds >= 5 and 0 < c.accepted < c.proposed
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


def test_tree_accepts_runner_up_candidates_and_never_fewer_tokens_per_round():
    """Width 4 verifies the head's top 4 first-position candidates: rounds where a runner-up is the
    target's choice accept a token that the chain (width 1) rejects, for the same rounds."""
    chain_tau, tree_tau, runner_ups = [], [], 0
    for seed in range(4):
        target = tiny_target(seed)
        head = random_head(target, seed)
        chain = generate(target, [1, 4, 3], max_new_tokens=24, drafter=EagleDrafter(head, target), gamma=2, stop_token_ids=[])
        tree = generate(target, [1, 4, 3], max_new_tokens=24, drafter=EagleDrafter(head, target, tree_width=4), gamma=2,
                        stop_token_ids=[])
        assert tree.output_ids == chain.output_ids
        chain_tau.append(chain.stats.counts.accepted_length)
        tree_tau.append(tree.stats.counts.accepted_length)
        runner_ups += tree.stats.counts.runner_ups_accepted
        assert tree.stats.counts.accepted + tree.stats.counts.runner_ups_accepted <= 2 * tree.stats.counts.rounds
    assert runner_ups > 3
    assert sum(tree_tau) > sum(chain_tau)


def test_tree_verification_gives_each_node_its_own_branch_logits():
    """One tree forward equals separate chain forwards of each branch (fp32, exact argmax)."""
    from transformers import DynamicCache

    from specdistill.speculative.decode import greedy_path, keep_cache_rows, tree_inputs

    target = tiny_target(3)
    prefix = torch.tensor([1, 4, 3, 6, 2])
    ids, parents = torch.tensor([5, 7, 0, 2, 1]), [-1, 0, 1, -1, 3]  # branches: 5-7-0 and 2-1
    with torch.inference_mode():
        cache = DynamicCache(config=target.config)
        target(input_ids=prefix[:-1].unsqueeze(0), cache=cache, use_cache=True)
        input_ids, _, positions, mask = tree_inputs(prefix[-1], ids, parents, prefix.numel() - 1)
        choice = target(input_ids=input_ids.unsqueeze(0), attention_mask=mask, position_ids=positions, cache=cache,
                        use_cache=True).logits[0].argmax(-1)
        for branch in ([0, 1, 2], [3, 4]):
            seq = torch.cat([prefix, ids[branch]])
            want = target(input_ids=seq.unsqueeze(0)).logits[0, prefix.numel() - 1 :].argmax(-1)
            assert choice[[0, *(1 + i for i in branch)]].tolist() == want.tolist()
        # the walk follows the target's choices; the cache keeps the pending token and the path only
        fake = torch.tensor([2, 9, 9, 9, 1, 8])  # after pending: 2 (node 3), after node 3: 1 (node 4), then 8
        path, following = greedy_path(fake, ids, parents)
        assert path == [3, 4] and int(following) == 8
        keep_cache_rows(cache, prefix.numel() - 1, [0, 4, 5])
        assert cache.get_seq_length() == prefix.numel() + 2
        seq = torch.cat([prefix, ids[[3, 4]]])
        fresh = DynamicCache(config=target.config)
        target(input_ids=seq.unsqueeze(0), cache=fresh, use_cache=True)
        torch.testing.assert_close(cache.layers[0].keys, fresh.layers[0].keys)
        torch.testing.assert_close(cache.layers[-1].values, fresh.layers[-1].values)


@torch.inference_mode()
def branch_top(head, target, tokens: list[int], branch: list[int], w: int) -> tuple[list[int], list[float]]:
    """The head's top-w next drafts (target ids) and their log-probabilities after `branch`, drafted from scratch as a chain."""
    L = len(tokens)
    with FeatureHooks(target, head.aux_layers) as hooks:
        target(input_ids=torch.tensor([tokens[: L - 1]]))
        features = hooks.take()
    cache = Eagle3Cache()
    hidden = head(torch.tensor([tokens])[:, 1:L], head.project(features), torch.arange(L - 1)[None], cache)[:, -1:]
    for i, t in enumerate(branch):
        hidden = head(torch.tensor([[t]]), hidden, torch.tensor([[L - 1 + i]]), cache)
    logp, d = torch.log_softmax(head.logits(hidden)[0, -1].float(), -1).topk(w)
    return (d + head.d2t[d]).tolist(), logp.tolist()


@pytest.mark.parametrize("width, depth, budget", [(2, 3, None), (3, 4, 7), (4, 3, 12)])
def test_dynamic_tree_grows_each_branch_as_its_own_chain_would(width, depth, budget):
    """Every node of an EAGLE-2 tree is among its parent's top-w drafts recomputed from scratch along its branch
    (the tree's head entries see their own branch only); `budget` nodes, the likeliest, the top-1 chain first."""
    target = tiny_target(9, vocab=32)
    head = random_head(target, 9)
    drafter = EagleDrafter(head, target, tree_width=width, tree_budget=budget)
    tokens = [3, 1, 4, 1, 5, 9]
    drafter.reset()
    with FeatureHooks(target, drafter.feature_layers) as hooks:
        target(input_ids=torch.tensor([tokens[:-1]]))
        drafter.add_features(hooks.take()[0])
    ids, parents = drafter.propose_tree(torch.tensor(tokens), depth)
    ids = ids.tolist()
    assert len(ids) == (budget or depth + width - 1)

    def branch(n: int) -> list[int]:
        return branch(parents[n]) + [ids[n]] if n >= 0 else []

    score = {}
    for n in range(len(ids)):
        assert parents[n] < n
        top, logp = branch_top(head, target, tokens, branch(parents[n]), width)
        assert ids[n] in top, f"node {n} is not among its parent's top {width}"
        score[n] = score.get(parents[n], 0.0) + logp[top.index(ids[n])]
    chain = branch_top(head, target, tokens, [], 1)[0]
    assert ids[0] == chain[0] and parents[0] == -1
    depths = [len(branch(n)) for n in range(len(ids))]
    assert max(depths) <= depth and (len(ids) <= width or max(depths) >= 2)  # grown past the first position
    # a parent is always at least as likely as its child: the budget keeps whole branches
    assert all(score[n] <= score[parents[n]] + 1e-6 for n in range(len(ids)) if parents[n] >= 0)
    drafter.rollback(len(tokens))
    assert drafter.cache.length == drafter.committed  # every speculative entry dropped
