"""When has a measurement seen enough prompts? The monitor measures prompt by prompt until a 95%
bound settles its decision, or its time budget runs out (the report says which):

- the replay, once the bound on the champion's first-position acceptance lies wholly on one side of
  every line the decision reads (the red line, and the drop from the champion's own at registration);
- the fallback choice, once the leader's gain over target-only holds at 95% and it beats each other
  mode that could still clear the bar, paired prompt by prompt; or once no mode can clear the bar.
  A mode that cannot win any more (`beaten`) is measured no further: the prompts added after it cost
  only the modes still in the running.

Bounds are seeded bootstrap quantiles over prompts, as the serving choice's (`serving_choice`): a
prompt's rounds or tokens are not independent draws, its prompts are.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specdistill.ops.policy.common import CONFIDENCE, DEFAULT_MARGIN, MIN_SERVED_PROMPTS, RESAMPLES

MIN_REPLAY_PROMPTS = 6  # a replay that settles reads at least this many prompts: a bootstrap over fewer is too narrow


@dataclass(frozen=True)
class Settled:
    """Is the decision settled at `confidence` on the prompts measured so far, and why (or why not)."""

    settled: bool
    why: str


def _resampled(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [rng.choices(range(n), k=n) for _ in range(RESAMPLES)]


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    return sorted_values[int(q * (len(sorted_values) - 1))]


def acceptance_interval(rounds: Sequence[int], accepted_first: Sequence[int], confidence: float = CONFIDENCE,
                        *, seed: int = 0) -> tuple[float, float] | None:
    """A two-sided `confidence` interval of first-position acceptance (accepted at position 1 over
    drafting rounds, summed over the prompts), resampling prompts. None without a round."""
    if sum(rounds) == 0:
        return None
    ratios = sorted(sum(accepted_first[i] for i in idx) / max(1, sum(rounds[i] for i in idx))
                    for idx in _resampled(len(rounds), seed))
    tail = (1.0 - confidence) / 2
    return _quantile(ratios, tail), _quantile(ratios, 1.0 - tail)


def acceptance_settled(rounds: Sequence[int], accepted_first: Sequence[int], lines: Sequence[float], *,
                       confidence: float = CONFIDENCE, min_prompts: int = MIN_REPLAY_PROMPTS) -> Settled:
    """Settled once `min_prompts` prompts are read and the interval lies on one side of every line."""
    n = len(rounds)
    interval = acceptance_interval(rounds, accepted_first, confidence) if n >= min_prompts else None
    if interval is None:
        return Settled(False, f"{n} prompt{'s' * (n != 1)} read, fewer than the {min_prompts} a bound needs"
                       if n < min_prompts else "no drafting round yet")
    lo, hi = interval
    cut = [line for line in lines if lo <= line <= hi]
    span = f"its {confidence:.0%} interval {lo:.3f}-{hi:.3f} over {n} prompts"
    if cut:
        return Settled(False, f"{span} straddles {', '.join(f'{x:.3f}' for x in cut)}")
    sides = ", ".join(f"{'under' if hi < line else 'over'} {line:.3f}" for line in lines)
    return Settled(True, f"{span} lies {sides}" if lines else span)


def _harmonic(xs: Sequence[float]) -> float:
    """statistics.harmonic_mean of the speedups (0 when any is 0 or less), at a fraction of its cost:
    a check runs thousands of them after every prompt."""
    return 0.0 if not xs or min(xs) <= 0.0 else len(xs) / sum(1.0 / x for x in xs)


def _bounds(xs: Sequence[float], samples: list[list[int]], confidence: float) -> tuple[float, float]:
    means = sorted(_harmonic([xs[i] for i in idx]) for idx in samples)
    return _quantile(means, 1.0 - confidence), _quantile(means, confidence)


def leader_settled(prompt_speedups: Mapping[str, Sequence[float]], *, margin: float = DEFAULT_MARGIN,
                   confidence: float = CONFIDENCE, min_prompts: int = MIN_SERVED_PROMPTS, seed: int = 0) -> Settled:
    """Is the fallback choice settled on the prompts measured so far? Each mode's per-prompt speedups
    (the same prompts, in the same order). Settled when no mode's upper bound clears `1 + margin`
    (speculation off), or when the leader's lower bound clears it and, paired prompt by prompt, the
    leader beats every other mode whose upper bound clears it (one-sided bounds at `confidence`)."""
    lengths = {len(xs) for xs in prompt_speedups.values()}
    if not prompt_speedups or len(lengths) != 1:
        raise ValueError(f"every mode needs speedups on the same prompts, got {dict((k, len(v)) for k, v in prompt_speedups.items())}")
    n, bar = lengths.pop(), 1.0 + margin
    if n < min_prompts:
        return Settled(False, f"{n} prompt{'s' * (n != 1)} measured, fewer than the {min_prompts} a choice needs")
    samples = _resampled(n, seed)
    bounds = {name: _bounds(xs, samples, confidence) for name, xs in prompt_speedups.items()}
    contenders = [name for name, (_, hi) in bounds.items() if hi > bar]
    if not contenders:
        return Settled(True, f"no mode can beat target-only by more than {margin:.0%}: every {confidence:.0%} upper "
                             f"bound over {n} prompts is at most {bar:.2f}x")
    leader = max(contenders, key=lambda name: _harmonic(prompt_speedups[name]))
    lo = bounds[leader][0]
    if lo <= bar:
        return Settled(False, f"the leader {leader}'s {confidence:.0%} lower bound over {n} prompts is {lo:.2f}x, "
                              f"not above {bar:.2f}x")
    for other in contenders:
        if other == leader:
            continue
        a, b = prompt_speedups[leader], prompt_speedups[other]
        ratios = sorted(_harmonic([a[i] for i in idx]) / max(_harmonic([b[i] for i in idx]), 1e-9) for idx in samples)
        if _quantile(ratios, 1.0 - confidence) <= 1.0:
            return Settled(False, f"the leader {leader} (≥{lo:.2f}x) is not yet ahead of {other} at {confidence:.0%} "
                                  f"over {n} prompts")
    rivals = f", and ahead of {', '.join(c for c in contenders if c != leader)}" if len(contenders) > 1 else ""
    return Settled(True, f"the leader {leader} is at least {lo:.2f}x with {confidence:.0%} confidence over {n} prompts{rivals}")


def beaten(prompt_speedups: Mapping[str, Sequence[float]], *, margin: float = DEFAULT_MARGIN,
           confidence: float = CONFIDENCE, min_prompts: int = MIN_SERVED_PROMPTS, seed: int = 0) -> dict[str, str]:
    """The modes that can no longer be chosen, and why: an upper bound at `confidence` not above
    `1 + margin`, or, paired prompt by prompt, behind the leader with that confidence. None before
    `min_prompts` prompts, and never the leader itself."""
    n = len(next(iter(prompt_speedups.values()), []))
    if n < min_prompts or len(prompt_speedups) < 2:
        return {}
    bar, samples = 1.0 + margin, _resampled(n, seed)
    leader = max(prompt_speedups, key=lambda name: _harmonic(prompt_speedups[name]))
    out = {}
    for name, xs in prompt_speedups.items():
        if name == leader:
            continue
        hi = _bounds(xs, samples, confidence)[1]
        if hi <= bar:
            out[name] = f"its {confidence:.0%} upper bound over {n} prompts is {hi:.2f}x, not above {bar:.2f}x"
            continue
        a = prompt_speedups[leader]
        ratios = sorted(_harmonic([xs[i] for i in idx]) / max(_harmonic([a[i] for i in idx]), 1e-9) for idx in samples)
        if _quantile(ratios, confidence) < 1.0:
            out[name] = f"behind {leader} at {confidence:.0%} over {n} prompts"
    return out
