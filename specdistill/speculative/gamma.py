"""γ by measurement: predict the speedup of every γ from what one benchmark run measured, pick the
best, and let a second run confirm it.

A round with γ drafts costs γ draft steps (c each, in target steps) plus one target forward over
γ+1 tokens, which costs v(γ+1) target steps: v(k) ≈ 1 on a GPU and on a CPU in bf16, far above 1
on a CPU in fp32 (docs/metrics.md). It yields 1 + Σ_{i≤γ} a_i tokens, where a_i is the share of
rounds whose draft at position i was accepted (per-position acceptance, which already contains the
"all before it were accepted" condition). Beyond the measured γ, acceptance is extended
geometrically with the last measured conditional rate a_γ/a_{γ-1}.

Not every target step is a drafting round: where the n-gram lookup finds no match the step is a
plain decode step (cost 1, one token), and those steps do not shrink with γ (they sit where the
text does not repeat). With u the share of decoded tokens that came from plain steps, measured in
the same run, the predicted speedup is 1 / ((1 - u) · cost(γ) / tokens(γ) + u). Leaving u out
predicted 1.54x for n-gram at γ=4 where the same run measured 1.27x (u = 0.35 there); with u the
prediction is 1.29x. Model drafters always propose, so their u is ~0. The speedup with u is a
monotone function of the one without, so u moves the predicted level, not the best γ; γ is chosen
on the drafting rounds' own curve (u = 0), where the tolerance of `best_gamma` keeps its meaning.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import torch
from transformers import PreTrainedModel

from specdistill.acceptance import ideal_speedup
from specdistill.budget import Deadline
from specdistill.data.results import GammaSearch
from specdistill.modeling.attention import decode_attention_for
from specdistill.modeling.kv_cache import preallocated_cache
from specdistill.modeling.lean import decode_forward
from specdistill.speculative.harness_bench import BenchConfig, BenchResult, run_bench_many

GAMMAS = range(1, 9)
FLAT = 0.02  # speedups within this (relative) of each other are a flat curve: the smaller γ is kept


def measure_forward_seconds(target: PreTrainedModel, ks: Sequence[int] = tuple(range(1, 10)), *,
                            context: int = 128, repeats: int = 7) -> dict[int, float]:
    """Seconds of one forward over k new tokens with a KV cache of `context` tokens, for each k, as the
    decoding loop runs them; interleaved (alternating order), median of repeats: the machine is shared and noisy."""
    vocab = target.config.vocab_size
    device = next(target.parameters()).device
    ids = torch.randint(0, vocab, (1, context), device=device)
    cache = preallocated_cache(target, 1, context + max(ks))  # as the decoding loop runs its target
    inputs = {k: torch.randint(0, vocab, (1, k), device=device) for k in ks}

    def timed(k: int) -> float:
        extra = cache.get_seq_length() - context
        if extra:
            cache.crop(-extra)
        start = time.perf_counter()
        decode_forward(target, inputs[k], cache, keep=k, sync=True)
        return time.perf_counter() - start

    samples: dict[int, list[float]] = {k: [] for k in ks}
    with torch.inference_mode(), decode_attention_for(target):
        decode_forward(target, ids, cache)
        for k in ks:  # warm-up
            timed(k)
        for r in range(repeats):
            for k in (list(ks) if r % 2 == 0 else list(reversed(ks))):
                samples[k].append(timed(k))
    return {k: sorted(v)[len(v) // 2] for k, v in samples.items()}


def measure_verify_costs(target: PreTrainedModel, ks: Sequence[int] = tuple(range(1, 10)), *,
                         context: int = 128, repeats: int = 7) -> dict[int, float]:
    """v(k): the cost of one target forward over k tokens ÷ a 1-token decode step (`ks` includes 1)."""
    seconds = measure_forward_seconds(target, ks, context=context, repeats=repeats)
    return {k: t / seconds[1] for k, t in seconds.items()}


def extend_acceptance(per_position: Sequence[float], gamma: int) -> list[float]:
    """Per-position acceptance up to `gamma`, extended geometrically past the measured positions."""
    a = [max(0.0, min(1.0, x)) for x in per_position]
    if not a:
        return [0.0] * gamma
    ratio = a[-1] / a[-2] if len(a) >= 2 and a[-2] > 0 else a[-1]
    while len(a) < gamma:
        a.append(a[-1] * ratio)
    return a[:gamma]


def plain_step_share(stats: dict) -> float:
    """u: the share of decoded tokens (after the prefill's first token) that came from target steps
    with nothing to verify, from a run's summed `SpecStats.to_dict()`."""
    requests = stats.get("requests", 0)
    plain = stats.get("target_forwards", 0) - stats.get("rounds", 0) - requests  # every request has one prefill
    decoded = stats.get("generated_tokens", 0) - requests
    return min(1.0, max(0.0, plain / decoded)) if decoded > 0 else 0.0


def predict_speedups(per_position: Sequence[float], cost_ratio: float, verify_costs: dict[int, float],
                     gammas: Sequence[int] = GAMMAS, plain_share: float = 0.0) -> dict[int, float]:
    """Predicted speedup over target-only decoding for each γ (see the module docstring). At u = 1
    (a run that never drafted, e.g. n-gram lookup on a few tokens without a repeat) every γ predicts
    1.0x: no round was measured, so γ changes nothing the run can tell."""
    if not 0.0 <= plain_share <= 1.0:
        raise ValueError(f"plain-step share must be in [0, 1], got {plain_share}")
    out = {}
    for g in gammas:
        if g + 1 not in verify_costs:
            raise ValueError(f"no measured verification cost for {g + 1} tokens (γ={g})")
        tokens = 1.0 + sum(extend_acceptance(per_position, g))
        cost = g * cost_ratio + verify_costs[g + 1]
        out[g] = 1.0 / ((1.0 - plain_share) * cost / tokens + plain_share)
    return out


def best_gamma(predicted: dict[int, float], tolerance: float = FLAT) -> int:
    """The smallest γ predicted within `tolerance` of the best speedup: on a flat curve a longer draft
    gains nothing the prediction can resolve and costs more when acceptance drops."""
    top = max(predicted.values())
    return min(g for g, x in predicted.items() if x >= top * (1 - tolerance))


def monotone_costs(costs: dict[int, float]) -> dict[int, float]:
    """The closest non-decreasing v(k) (least squares, pool-adjacent-violators): a forward over more
    tokens never costs less, so a dip is timing noise, and a γ must not win on a noisy dip."""
    blocks: list[list[float]] = []  # [mean, weight] of pooled runs, left to right
    for k in sorted(costs):
        blocks.append([costs[k], 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2), (m1, w1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    values = [m for m, w in blocks for _ in range(int(w))]
    return dict(zip(sorted(costs), values))


def speedup_curve(target: PreTrainedModel, per_position: Sequence[float], cost_ratio: float,
                  gammas: Sequence[int] = GAMMAS, repeats: int = 11, plain_share: float = 0.0,
                  measured: dict[int, float] | None = None) -> dict:
    """What one benchmark run predicts for every γ: the target's verify costs v(k), measured now in
    the dtype it runs in (or the `measured` ones, to share one measurement among drafters) and made
    non-decreasing (`monotone_costs`; the raw medians are kept as `verify_costs_measured`), the
    predicted speedups and the best γ. JSON-friendly."""
    if measured is None:
        measured = measure_verify_costs(target, tuple(range(1, max(gammas) + 2)), repeats=repeats)
    costs = monotone_costs(measured)
    predicted = predict_speedups(per_position, cost_ratio, costs, gammas, plain_share)
    per_round = predict_speedups(per_position, cost_ratio, costs, gammas)  # the same argmax, undiluted
    # no drafting round measured (u = 1): no γ is better than another, and none is proposed
    best = None if plain_share >= 1.0 else best_gamma(per_round)
    return {"verify_costs": costs, "verify_costs_measured": measured, "predicted_speedups": predicted,
            "best_gamma": best, "plain_share": plain_share}


def confirmation_seconds(results: dict[str, BenchResult], names: Sequence[str], repeats: int) -> float:
    """What a confirming run of `names` will take, from what the first run measured: each drafter's own
    rounds plus one shared target-only run per prompt, per repeat."""
    spec = sum(results[n].stats.get("seconds", 0.0) for n in names)
    first = results[names[0]] if names else None
    base = (first.stats.get("generated_tokens", 0) / first.tokens_per_second_target_only
            if first is not None and first.tokens_per_second_target_only > 0 else 0.0)
    return repeats * (spec + base)


def bench_at_best_gamma(target: PreTrainedModel, tokenizer, drafters: dict, prompts: list, config: BenchConfig,
                        results: dict[str, BenchResult], gammas: Sequence[int] = GAMMAS,
                        deadline: Deadline | None = None) -> dict[str, BenchResult]:
    """Every drafter at its own best γ, so a table compares drafters at their best rather than at one
    shared γ that suits some and not others (a head trained with a 2-step unroll has ~no acceptance
    at positions 3-4; n-gram gains from longer drafts).

    The drafters whose predicted best γ differs from `results`' run once more, together. A drafter takes
    the new γ only when that run measured it lossless (and `prefer_smaller_gamma`); its c is the first
    run's (the draft step does not depend on γ). Under `deadline` the confirming run takes the most
    promising drafters that fit; the others' predicted γ stays unconfirmed and the result says so."""
    measured = measure_verify_costs(target, tuple(range(1, max(gammas) + 2)))
    curves = {name: speedup_curve(target, r.per_position_acceptance, r.cost_ratio or 0.0, gammas,
                                  plain_share=plain_step_share(r.stats), measured=measured) for name, r in results.items()}
    moved = {name: c["best_gamma"] for name, c in curves.items()
             if c["best_gamma"] is not None and c["best_gamma"] != results[name].gamma}
    confirmed, notes = {}, {}
    # the most promising first (the largest predicted speedup), as many as the deadline leaves time for
    fits = []
    for name in sorted(moved, key=lambda n: -curves[n]["predicted_speedups"][moved[n]]):
        if deadline is None or confirmation_seconds(results, [*fits, name], config.repeats) <= deadline.remaining():
            fits.append(name)
    if len(fits) < len(moved):
        need = confirmation_seconds(results, list(moved), config.repeats)
        skipped = (f"time budget reached: the γ confirmation (~{need / 60:.1f} min for all) did not fit the "
                   f"{deadline.remaining() / 60:.1f} min left, so this drafter is measured at the benchmark's γ"
                   + (f" (confirmed: {', '.join(fits)})" if fits else ""))
        notes = {name: skipped for name in moved if name not in fits}
    if fits:
        confirmed = run_bench_many(target, tokenizer, {name: drafters[name] for name in fits}, prompts,
                                   config.model_copy(update={"measure_cost": False}), gammas={n: moved[n] for n in fits}, deadline=deadline)
        if any(r.budget_note for r in confirmed.values()):  # cut short: not the same prompts as the first run
            cut = "time budget reached during the γ confirmation: measured at the benchmark's γ"
            notes, confirmed = {**notes, **{name: cut for name in fits}}, {}
    out = {}
    for name, first in results.items():
        again = confirmed.get(name)
        best = first if again is None or again.lossless is False else prefer_smaller_gamma(first, again)
        search = GammaSearch(predicted_speedups=curves[name]["predicted_speedups"], predicted_best=curves[name]["best_gamma"],
                             verify_costs=curves[name]["verify_costs"],
                             measured={first.gamma: first.speedup, **({again.gamma: again.speedup} if again else {})})
        ideal = ideal_speedup(best.acceptance_rate, best.gamma, first.cost_ratio) if first.cost_ratio is not None else None
        out[name] = replace(best, cost_ratio=first.cost_ratio, ideal_speedup=ideal, gamma_search=search,
                            budget_note="; ".join(x for x in (first.budget_note, notes.get(name, "")) if x))
    return out


def prefer_smaller_gamma(a: BenchResult, b: BenchResult, flat: float = FLAT) -> BenchResult:
    """Of two measured runs of one drafter, the larger γ only when it is faster than the smaller by more
    than `flat` (relative): on a flat curve a longer draft gains nothing the measurement resolves, and
    it costs more where acceptance drops (unseen traffic)."""
    small, large = sorted((a, b), key=lambda r: r.gamma)
    return large if large.speedup > small.speedup * (1 + flat) else small


def render_curve(curve: dict, dtype: str, cost_ratio: float) -> str:
    predicted, costs, raw = curve["predicted_speedups"], curve["verify_costs"], curve["verify_costs_measured"]
    gammas = sorted(predicted)
    best = curve["best_gamma"]
    return "\n".join([
        f"predicted speedup by γ (this run's per-position acceptance, c {cost_ratio:.3f}, "
        f"plain-step share u {curve.get('plain_share', 0.0):.2f}, v(k) measured in {dtype})",
        "γ               " + " ".join(f"{g:>6}" for g in gammas),
        "v(γ+1) measured " + " ".join(f"{raw[g + 1]:>6.2f}" for g in gammas),
        "v(γ+1) monotone " + " ".join(f"{costs[g + 1]:>6.2f}" for g in gammas),
        "speedup         " + " ".join(f"{predicted[g]:>5.2f}x" for g in gammas),
        f"best γ {best} (predicted {predicted[best]:.2f}x)" if best is not None else
        "best γ: none (no drafting round in this run: every step was a plain target step)",
    ])
