"""The reduced-precision lossless check: exact matches, near-tie divergences and real mismatches are
told apart by an fp32 re-score, and a broken verifier is still caught when the decoding loop runs in bf16."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from specdistill.speculative import ModelDrafter, NgramDrafter, generate
from specdistill.speculative import decode as decode_module
from specdistill.speculative.lossless import check_lossless, first_divergence, support_margins
from specdistill.speculative.sampling import verify
from tests.conftest import make_tiny_llama

VOCAB = 64


class ScriptedTarget(torch.nn.Module):
    """A 'target' whose next-token logits are a fixed table indexed by the previous token."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table

    def forward(self, input_ids, logits_to_keep=0, **_):
        logits = self.table[input_ids[0]].unsqueeze(0)
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def scripted() -> ScriptedTarget:
    table = torch.zeros(8, 8)
    table[0, 1], table[0, 2] = 5.0, 4.8  # after 0: 1 is the top token, 2 trails it by 0.2 (a near-tie)
    table[1, 3] = 5.0  # after 1: 3, everything else 5 logits below
    table[2, 3] = 5.0
    table[3, 4], table[3, 5] = 5.0, 1.0  # after 3: 4; 5 trails by 4 (not supported)
    return ScriptedTarget(table)


def test_margins_are_top_logit_minus_chosen_logit():
    assert support_margins(scripted(), [0], [1, 3, 4]).tolist() == pytest.approx([0.0, 0.0, 0.0])
    assert support_margins(scripted(), [0], [2, 3, 5]).tolist() == pytest.approx([0.2, 0.0, 4.0])


def test_exact_near_tie_and_real_mismatch_are_counted_apart():
    ref = scripted()
    prompts = [[0], [0], [0], [0]]
    target_only = [[1, 3, 4], [1, 3, 4], [1, 3, 4], [1, 3, 4]]
    speculative = [[1, 3, 4], [2, 3, 4], [2, 3, 5], [1, 3, 5]]
    report = check_lossless(ref, prompts, target_only, speculative, exact=False, tolerance=0.5)
    assert (report.exact, report.near_ties, report.mismatches) == (1, 1, 2)
    assert report.max_near_tie_margin == pytest.approx(0.2) and not report.passed
    # the second mismatch diverges at a tie-free position; the first only after a near-tie: both caught
    worst = {d.prompt_index: d for d in report.divergences}
    assert worst[2].worst_position == 2 and worst[2].margin == pytest.approx(4.0)
    assert worst[3].position == 2
    assert "1 near-tie" in report.render() and "2 real mismatches" in report.render()


def test_fp32_criterion_is_exact_equality():
    report = check_lossless(None, [[0]], [[1, 3, 4]], [[2, 3, 4]], exact=True)
    assert report.mismatches == 1 and report.criterion == "exact" and not report.passed
    assert check_lossless(None, [[0]], [[1, 3]], [[1, 3]], exact=True).passed


def test_an_output_that_stops_elsewhere_is_a_mismatch_not_a_near_tie():
    assert first_divergence([1, 3], [1, 3, 4]) == 2 and first_divergence([1, 3], [1, 3]) is None
    report = check_lossless(scripted(), [[0]], [[1, 3]], [[1, 3, 4]], exact=False)
    assert report.mismatches == 1


# --------------------------------------------------------------------------------------------
# broken verifiers, the decoding loop in bf16


def peaked_target(seed: int = 0):
    """A tiny Llama with peaked next-token logits, as a trained LM has (random init is nearly flat)."""
    model = make_tiny_llama(vocab_size=VOCAB, hidden=64, layers=2, seed=seed, tie=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        model.lm_head.weight.mul_(4.0)
    return model.eval()


def off_by_one(*args):
    n, following = verify(*args)
    draft_ids = args[1]
    if n < draft_ids.numel():  # also accept the first rejected draft
        return n + 1, args[0][n + 1].argmax()
    return n, following


def wrong_bonus(*args):
    n, following = verify(*args)
    return n, args[0][max(n - 1, 0)].argmax()  # the token of the row before


def run(target, prompts, drafter_factory, max_new=24):
    return [generate(target, p, max_new_tokens=max_new, drafter=drafter_factory(), gamma=4, stop_token_ids=[]).output_ids
            for p in prompts]


@pytest.mark.parametrize("broken", [None, off_by_one, wrong_bonus])
def test_bf16_check_passes_the_engine_and_catches_broken_verifiers(monkeypatch, broken):
    reference = peaked_target()
    target = copy.deepcopy(reference).to(torch.bfloat16)
    prompts = [torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(4)]
    target_only = [generate(target, p, max_new_tokens=24, stop_token_ids=[]).output_ids for p in prompts]
    if broken is not None:
        monkeypatch.setattr(decode_module, "verify", broken)
    draft = copy.deepcopy(target)  # the target with noise: accepted runs and rejections both occur
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)).to(p.dtype) * 0.1)
    for make in (lambda: ModelDrafter(draft, VOCAB), lambda: NgramDrafter(1, 3)):
        spec = run(target, prompts, make)
        report = check_lossless(reference, prompts, target_only, spec, exact=False)
        if broken is None:
            assert report.passed, report.render()
        else:
            assert report.mismatches > 0, report.render()
