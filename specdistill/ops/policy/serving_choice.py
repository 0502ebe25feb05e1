"""The serving choice and its no-slowdown guard: the fastest lossless mode, written only when a lower
confidence bound of its per-prompt speedups beats target-only by the margin. One guard for the nightly
flow and the monitor's fallback."""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from specdistill.data.results import BenchResult
from specdistill.ops.policy.common import CONFIDENCE, DEFAULT_MARGIN, MIN_SERVED_PROMPTS, RESAMPLES, Role
from specdistill.ops.policy.gate import GateVerdict
from specdistill.speculative.specs import DrafterSpec

PLAUSIBLE_FACTOR = 1.25  # a speedup above this times τ comes from a disturbed baseline, not from speculation


@dataclass
class Candidate:
    """One speculation mode measured against target-only decoding on the same prompts."""
    name: str
    mode: str  # draft | self-spec | ngram | suffix
    speedup: float
    lossless: bool | None  # None: sampling run, not decidable from outputs
    gamma: int
    draft_dir: str | None = None
    exit_layer: int | None = None
    prompt_speedups: list[float] = field(default_factory=list)  # per held-out prompt, median over repeats
    accepted_length: float | None = None  # τ: tokens per target forward, which bounds any speedup (None: unknown)


@dataclass
class ServingChoice:
    mode: str  # a serving mode; "off" when nothing beats target-only by the margin with confidence
    candidate: Candidate | None
    reason: str
    margin: float
    speedups: dict[str, float] = field(default_factory=dict)
    lower_bounds: dict[str, float | None] = field(default_factory=dict)  # per candidate, at `confidence`
    confidence: float = CONFIDENCE

    @property
    def lower_bound(self) -> float | None:
        return self.lower_bounds.get(self.candidate.name) if self.candidate else None


def speedup_lower_bound(prompt_speedups: Sequence[float], confidence: float = CONFIDENCE, *,
                        seed: int = 0) -> float | None:
    """A one-sided lower bound of the prompts' speedup taken together: the (1 − confidence) quantile of
    their harmonic mean over seeded bootstrap resamples. The harmonic mean is the speedup's own statistic
    (summed tokens over summed seconds) for alike prompts, so one prompt that ran 10x slower pulls the
    bound down as it pulls the speedup. None without per-prompt speeds; one prompt bounds only itself."""
    xs = [float(x) for x in prompt_speedups]
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    rng = random.Random(seed)
    n = len(xs)
    means = sorted(statistics.harmonic_mean([max(x, 0.0) for x in rng.choices(xs, k=n)]) for _ in range(RESAMPLES))
    return means[int((1.0 - confidence) * (RESAMPLES - 1))]


def _doubt(c: Candidate, bound: float | None, margin: float, confidence: float, min_prompts: int) -> str:
    """Why `c` may not be served ('' when it may), in the order a reader would check it."""
    bar = 1.0 + margin
    n = len(c.prompt_speedups)
    if c.lossless is False:
        return f"{c.name} is lossy"
    if c.speedup <= bar:
        return f"the fastest mode, {c.name} at {c.speedup:.2f}x, does not beat target-only by more than {margin:.0%}"
    if 0 < n < min_prompts:
        return (f"{c.name} measured {c.speedup:.2f}x on only {n} prompt{'s' * (n != 1)}, fewer than the {min_prompts} "
                f"a serving choice needs (`serving.min_prompts`: more held-out prompts, or a longer benchmark budget)")
    tau = c.accepted_length
    if tau and c.speedup > PLAUSIBLE_FACTOR * tau:
        return (f"{c.name}'s {c.speedup:.2f}x is implausible: more than {PLAUSIBLE_FACTOR}x its τ {tau:.2f} tokens per "
                f"target forward, which bounds any speedup, so its target-only baseline ran disturbed (a loaded machine)")
    if bound is not None and bound <= bar:
        return (f"{c.name} measured {c.speedup:.2f}x but its {confidence:.0%} lower bound over {n} prompts is "
                f"{bound:.2f}x, not above {bar:.2f}x")
    return ""


def fastest_mode(candidates: Sequence[Candidate], margin: float = DEFAULT_MARGIN, *,
                 confidence: float = CONFIDENCE, min_prompts: int = MIN_SERVED_PROMPTS) -> ServingChoice:
    """The fastest lossless candidate whose gain holds over the prompts: its measured speedup and the
    lower bound of its per-prompt speedups both above 1 + margin, on at least `min_prompts` prompts, and
    plausible (no more than `PLAUSIBLE_FACTOR` times its τ, the tokens one target forward yields). A
    candidate measured without per-prompt speeds is judged on its speedup alone, and the reason says so.
    Otherwise speculation is off: serving never gets slower than no speculation on the measured prompts."""
    speedups = {c.name: c.speedup for c in candidates}
    bounds = {c.name: speedup_lower_bound(c.prompt_speedups, confidence) for c in candidates}
    doubts = {c.name: _doubt(c, bounds[c.name], margin, confidence, min_prompts) for c in candidates}

    def cell(c: Candidate) -> str:
        bound = "" if bounds[c.name] is None else f" (≥{bounds[c.name]:.2f}x at {confidence:.0%})"
        return f"{c.name} {c.speedup:.2f}x{bound}" + (" (lossy)" if c.lossless is False else "")

    table = ", ".join(cell(c) for c in sorted(candidates, key=lambda c: -c.speedup)) or "nothing measured"
    best = max((c for c in candidates if not doubts[c.name]), key=lambda c: c.speedup, default=None)
    if best is None:
        fastest = max((c for c in candidates if c.lossless is not False), key=lambda c: c.speedup, default=None)
        why = doubts[fastest.name] if fastest else "no lossless speculation mode was measured"
        if fastest and bounds[fastest.name] is not None and why.endswith(f"not above {1.0 + margin:.2f}x"):
            why = "no mode's gain holds over the prompts: " + why
        others = [doubts[c.name] for c in sorted(candidates, key=lambda c: -c.speedup)
                  if c is not fastest and c.lossless is not False and c.speedup > 1.0 + margin]
        why += "".join(f"; {d}" for d in others)
        return ServingChoice("off", None, f"{why} ({table})", margin, speedups, bounds, confidence)
    bound = bounds[best.name]
    held = (", no per-prompt speeds: judged on the measured speedup alone" if bound is None else
            f", at least {bound:.2f}x with {confidence:.0%} confidence over {len(best.prompt_speedups)} prompts")
    passed_over = [doubts[c.name] for c in sorted(candidates, key=lambda c: -c.speedup)
                   if c.speedup > best.speedup and c.lossless is not False]
    held += "".join(f"; not served: {d}" for d in passed_over)
    return ServingChoice(best.mode, best, f"{best.name} measured fastest at {best.speedup:.2f}x{held} ({table})",
                         margin, speedups, bounds, confidence)


def servable(results: Mapping[str, BenchResult], promote: bool) -> dict[str, BenchResult]:
    """The measured entries that may be served: the challenger only when the gate promotes it (then the
    old champion is superseded), the champion otherwise, and every draft-free mode; never a baseline,
    never a kind no serving engine runs (`Kind.served`: hybrid)."""
    superseded = Role.CHAMPION if promote else Role.CHALLENGER
    return {name: r for name, r in results.items() if Role.served(name) and name != superseded
            and (not r.spec or DrafterSpec.parse(r.spec).served)}


def unserved_faster_challenger(results: Mapping[str, BenchResult], verdict: GateVerdict, served_speedup: float) -> str:
    """Why a challenger that measured faster than what is served is not served (empty: there is none). Only
    a draft that passed the gate is served: the monitor would take one below the red line back at its next run."""
    r = results.get(Role.CHALLENGER)
    if r is None or verdict.promote or not r.lossless or r.speedup <= served_speedup:
        return ""
    why = "; ".join(verdict.failures) or "it does not beat the champion"
    return f"the challenger measured faster ({r.speedup:.2f}x) but is not served: it did not pass the gate ({why})"
