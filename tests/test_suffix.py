"""The suffix drafter: its drafts equal a brute-force reading of the definition, its memory is bounded,
and the decoding loop stays lossless with it (greedy token for token, chain and tree; sampling by chi-square)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdistill.speculative import ModelDrafter, SamplingConfig, drafter_from_spec, generate
from specdistill.speculative.eagle import EagleDrafter
from specdistill.speculative.hybrid import HybridDrafter
from specdistill.speculative.specs import hybrid_parts
from specdistill.speculative.suffix import SuffixDraft, SuffixDrafter, SuffixIndex, SuffixParams
from specdistill.speculative.suffix_corpus import CorpusError, CorpusMeta, save_corpus
from tests.conftest import lively, make_tiny_llama
from tests.test_eagle_drafter import random_head, tiny_target
from tests.test_speculative import (
    SAMPLES,
    VOCAB,
    chi_square_pvalue,
    exact_two_token_distribution,
    noisy_copy,
    sampled_two_token_counts,
    tiny,
)

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------------------------
# The definition, read literally


def _path(seqs: list[list[int]], occurrences: list[tuple[int, int]], limit: int, min_prob: float):
    tokens, probs, prob = [], [], 1.0
    while len(tokens) < limit:
        live = [(s, e) for s, e in occurrences if e + 1 < len(seqs[s])]
        if not live:
            break
        counts: dict[int, int] = {}
        for s, e in live:
            counts[seqs[s][e + 1]] = counts.get(seqs[s][e + 1], 0) + 1
        t = min(counts, key=lambda t: (-counts[t], t))
        p = prob * counts[t] / len(live)
        if p < min_prob:
            break
        prob = p
        tokens.append(t)
        probs.append(p)
        occurrences = [(s, e + 1) for s, e in live if seqs[s][e + 1] == t]
    return tokens, probs


def reference_draft(seqs: list[list[int]], context: list[int], k: int, params: SuffixParams) -> SuffixDraft:
    """Every match length m, every occurrence of the context's last m tokens (with a continuation),
    the most frequent continuation (ties: smaller token), cut by probability and the adaptive limit;
    the best score wins, the longer match on ties."""
    best = SuffixDraft()
    for m in range(1, min(len(context), params.max_depth - 1) + 1):
        pattern = context[-m:]
        occ = [(s, e) for s, seq in enumerate(seqs) for e in range(m - 1, len(seq) - 1) if seq[e - m + 1 : e + 1] == pattern]
        if not occ:
            break
        tokens, probs = _path(seqs, occ, params.limit(m, k), params.min_token_prob)
        if tokens and (not best.tokens or sum(probs) >= best.score):
            best = SuffixDraft(tokens, probs, m)
    return best


def reference(corpus: list[list[int]], context: list[int], k: int, params: SuffixParams) -> SuffixDraft:
    mine = reference_draft([context], context, k, params)
    theirs = reference_draft(corpus, context[-(params.max_depth - 1):], k, params)
    return theirs if theirs.score > mine.score else mine


tokens_small = st.integers(0, 4)  # a tiny vocabulary: many repeats, long matches, ties
params_st = st.builds(SuffixParams, max_depth=st.integers(2, 10), max_spec_factor=st.sampled_from([0.5, 1.0, 2.0]),
                      max_spec_offset=st.sampled_from([0.0, 1.0]), min_token_prob=st.sampled_from([0.0, 0.1, 0.3, 0.6]),
                      max_occurrences=st.just(None))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(corpus=st.lists(st.lists(tokens_small, min_size=0, max_size=30), max_size=8),
       context=st.lists(tokens_small, min_size=1, max_size=30), k=st.integers(1, 8), params=params_st)
def test_draft_equals_brute_force_reference(corpus, context, k, params):
    drafter = SuffixDrafter(SuffixIndex(corpus), params)
    got = drafter.draft(torch.tensor(context), k)
    want = reference(corpus, context, k, params)
    assert (got.tokens, got.probs, got.match_len) == (want.tokens, want.probs, want.match_len)
    assert len(got.tokens) <= k and got.match_len + len(got.tokens) <= params.max_depth


@settings(max_examples=100, deadline=None)
@given(context=st.lists(tokens_small, min_size=1, max_size=40), params=params_st, cut=st.integers(1, 40))
def test_request_index_follows_the_sequence_as_it_grows(context, params, cut):
    """One drafter across a growing sequence (as the decoding loop calls it) drafts as a fresh one would."""
    drafter = SuffixDrafter(None, params)
    for n in range(1, len(context) + 1):
        got = drafter.draft(torch.tensor(context[:n]), 4)
        assert got.tokens == reference([], context[:n], 4, params).tokens
    shorter = context[: min(cut, len(context))]  # a new request without a reset
    assert drafter.draft(torch.tensor(shorter), 4).tokens == reference([], shorter, 4, params).tokens


def test_most_frequent_continuation_adaptive_length_and_source():
    corpus = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 9], [7, 7, 7]]
    drafter = SuffixDrafter(SuffixIndex(corpus), SuffixParams(min_token_prob=0.0))
    d = drafter.draft(torch.tensor([8, 1, 2, 3]), 8)
    assert d.tokens == [4, 5] and d.source == "corpus" and d.probs == pytest.approx([2 / 3, 2 / 3])
    # a 1-token match speculates 1 token with max_spec_factor 1; 2 with factor 2
    assert SuffixDrafter(SuffixIndex(corpus), SuffixParams(min_token_prob=0.0)).draft(torch.tensor([8, 3]), 8).tokens == [4]
    assert SuffixDrafter(SuffixIndex(corpus), SuffixParams(max_spec_factor=2.0, min_token_prob=0.0)).draft(
        torch.tensor([8, 3]), 8).tokens == [4, 5]
    # min_token_prob cuts the path where the frequency-estimated probability drops below it
    assert SuffixDrafter(SuffixIndex(corpus), SuffixParams(min_token_prob=0.7)).draft(torch.tensor([8, 1, 2, 3]), 8).tokens == []
    # the request's own repeat beats a weaker corpus match; an empty corpus leaves the request alone
    mine = SuffixDrafter(SuffixIndex(corpus)).draft(torch.tensor([1, 2, 3, 6, 6, 1, 2, 3]), 8)
    assert mine.source == "request" and mine.tokens == [6, 6, 1]
    assert SuffixDrafter(SuffixIndex([])).corpus is None


def test_tree_adds_runner_up_continuations_within_the_budget():
    corpus = [[1, 2, 3, 4, 5]] * 3 + [[1, 2, 3, 9, 9]] * 2 + [[1, 2, 3, 4, 8]]
    drafter = SuffixDrafter(SuffixIndex(corpus), SuffixParams(min_token_prob=0.1), tree_width=3)
    ids, parents = drafter.propose_tree(torch.tensor([0, 1, 2, 3]), 3)
    # chain 4 (p 4/6), 5 (p 3/6); runner-ups: 9 beside 4 (p 2/6), 8 beside 5 (p 1/6)
    assert ids.tolist() == [4, 5, 9, 8] and parents == [-1, 0, -1, 0]
    drafter.tree_width = 2
    ids, parents = drafter.propose_tree(torch.tensor([0, 1, 2, 3]), 3)
    assert ids.tolist() == [4, 5, 9] and parents == [-1, 0, -1]


def test_large_occurrence_sets_are_counted_on_a_sample():
    rng = np.random.default_rng(0)
    corpus = [[5, int(t)] for t in rng.choice([1, 2], size=20_000, p=[0.7, 0.3])]
    exact = SuffixDrafter(SuffixIndex(corpus), SuffixParams(max_occurrences=None, max_spec_factor=1)).draft([5], 1)
    sampled = SuffixDrafter(SuffixIndex(corpus), SuffixParams(max_occurrences=512, max_spec_factor=1)).draft([5], 1)
    assert exact.tokens == sampled.tokens == [1]
    assert abs(exact.probs[0] - sampled.probs[0]) < 0.02


# --------------------------------------------------------------------------------------------
# The decoding loop with a suffix drafter


def _own_answers(target, prompts, n=24):
    return [generate(target, p, max_new_tokens=n, stop_token_ids=[]).output_ids for p in prompts]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
       gamma=st.integers(1, 6), max_new=st.integers(1, 16), stop=st.sampled_from([None, [], [2, 7]]),
       width=st.sampled_from([1, 3]), own=st.booleans())
def test_greedy_suffix_speculative_equals_target_only(seed, prompt, gamma, max_new, stop, width, own):
    target = tiny(seed)
    base = generate(target, prompt, max_new_tokens=max_new, stop_token_ids=stop)
    rng = np.random.default_rng(seed)
    corpus = [rng.integers(0, VOCAB, 20).tolist() for _ in range(4)]
    if own:  # the target's own answers (to this prompt, too): long accepted runs and rejections both occur
        corpus += _own_answers(target, [prompt, prompt[:1]])
    drafter = SuffixDrafter(SuffixIndex(corpus), SuffixParams(min_token_prob=0.0), tree_width=width)
    spec = generate(target, prompt, max_new_tokens=max_new, drafter=drafter, gamma=gamma, stop_token_ids=stop)
    assert spec.output_ids == base.output_ids
    s, c = spec.stats, spec.stats.counts
    assert 0 <= c.accepted <= c.proposed <= gamma * c.rounds
    if stop == []:
        assert s.generated_tokens == c.accepted + c.runner_ups_accepted + s.target_forwards


def test_suffix_drafter_from_the_targets_answers_accepts_and_rejects():
    target = tiny(3)
    prompts = [[5, 9, 14], [1, 2, 3], [40, 41]]
    corpus = _own_answers(target, prompts, 40)
    stats = generate(target, [5, 9, 14], max_new_tokens=40, drafter=SuffixDrafter(SuffixIndex(corpus)), gamma=4,
                     stop_token_ids=[]).stats.counts
    assert stats.acceptance_rate > 0.9 and stats.accepted_length > 3  # the target repeats its own answer
    other = generate(target, [7, 7, 8], max_new_tokens=40, drafter=SuffixDrafter(SuffixIndex(corpus), tree_width=3),
                     gamma=4, stop_token_ids=[]).stats.counts
    assert other.rounds > 0 and other.acceptance_rate < 1.0


@pytest.mark.e2e  # seconds of sampling: the slow tier
def test_speculative_sampling_with_a_suffix_drafter_matches_target_distribution():
    torch.manual_seed(0)
    target = lively(make_tiny_llama(vocab_size=6, hidden=16, layers=2, seed=11), 11, std=0.2)
    config = SamplingConfig(temperature=1.0, top_p=0.95)
    prompt = [1, 3, 1, 3]
    # a corpus that drafts every round: after any token, a frequency-weighted guess (often wrong)
    corpus = [[a, b, c] for a in range(6) for b in range(6) for c in (0, 2, 4)]
    drafter = SuffixDrafter(SuffixIndex(corpus), SuffixParams(min_token_prob=0.0, max_spec_factor=2.0))
    expected = exact_two_token_distribution(target, prompt, config)
    counts = sampled_two_token_counts(target, drafter, prompt, config, SAMPLES)
    assert chi_square_pvalue(counts, expected) > 1e-3


# --------------------------------------------------------------------------------------------
# The hybrid: suffix where confident, the model elsewhere


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), prompt=st.lists(st.integers(0, 7), min_size=1, max_size=12),
       gamma=st.integers(1, 6), max_new=st.integers(1, 16), width=st.sampled_from([1, 3]),
       threshold=st.sampled_from([0.0, 1.0, 2.0, 99.0]), eagle=st.booleans())
def test_greedy_hybrid_equals_target_only(seed, prompt, gamma, max_new, width, threshold, eagle):
    """Whichever drafter proposes each round, a model drafter (chain or tree, a draft or an EAGLE-3 head
    that needs the target's features every round) stays in step and the output is the target's."""
    target = tiny_target(seed)
    base = generate(target, prompt, max_new_tokens=max_new, stop_token_ids=[])
    model = (EagleDrafter(random_head(target, seed), target, tree_width=width) if eagle
             else ModelDrafter(noisy_copy(target, 0.05, seed), 8, tree_width=width))
    corpus = _own_answers(target, [prompt[:2], [1, 2]], 12) + [np.random.default_rng(seed).integers(0, 8, 30).tolist()]
    hybrid = HybridDrafter(model, SuffixDrafter(SuffixIndex(corpus)), threshold)
    spec = generate(target, prompt, max_new_tokens=max_new, drafter=hybrid, gamma=gamma, stop_token_ids=[])
    assert spec.output_ids == base.output_ids
    s, c = spec.stats, spec.stats.counts
    assert s.generated_tokens == c.accepted + c.runner_ups_accepted + s.target_forwards
    if threshold == 99.0:
        assert hybrid.suffix_rounds == 0


def test_hybrid_takes_the_suffix_proposal_where_it_is_confident():
    target = tiny(4)
    corpus = _own_answers(target, [[5, 9, 14]], 40)
    hybrid = HybridDrafter(ModelDrafter(tiny(99, layers=1), VOCAB), SuffixDrafter(SuffixIndex(corpus)), 2.0)
    stats = generate(target, [5, 9, 14], max_new_tokens=40, drafter=hybrid, gamma=4, stop_token_ids=[]).stats.counts
    assert hybrid.suffix_rounds > 3 and hybrid.model_rounds >= 1  # the first rounds' matches are short
    alone = generate(target, [5, 9, 14], max_new_tokens=40, drafter=ModelDrafter(tiny(99, layers=1), VOCAB), gamma=4,
                     stop_token_ids=[]).stats.counts
    assert stats.accepted_length > alone.accepted_length


def test_specs_name_suffix_and_hybrid_drafters(tmp_path):
    target = tiny(5, layers=3)
    corpus = save_corpus(tmp_path / "c.safetensors", [[1, 2, 3]], CorpusMeta(target_fingerprint="fp", tokenizer="t"))
    drafter = drafter_from_spec(target, f"suffix:{corpus}", tree_width=3, target_fingerprint="fp")
    assert isinstance(drafter, SuffixDrafter) and drafter.tree_width == 3
    with pytest.raises(CorpusError, match="not of this target"):
        drafter_from_spec(target, f"suffix:{corpus}", target_fingerprint="other")
    assert hybrid_parts("a/b,c.safetensors,1.5") == ("a/b", "c.safetensors", 1.5)
    assert hybrid_parts("a/b,c.safetensors") == ("a/b", "c.safetensors", None)
    with pytest.raises(ValueError, match="DIR,CORPUS"):
        hybrid_parts("only-one")
    hybrid = drafter_from_spec(target, f"hybrid:self-spec:1,{corpus},1.5")  # a hybrid's model half may be self-spec
    assert isinstance(hybrid, HybridDrafter) and hybrid.threshold == 1.5 and hybrid.inner.name.startswith("self-spec")


def test_a_hybrids_cost_is_its_models_plus_its_lookups():
    from specdistill.speculative.harness_bench import measure_drafter_cost

    target = tiny(seed=5)
    model = ModelDrafter(tiny(seed=6, layers=1), VOCAB)
    suffix = SuffixDrafter(SuffixIndex([[3, 4, 5, 6]] * 4))
    hybrid = HybridDrafter(model, suffix)
    c = measure_drafter_cost(target, hybrid, context=16, repeats=3)  # used to fail: the inner model's cache was full
    assert c > 0
