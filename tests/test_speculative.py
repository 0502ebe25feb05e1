"""The decoding loop is lossless: greedy output equals target-only greedy output token for token, and
sampled output follows the target's distribution, for every drafting method."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdistill.modeling.drafts import init_draft_from_target
from specdistill.modeling.vocab import DraftVocab, VocabAlignmentError
from specdistill.speculative import (
    ModelDrafter,
    NgramDrafter,
    SamplingConfig,
    SelfSpecDrafter,
    SpecStats,
    early_exit_model,
    generate,
    probs_from_logits,
    verify,
)
from specdistill.speculative import decode as decode_module
from tests.conftest import lively, make_tiny_llama

VOCAB = 96


def tiny(seed: int, layers: int = 4, vocab: int = VOCAB, hidden: int = 32):
    return lively(make_tiny_llama(vocab_size=vocab, hidden=hidden, layers=layers, seed=seed), seed)


def noisy_copy(model, noise: float, seed: int):
    """A draft that agrees with the target part of the time: accepted and rejected rounds both occur."""
    draft = init_draft_from_target(model, list(range(model.config.num_hidden_layers)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * noise)
    return draft


def drafter_for(kind: str, target, seed: int, width: int = 1):
    """`width` > 1: a model drafter that verifies its top `width` first-position candidates as a tree."""
    if kind == "draft":
        return ModelDrafter(noisy_copy(target, 0.01, seed), VOCAB, tree_width=width)
    if kind == "other-model":
        return ModelDrafter(tiny(seed + 1000, layers=2), VOCAB, tree_width=width)
    if kind == "self-spec":
        return SelfSpecDrafter(target, 1 + seed % (target.config.num_hidden_layers - 1), tree_width=width)
    if kind == "ngram":
        return NgramDrafter(1, 3)
    if kind == "reduced-vocab":
        keep = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[: VOCAB // 2]
        return ModelDrafter(noisy_copy(target, 0.01, seed), VOCAB, DraftVocab(keep, VOCAB), tree_width=width)
    raise AssertionError(kind)


pytestmark = pytest.mark.usefixtures("one_thread")


KINDS = ["draft", "other-model", "self-spec", "ngram", "reduced-vocab"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    kind=st.sampled_from(KINDS),
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
    gamma=st.integers(1, 6),
    max_new=st.integers(1, 16),
    stop=st.sampled_from([None, [], [2], [2, 7, 11]]),
    width=st.sampled_from([1, 1, 3]),
)
def test_greedy_speculative_equals_target_only(seed, kind, prompt, gamma, max_new, stop, width):
    target = tiny(seed)
    base = generate(target, prompt, max_new_tokens=max_new, stop_token_ids=stop)
    drafter = drafter_for(kind, target, seed, width)
    spec = generate(target, prompt, max_new_tokens=max_new, drafter=drafter, gamma=gamma, stop_token_ids=stop)
    assert spec.output_ids == base.output_ids
    s, c = spec.stats, spec.stats.counts
    assert 0 <= c.accepted <= c.proposed <= gamma * c.rounds
    if stop == []:  # every target forward yields its accepted drafts (or a runner-up) plus one token of its own
        assert s.generated_tokens == c.accepted + c.runner_ups_accepted + s.target_forwards
    assert sum(c.accepted_per_position) == c.accepted and sum(c.proposed_per_position) == c.proposed


def test_drafters_accept_and_reject():
    """The property test above means something only if rounds with rejections and with full acceptance occur."""
    target = tiny(3)
    prompt = [5, 9, 14, 5, 9]
    rates = {}
    for kind in KINDS:
        stats = generate(target, prompt, max_new_tokens=40, drafter=drafter_for(kind, target, 3), gamma=4, stop_token_ids=[]).stats.counts
        rates[kind] = stats.acceptance_rate
        assert stats.rounds > 0
    assert rates["draft"] > 0.2 and rates["other-model"] < 0.3, rates
    # the target drafting for itself with all its layers accepts everything: tau = gamma + 1
    own = generate(target, prompt, max_new_tokens=41, drafter=ModelDrafter(target, VOCAB), gamma=4, stop_token_ids=[]).stats.counts
    assert own.acceptance_rate == 1.0 and own.accepted_length == 5.0 and own.rounds == 8
    assert own.per_position_acceptance == [1.0] * 4


def test_model_drafter_tree_accepts_runner_ups_and_keeps_its_cache_on_the_accepted_branch():
    """Width 4 verifies the draft's runner-ups for the first position: the same output as the chain,
    more tokens per round, and after a runner-up wins, every proposal equals a fresh drafter's
    proposal for the same sequence (the draft's cache holds only the accepted prefix)."""

    class Recording(ModelDrafter):
        def propose_tree(self, tokens, k):
            ids, parents = super().propose_tree(tokens, k)
            self.calls.append((tokens.clone(), k, ids.clone(), parents))
            return ids, parents

    chain_tau, tree_tau, runner_ups = [], [], 0
    for seed in range(4):
        target = tiny(seed)
        draft = noisy_copy(target, 0.03, seed)
        chain = generate(target, [5, 9, 14], max_new_tokens=24, drafter=ModelDrafter(draft, VOCAB), gamma=2, stop_token_ids=[])
        recording = Recording(draft, VOCAB, tree_width=4)
        recording.calls = []
        tree = generate(target, [5, 9, 14], max_new_tokens=24, drafter=recording, gamma=2, stop_token_ids=[])
        assert tree.output_ids == chain.output_ids
        chain_tau.append(chain.stats.counts.accepted_length)
        tree_tau.append(tree.stats.counts.accepted_length)
        runner_ups += tree.stats.counts.runner_ups_accepted
        for tokens, k, ids, parents in recording.calls:
            with torch.inference_mode():
                fresh_ids, fresh_parents = ModelDrafter(draft, VOCAB, tree_width=4).propose_tree(tokens, k)
            assert fresh_ids.tolist() == ids.tolist() and fresh_parents == parents
            assert parents == list(range(-1, k - 1)) + [-1] * 3
    assert runner_ups > 3
    assert sum(tree_tau) > sum(chain_tau)


def test_stop_token_inside_accepted_drafts_ends_where_target_only_does():
    target = tiny(5)
    prompt = [3, 4, 5]
    free = generate(target, prompt, max_new_tokens=30, stop_token_ids=[]).output_ids
    stop_at = 7  # a position that falls inside a round of 5 accepted drafts
    stop_token = free[stop_at]
    expected = free[: free.index(stop_token) + 1]
    spec = generate(target, prompt, max_new_tokens=30, drafter=ModelDrafter(target, VOCAB), gamma=5, stop_token_ids=[stop_token])
    assert spec.output_ids == expected
    assert spec.stats.counts.accepted > len(expected) - 2  # drafts beyond the stop token were verified, then cut


def test_max_new_tokens_and_context_limit_are_exact():
    target = tiny(6)
    for gamma in (1, 3, 7):
        out = generate(target, [1, 2, 3], max_new_tokens=10, drafter=ModelDrafter(target, VOCAB), gamma=gamma, stop_token_ids=[])
        assert len(out.output_ids) == 10
    ctx = target.config.max_position_embeddings
    near_full = list(range(10, 90)) * 4
    near_full = near_full[: ctx - 4]
    base = generate(target, near_full, max_new_tokens=50, stop_token_ids=[])
    spec = generate(target, near_full, max_new_tokens=50, drafter=NgramDrafter(), gamma=6, stop_token_ids=[])
    assert len(base.output_ids) == 4 and spec.output_ids == base.output_ids
    for cut in (base, spec):  # said, never silent: the context, not max_new_tokens, ended the output
        assert cut.stopped == "context" and cut.stats.context_truncated == 1 and cut.context == ctx
    assert generate(target, [1, 2, 3], max_new_tokens=5, stop_token_ids=[]).stopped == "max_new_tokens"
    assert SpecStats.total([base.stats, spec.stats, out.stats]).context_truncated == 2


def test_generate_says_when_the_context_cut_the_output(tmp_path, capsys):
    import json

    from specdistill.cli import main
    from tests.conftest import save_tiny_target

    target = save_tiny_target(tmp_path / "target")  # a context of 256 positions
    for name in ("config.json", "generation_config.json"):  # no stop token: only the lengths end the output
        config = json.loads((target / name).read_text())
        (target / name).write_text(json.dumps({**config, "eos_token_id": None}))
    ids = ",".join(str(10 + i % 50) for i in range(252))
    argv = ["generate", "--target", str(target), "--prompt-ids", ids, "--max-new-tokens", "16", "--ngram"]
    assert main([*argv, "--json"]) == 0
    out, err = capsys.readouterr()
    reply = json.loads(out)
    assert len(reply["output_ids"]) == 4 and reply["stats"]["stopped"] == "context"
    assert reply["stats"]["context_truncated"] == 1
    assert "stopped at 4 of 16 new tokens: the prompt's 252 tokens filled the target's context of 256 tokens" in err
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "stopped: context" in out and "filled the target's context" in err
    assert main([*argv, "--max-new-tokens", "2"]) == 0
    out, err = capsys.readouterr()
    assert "stopped:" in out and "filled the target's context" not in err


def test_early_exit_shares_weights_and_matches_intermediate_hidden_state():
    target = tiny(7)
    shell = early_exit_model(target, 2)
    assert shell.model.layers[1] is target.model.layers[1]
    assert shell.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    ids = torch.tensor([[4, 8, 15, 16, 23]])
    with torch.inference_mode():
        hidden = target(input_ids=ids, output_hidden_states=True).hidden_states[2]
        expected = target.lm_head(target.model.norm(hidden))
        got = shell(input_ids=ids).logits
    torch.testing.assert_close(got, expected)
    with pytest.raises(ValueError, match="exit layer"):
        early_exit_model(target, 4)


def test_ngram_proposes_what_followed_the_longest_earliest_match():
    drafter = NgramDrafter(1, 3)
    greedy = SamplingConfig()
    tokens = torch.tensor([1, 2, 3, 4, 9, 1, 2, 3, 5, 1, 2, 3])
    ids, q = drafter.propose(tokens, 3, greedy, None)
    assert ids.tolist() == [4, 9, 1] and q is None  # [1,2,3] first seen at 0, followed by 4, 9, 1
    ids, _ = drafter.propose(torch.tensor([7, 8, 9]), 3, greedy, None)
    assert ids.tolist() == []
    ids, _ = drafter.propose(torch.tensor([7, 8, 7]), 4, greedy, None)
    assert ids.tolist() == [8, 7]  # continuation stops at the end of the sequence


def test_reduced_vocab_head_is_sliced_once_and_drafts_only_kept_tokens():
    target = tiny(8)
    keep = torch.arange(0, VOCAB, 3)
    drafter = ModelDrafter(target, VOCAB, DraftVocab(keep, VOCAB))
    assert drafter.head_weight.shape == (keep.numel(), target.config.hidden_size)
    drafter.reset()
    ids, q = drafter.propose(torch.tensor([1, 2, 3]), 5, SamplingConfig(temperature=1.0, seed=0), torch.Generator().manual_seed(0))
    assert set(ids.tolist()) <= set(keep.tolist())
    assert q.shape == (5, VOCAB) and q[:, 1].abs().sum() == 0
    torch.testing.assert_close(q.sum(-1), torch.ones(5, dtype=q.dtype))


# --------------------------------------------------------------------------------------------
# Sampling: the output distribution is the target's (chi-square, with a power check)


def chi_square_pvalue(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's test; cells with expected count < 5 are pooled. The survival function of the
    chi-square distribution is the regularized upper incomplete gamma function."""
    n = counts.sum()
    expected = expected_probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum().view(1)]) if small.any() else expected
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = keep.sum() - 1
    return float(torch.special.gammaincc(df / 2.0, stat / 2.0))


def exact_two_token_distribution(target, prompt, config: SamplingConfig) -> torch.Tensor:
    """p(t2, t3 | prompt) of the target (the 2nd and 3rd generated tokens, t1 summed out), V*V cells.

    The first token always comes from the prefill; t2 and t3 come from the first drafting round."""
    V = target.config.vocab_size
    with torch.inference_mode():
        p1 = probs_from_logits(target(input_ids=torch.tensor([prompt])).logits[0, -1], config)
        batch = torch.tensor([prompt + [a] for a in range(V)])
        p2 = probs_from_logits(target(input_ids=batch).logits[:, -1], config)  # [t1, t2]
        batch = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
        p3 = probs_from_logits(target(input_ids=batch).logits[:, -1], config).view(V, V, V)  # [t1, t2, t3]
    joint = p1[:, None, None] * p2[:, :, None] * p3
    return joint.sum(0).flatten().double()


def sampled_two_token_counts(target, drafter, prompt, config: SamplingConfig, n: int) -> torch.Tensor:
    V = target.config.vocab_size
    counts = torch.zeros(V * V, dtype=torch.float64)
    rounds = 0
    for i in range(n):
        cfg = SamplingConfig(config.temperature, config.top_p, seed=i)
        out = generate(target, prompt, max_new_tokens=4, drafter=drafter, gamma=2, sampling=cfg, stop_token_ids=[])
        counts[out.output_ids[1] * V + out.output_ids[2]] += 1
        rounds += out.stats.counts.rounds
    assert rounds >= n // 5  # drafts were really verified (n-gram lookup proposes only on a match)
    return counts


# 6 tokens: 36 outcomes for two generated tokens (top-p 0.95 leaves ~31 possible). The draft's
# distribution is 0.75 away from the target's in total variation. With 500 samples the test
# detects a sampler that skips the rejection rule (accepts every draft) at p < 1e-6 (asserted
# below, so the power is measured on this very setup, not assumed); the correct sampler must pass
# at the 1e-3 level (a false alarm once in a thousand seeds; the seeds are fixed, so no flakes).
SAMPLES = 500


@pytest.mark.e2e  # seconds of sampling: the slow tier
@pytest.mark.parametrize("kind", ["draft", "reduced-vocab", "ngram"])
def test_speculative_sampling_matches_target_distribution(kind):
    torch.manual_seed(0)
    target = lively(make_tiny_llama(vocab_size=6, hidden=16, layers=2, seed=11), 11, std=0.2)
    config = SamplingConfig(temperature=1.0, top_p=0.95)
    prompt = [1, 3, 1, 3]  # repeats, so n-gram lookup proposes in both positions
    if kind == "draft":
        drafter = ModelDrafter(lively(make_tiny_llama(vocab_size=6, hidden=16, layers=1, seed=12), 12, std=0.2), 6)
    elif kind == "reduced-vocab":
        drafter = ModelDrafter(noisy_copy(target, 0.3, 1), 6, DraftVocab(torch.tensor([0, 1, 3, 4]), 6))
    else:
        drafter = NgramDrafter(1, 2)
    expected = exact_two_token_distribution(target, prompt, config)
    counts = sampled_two_token_counts(target, drafter, prompt, config, SAMPLES)
    assert chi_square_pvalue(counts, expected) > 1e-3


@pytest.mark.e2e  # seconds of sampling: the slow tier
def test_chi_square_detects_a_sampler_without_the_rejection_rule(monkeypatch):
    target = lively(make_tiny_llama(vocab_size=6, hidden=16, layers=2, seed=11), 11, std=0.2)
    config = SamplingConfig(temperature=1.0, top_p=0.95)
    drafter = ModelDrafter(lively(make_tiny_llama(vocab_size=6, hidden=16, layers=1, seed=12), 12, std=0.2), 6)

    def accept_everything(logits, draft_ids, draft_probs, cfg, gen):
        k = draft_ids.numel()
        return k, torch.multinomial(probs_from_logits(logits[k], cfg), 1, generator=gen)[0]

    monkeypatch.setattr(decode_module, "verify", accept_everything)
    expected = exact_two_token_distribution(target, [1, 3, 1, 3], config)
    counts = sampled_two_token_counts(target, drafter, [1, 3, 1, 3], config, SAMPLES)
    pvalue = chi_square_pvalue(counts, expected)
    print(f"broken sampler p-value {pvalue:.3g}")
    assert pvalue < 1e-6


def test_verify_rule_single_position_distribution():
    """The rejection rule alone, on many independent draws: P(output = x) == p(x)."""
    g = torch.Generator().manual_seed(0)
    V = 6
    logits_p = torch.randn(2, V, generator=g) * 2
    q = torch.softmax(torch.randn(1, V, generator=g) * 2, -1)
    config = SamplingConfig(temperature=1.0)
    p = probs_from_logits(logits_p[0], config)
    counts = torch.zeros(V, dtype=torch.float64)
    for _ in range(5_000):
        x = torch.multinomial(q[0], 1, generator=g)
        n, nxt = verify(logits_p, x, q, config, g)
        counts[int(x) if n == 1 else int(nxt)] += 1
    assert chi_square_pvalue(counts, p.double()) > 1e-3


def test_sampling_is_reproducible_with_a_seed():
    target = tiny(9)
    cfg = SamplingConfig(temperature=0.8, top_p=0.9, seed=42)
    a = generate(target, [1, 2, 3], max_new_tokens=20, drafter=NgramDrafter(), gamma=3, sampling=cfg).output_ids
    b = generate(target, [1, 2, 3], max_new_tokens=20, drafter=NgramDrafter(), gamma=3, sampling=cfg).output_ids
    assert a == b


def test_top_p_keeps_the_smallest_nucleus():
    probs = probs_from_logits(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), SamplingConfig(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


# --------------------------------------------------------------------------------------------
# Bad input and stats


def test_bad_input_gets_clear_errors():
    target = tiny(10)
    with pytest.raises(ValueError, match="gamma"):
        generate(target, [1, 2], max_new_tokens=4, drafter=NgramDrafter(), gamma=0)
    with pytest.raises(ValueError, match="empty prompt"):
        generate(target, [], max_new_tokens=4)
    with pytest.raises(ValueError, match="context of 256"):
        generate(target, [1] * 256, max_new_tokens=4)
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        generate(target, [1, VOCAB], max_new_tokens=4)
    with pytest.raises(VocabAlignmentError, match="no d2t map"):
        ModelDrafter(tiny(1, vocab=80), VOCAB)
    with pytest.raises(VocabAlignmentError, match="maps into a vocabulary of 50"):
        ModelDrafter(target, VOCAB, DraftVocab(torch.arange(10), 50))
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(temperature=1.0, top_p=0.0)


def test_stats_merge_and_definitions():
    a, b = SpecStats(requests=1), SpecStats(requests=1)
    a.counts.record_round(4, 4)
    a.counts.record_round(4, 1)
    b.counts.record_round(2, 0)
    summed = SpecStats.total([a, b])
    total = summed.counts
    assert (total.rounds, total.proposed, total.accepted) == (3, 10, 5)
    assert total.acceptance_rate == 0.5
    assert total.accepted_length == pytest.approx(1 + 5 / 3)
    assert total.accepted_per_position == [2, 1, 1, 1]
    assert total.per_position_acceptance == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3])
    assert summed.requests == 2 and a.counts.rounds == 2  # the sum is a new record
    d = summed.to_dict()  # flat, as results files hold it
    assert d["acceptance_rate"] == 0.5 and d["requests"] == 2 and (d["rounds"], d["proposed"], d["accepted"]) == (3, 10, 5)
    assert d["accepted_per_position"] == [2, 1, 1, 1] and d["proposed_per_position"] == [3, 3, 2, 2]
    idle = SpecStats(requests=1).to_dict()  # target-only: nothing drafted
    assert (idle["acceptance_rate"], idle["accepted_length"], idle["per_position_acceptance"]) == (0.0, 1.0, [])


# --------------------------------------------------------------------------------------------
# The real demo target


SHAREGPT_LIKE = [
    "Explain the difference between a list and a tuple in Python.",
]
HUMANEVAL_LIKE = [
    'def add(a: int, b: int) -> int:\n    """Return the sum of a and b."""\n',
]


@pytest.mark.e2e
def test_demo_target_greedy_speculative_is_lossless(demo_target):
    torch.set_num_threads(1)  # the machine is shared: one thread avoids OpenMP oversubscription stalls
    target, tok = demo_target.model, demo_target.tokenizer
    vocab = DraftVocab(torch.arange(4096), target.config.vocab_size)
    drafters = [
        SelfSpecDrafter(target, 20),
        NgramDrafter(1, 3),
        ModelDrafter(init_draft_from_target(target, [0, 1, 2, 29]), target.config.vocab_size, vocab),
    ]
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
               for p in SHAREGPT_LIKE] + [tok(p)["input_ids"] for p in HUMANEVAL_LIKE]
    for ids in prompts:
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        base = generate(target, ids, max_new_tokens=10)
        for drafter in drafters:
            spec = generate(target, ids, max_new_tokens=10, drafter=drafter, gamma=3)
            assert spec.output_ids == base.output_ids, (drafter.name, tok.decode(ids))
