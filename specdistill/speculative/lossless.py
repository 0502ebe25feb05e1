"""Losslessness that survives reduced precision (docs/metrics.md, "Losslessness").

In fp32 a greedy speculative output must equal target-only greedy output token for token. In bf16 a
k-token verification and a 1-token step round differently, so at a numerical near-tie of the target
the two can pick different tokens and then continue differently, with neither being wrong. The
check therefore re-scores the speculative output with the target in fp32, from the first token where
it leaves target-only output to its end, and asks of every token there: is it the fp32 target's own
greedy choice, up to a logit margin of at most `tolerance`?

- **exact**: identical to target-only output.
- **near-tie divergence**: differs, and every token from the divergence on is within `tolerance`
  (fp32 logits) of the target's top token; the largest margin is reported.
- **real mismatch**: some token there trails the fp32 top token by more than `tolerance`: a token
  the target does not support, which is what a broken verifier (an off-by-one acceptance, a wrong
  bonus token) produces. It fails the gate.

Why this cannot be fooled either way: a near-tie is judged by the fp32 target alone, not by the
decoding loop under test, and every token after the divergence is checked, not only the first.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from specdistill.data.results import DEFAULT_TOLERANCE


@dataclass
class Divergence:
    prompt_index: int
    position: int  # index into the generated tokens of the first divergence
    margin: float  # the largest fp32 top-logit minus chosen-token logit from there on
    worst_position: int  # where that margin occurs
    target_only_token: int | None
    speculative_token: int | None


@dataclass
class LosslessReport:
    criterion: str  # "exact" (fp32) or "near-tie" (reduced precision)
    tolerance: float
    exact: int = 0
    near_ties: int = 0
    mismatches: int = 0
    max_near_tie_margin: float = 0.0
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.mismatches == 0

    @property
    def outputs(self) -> int:
        return self.exact + self.near_ties + self.mismatches

    def count(self, divergences: list[Divergence]) -> None:
        """One output, or one prompt's outputs over the repeats, counted by its worst divergence."""
        self.divergences += divergences
        ties = [d.margin for d in divergences if d.margin <= self.tolerance]
        self.max_near_tie_margin = max([self.max_near_tie_margin, *ties])
        if len(ties) < len(divergences):
            self.mismatches += 1
        elif ties:
            self.near_ties += 1
        else:
            self.exact += 1

    def render(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        if self.criterion == "exact":
            return f"{verdict}: {self.exact}/{self.outputs} identical to target-only (fp32: exact equality)"
        return (f"{verdict}: {self.exact} exact, {self.near_ties} near-tie divergences (max margin "
                f"{self.max_near_tie_margin:.3f} ≤ {self.tolerance}), {self.mismatches} real mismatches")


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (a shorter sequence that is a prefix differs at its end)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def support_margins(reference: PreTrainedModel, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> torch.Tensor:
    """Per generated token: the fp32 reference's top logit minus the logit of the token emitted."""
    ids = torch.tensor([*prompt_ids, *output_ids], dtype=torch.long, device=getattr(reference, "device", "cpu")).unsqueeze(0)
    logits = reference(input_ids=ids, logits_to_keep=len(output_ids) + 1).logits[0, :-1].float().cpu()
    chosen = logits.gather(1, torch.tensor(output_ids, dtype=torch.long).unsqueeze(1)).squeeze(1)
    return logits.max(dim=1).values - chosen


def check_lossless(
    reference: PreTrainedModel | None,
    prompts: Sequence[Sequence[int]],
    target_only: Sequence[Sequence[int]],
    speculative: Sequence[Sequence[int]],
    *,
    exact: bool,
    tolerance: float = DEFAULT_TOLERANCE,
) -> LosslessReport:
    """Classify each greedy speculative output against target-only output of the same prompt: by token
    equality when `exact` (fp32 runs), else by `reference`, the target in fp32."""
    report = LosslessReport("exact" if exact else "near-tie", 0.0 if exact else tolerance)
    for i, (prompt, base, spec) in enumerate(zip(prompts, target_only, speculative, strict=True)):
        one = divergence(reference, i, prompt, base, spec, exact)
        report.count([one] if one is not None else [])
    return report


def divergence(reference: PreTrainedModel | None, i: int, prompt: Sequence[int], base: Sequence[int],
               spec: Sequence[int], exact: bool) -> Divergence | None:
    """Where prompt i's speculative output leaves target-only output, and its fp32 margin from there on."""
    at = first_divergence(base, spec)
    if at is None:
        return None
    base_tok = base[at] if at < len(base) else None
    spec_tok = spec[at] if at < len(spec) else None
    if exact or reference is None or at >= min(len(base), len(spec)):
        # fp32; or one output is a prefix of the other, so one side stopped where the other went
        # on (a stop token or the budget handled differently): no near-tie explains that
        return Divergence(i, at, float("inf"), at, base_tok, spec_tok)
    margins = support_margins(reference, [*prompt, *spec[:at]], spec[at:])
    worst = int(margins.argmax())
    return Divergence(i, at, float(margins[worst]), at + worst, base_tok, spec_tok)


def model_dtype(model: PreTrainedModel) -> torch.dtype:
    return next(model.parameters()).dtype


def fp32_reference(target: PreTrainedModel) -> PreTrainedModel:
    """A copy of the target computing in fp32: the weights it runs with, upcast (the same model,
    without bf16's rounding of activations), for re-scoring outputs that differ."""
    return copy.deepcopy(target).float().eval()


def judge_lossless(target: PreTrainedModel, prompts: Sequence[Sequence[int]],
                   pairs: Mapping[str, Sequence[Iterable[tuple[Sequence[int], Sequence[int]]]]],
                   tolerance: float = DEFAULT_TOLERANCE) -> dict[str, LosslessReport]:
    """The benchmark's verdict: one report per drafter, counting prompts, from `pairs[drafter][prompt]`,
    the distinct (target-only, speculative) greedy outputs of that prompt over the repeats. In reduced
    precision the fp32 reference is made at the first output that differs, once for all drafters."""
    exact = torch.finfo(model_dtype(target)).bits >= 32
    reference = None
    reports = {}
    for name, per_prompt in pairs.items():
        report = LosslessReport("exact" if exact else "near-tie", 0.0 if exact else tolerance)
        for i, seen in enumerate(per_prompt):
            found = []
            for base, spec in seen:
                if not exact and reference is None and first_divergence(base, spec) is not None:
                    reference = fp32_reference(target)
                one = divergence(reference, i, prompts[i], base, spec, exact)
                found += [one] if one is not None else []
            report.count(found)
        reports[name] = report
    return reports
