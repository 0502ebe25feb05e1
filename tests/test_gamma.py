"""γ is chosen from measured per-position acceptance, draft cost and verification cost."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specdistill.speculative.gamma import best_gamma, extend_acceptance, measure_verify_costs, predict_speedups
from tests.conftest import make_tiny_llama

FLAT = {k: 1.0 for k in range(1, 10)}  # verification as cheap as one step (GPU, CPU bf16)


def test_extension_is_geometric_past_the_measured_positions():
    assert extend_acceptance([0.8, 0.64], 4) == pytest.approx([0.8, 0.64, 0.512, 0.4096])
    assert extend_acceptance([0.5, 0.25, 0.1, 0.05], 2) == [0.5, 0.25]
    assert extend_acceptance([], 3) == [0.0, 0.0, 0.0]


def test_iid_acceptance_with_free_verification_matches_the_closed_form():
    alpha, c = 0.7, 0.1
    per_position = [alpha ** (i + 1) for i in range(4)]
    predicted = predict_speedups(per_position, c, FLAT)
    for g, s in predicted.items():
        assert s == pytest.approx((1 - alpha ** (g + 1)) / (1 - alpha) / (g * c + 1))


def test_high_acceptance_wants_long_drafts_low_acceptance_short_ones():
    good = predict_speedups([0.9 ** (i + 1) for i in range(4)], 0.05, FLAT)
    poor = predict_speedups([0.3 ** (i + 1) for i in range(4)], 0.2, FLAT)
    assert best_gamma(good) >= 6 and best_gamma(poor) == 1


def test_costly_verification_shortens_the_draft():
    per_position = [0.8 ** (i + 1) for i in range(4)]
    cheap = best_gamma(predict_speedups(per_position, 0.05, FLAT))
    fp32_cpu = {k: 1.0 + 0.25 * (k - 1) for k in range(1, 10)}  # verification grows with k
    assert best_gamma(predict_speedups(per_position, 0.05, fp32_cpu)) < cheap


def test_a_missing_verification_cost_is_named():
    with pytest.raises(ValueError, match="4 tokens"):
        predict_speedups([0.5], 0.1, {1: 1.0, 2: 1.0, 3: 1.0}, gammas=[1, 2, 3])


def test_verify_costs_are_relative_to_one_token():
    costs = measure_verify_costs(make_tiny_llama(), ks=(1, 2, 4), context=16, repeats=3)
    assert set(costs) == {1, 2, 4} and costs[1] == 1.0 and all(v > 0 for v in costs.values())


def test_monotone_costs_pool_noisy_dips_and_keep_a_rising_curve():
    from specdistill.speculative.gamma import monotone_costs

    rising = {1: 1.0, 2: 1.1, 3: 1.3}
    assert monotone_costs(rising) == rising
    pooled = monotone_costs({1: 1.0, 2: 1.3, 3: 1.1, 4: 1.5, 5: 1.6, 6: 1.2, 7: 1.9})
    assert pooled == pytest.approx({1: 1.0, 2: 1.2, 3: 1.2, 4: 1.4333, 5: 1.4333, 6: 1.4333, 7: 1.9}, abs=1e-4)
    noisy = monotone_costs({1: 1.0, 2: 1.05, 3: 0.97, 4: 1.19, 5: 0.96, 6: 0.69, 7: 1.02})  # a CPU bf16 run's medians
    values = [noisy[k] for k in sorted(noisy)]
    assert values == sorted(values) and min(values) > 0.69  # the dip at 6 no longer makes γ=5 look cheapest


def test_a_flat_curve_picks_the_shortest_draft_within_tolerance():
    assert best_gamma({1: 1.20, 2: 1.40, 3: 1.43, 4: 1.44, 5: 1.44}) == 3
    assert best_gamma({1: 1.20, 2: 1.40, 3: 1.43, 4: 1.44}, tolerance=0.0) == 4


def test_plain_steps_dilute_the_prediction_as_measured():
    """The demo's n-gram run at γ=4 (bf16): 145 drafting rounds, 137 plain steps, measured 1.27x."""
    from specdistill.speculative.gamma import plain_step_share

    stats = {"requests": 10, "generated_tokens": 400, "rounds": 145, "target_forwards": 292}
    u = plain_step_share(stats)
    assert u == pytest.approx(137 / 390)
    per_position = [0.2897, 0.1862, 0.1586, 0.1103]
    costs = {5: 1.123}
    without = predict_speedups(per_position, 0.0024, costs, gammas=[4])[4]
    with_plain = predict_speedups(per_position, 0.0024, costs, gammas=[4], plain_share=u)[4]
    assert without == pytest.approx(1.54, abs=0.01) and with_plain == pytest.approx(1.29, abs=0.01)
    # every token from a plain step is target-only decoding; no plain steps is the old formula
    assert predict_speedups(per_position, 0.0024, costs, gammas=[4], plain_share=0.0)[4] == without
    assert plain_step_share({}) == 0.0


def test_plain_steps_lower_the_curve_but_do_not_move_the_best_gamma(monkeypatch):
    from specdistill.speculative import gamma

    monkeypatch.setattr(gamma, "measure_verify_costs", lambda *a, **k: {k: 1.0 + 0.02 * (k - 1) for k in range(1, 10)})
    per_position = [0.29, 0.19, 0.16, 0.11]  # the demo's n-gram run
    alone = gamma.speedup_curve(None, per_position, 0.0024)
    diluted = gamma.speedup_curve(None, per_position, 0.0024, plain_share=0.35)
    assert diluted["best_gamma"] == alone["best_gamma"]
    assert all(diluted["predicted_speedups"][g] < alone["predicted_speedups"][g] for g in gamma.GAMMAS)
    assert diluted["plain_share"] == 0.35


# --------------------------------------------------------------------------------------------
# every drafter at its own γ (the nightly's table), on recorded results

# the fresh-clone demo's drafters at γ=4 (bf16): the EAGLE-3 head, trained with a 2-step unroll, has ~no
# acceptance at positions 3-4; n-gram keeps accepting; v(k) as measured in bf16 on this CPU
RECORDED = {
    "challenger": dict(per_position=[0.41, 0.147, 0.002, 0.0], cost=0.071, speedup=1.07, stats={}),
    "ngram": dict(per_position=[0.29, 0.19, 0.16, 0.11], cost=0.004, speedup=1.32,
                  stats={"requests": 10, "generated_tokens": 400, "rounds": 145, "target_forwards": 292}),
    "self-spec:8": dict(per_position=[0.04, 0.01, 0.0, 0.0], cost=0.36, speedup=0.44, stats={}),
}
BF16_COSTS = {k: 1.0 + 0.03 * (k - 1) for k in range(1, 10)}


def _result(name: str, gamma: int, speedup: float, lossless: bool = True, cost: float | None = None):
    from specdistill.speculative.harness_bench import BenchResult

    r = RECORDED[name]
    return BenchResult(drafter=name, gamma=gamma, max_new_tokens=40, repeats=1, greedy=True, lossless=lossless,
                       lossless_mismatches=0 if lossless else 1, acceptance_rate=0.1, accepted_length=1.4,
                       per_position_acceptance=r["per_position"][:gamma], request_acceptance_p10=0.0,
                       request_acceptance_p50=0.1, request_acceptance_p90=0.2, tokens_per_second_target_only=21.0,
                       tokens_per_second_speculative=21.0 * speedup, speedup=speedup, cost_ratio=cost,
                       ideal_speedup=None, stats=r["stats"])


def test_each_drafter_is_benchmarked_again_at_its_predicted_best_gamma(monkeypatch):
    from specdistill.speculative import gamma
    from specdistill.speculative.harness_bench import BenchConfig

    monkeypatch.setattr(gamma, "measure_verify_costs", lambda *a, **k: dict(BF16_COSTS))
    first = {name: _result(name, 4, r["speedup"], cost=r["cost"]) for name, r in RECORDED.items()}
    confirmed = {"challenger": 1.31, "self-spec:8": 0.40}  # self-spec at its best γ measured slower: it keeps γ=4
    calls = []

    def confirm(target, tokenizer, drafters, prompts, config, *, gammas, **kw):
        calls.append((sorted(drafters), dict(gammas), config.measure_cost))
        return {name: _result(name, g, confirmed[name]) for name, g in gammas.items()}

    monkeypatch.setattr(gamma, "run_bench_many", confirm)
    drafters = {name: object() for name in RECORDED}
    out = gamma.bench_at_best_gamma(None, None, drafters, [], BenchConfig(gamma=4), first)

    # one confirming run, only for the drafters whose predicted best γ moved, without re-measuring c
    (names, gammas, measure_cost), = calls
    assert names == ["challenger", "self-spec:8"] and not measure_cost
    assert gammas["challenger"] <= 2 and gammas["self-spec:8"] == 1
    # the head takes its shorter γ (faster, lossless), keeping the c its first run measured
    head = out["challenger"]
    assert (head.gamma, head.speedup, head.cost_ratio) == (gammas["challenger"], 1.31, 0.071)
    assert head.gamma_search.measured == {4: 1.07, gammas["challenger"]: 1.31}
    assert head.gamma_search.predicted_best == gammas["challenger"]
    assert head.ideal_speedup is not None
    # n-gram's curve does not move: its γ=4 run stands, with the curve recorded
    assert (out["ngram"].gamma, out["ngram"].speedup) == (4, 1.32)
    assert out["ngram"].gamma_search.measured == {4: 1.32}
    assert sorted(out["ngram"].gamma_search.predicted_speedups) == list(gamma.GAMMAS)
    # slower when confirmed: the first run stands
    assert (out["self-spec:8"].gamma, out["self-spec:8"].speedup) == (4, 0.44)
    assert out["self-spec:8"].gamma_search.measured == {4: 0.44, 1: 0.40}


def test_a_lossy_confirmation_never_replaces_the_first_run(monkeypatch):
    from specdistill.speculative import gamma
    from specdistill.speculative.harness_bench import BenchConfig

    monkeypatch.setattr(gamma, "measure_verify_costs", lambda *a, **k: dict(BF16_COSTS))
    monkeypatch.setattr(gamma, "run_bench_many", lambda t, tok, drafters, p, c, *, gammas, **kw:
                        {name: _result(name, g, 2.0, lossless=False) for name, g in gammas.items()})
    first = {"challenger": _result("challenger", 4, 1.07, cost=0.071)}
    out = gamma.bench_at_best_gamma(None, None, {"challenger": object()}, [], BenchConfig(gamma=4), first)
    assert (out["challenger"].gamma, out["challenger"].speedup, out["challenger"].lossless) == (4, 1.07, True)


def test_a_confirmation_that_would_not_fit_the_deadline_is_skipped_and_one_cut_short_is_not_taken(monkeypatch):
    """The demo's benchmark overran its 3.5-minute share by two minutes in the γ confirmation: a run timed from
    the first would not fit is not started, and one the deadline cut (fewer prompts than the first) is not used."""
    from specdistill.budget import Deadline
    from specdistill.speculative import gamma
    from specdistill.speculative.harness_bench import BenchConfig

    monkeypatch.setattr(gamma, "measure_verify_costs", lambda *a, **k: dict(BF16_COSTS))
    first = {"challenger": replace(_result("challenger", 4, 1.07, cost=0.071), stats={"seconds": 30.0, "generated_tokens": 400})}
    assert gamma.confirmation_seconds(first, ["challenger"], repeats=2) == pytest.approx(2 * (30.0 + 400 / 21.0))
    monkeypatch.setattr(gamma, "run_bench_many", lambda *a, **k: pytest.fail("49 s of confirmation do not fit 20 s"))
    out = gamma.bench_at_best_gamma(None, None, {"challenger": object()}, [], BenchConfig(gamma=4, repeats=1), first,
                                    deadline=Deadline.after(20 / 60))
    assert (out["challenger"].gamma, out["challenger"].speedup) == (4, 1.07)
    assert "γ confirmation (~0.8 min for all) did not fit" in out["challenger"].budget_note
    assert out["challenger"].gamma_search.predicted_best != 4  # predicted, shown, not confirmed

    def cut(target, tokenizer, drafters, prompts, config, *, gammas, deadline):
        assert deadline is not None  # the confirmation runs under the same deadline
        return {n: replace(_result(n, g, 1.5), budget_note="time budget reached: 2 of 10 prompts") for n, g in gammas.items()}

    monkeypatch.setattr(gamma, "run_bench_many", cut)
    out = gamma.bench_at_best_gamma(None, None, {"challenger": object()}, [], BenchConfig(gamma=4), first,
                                    deadline=Deadline.after(10.0))
    assert (out["challenger"].gamma, out["challenger"].speedup) == (4, 1.07)
    assert "during the γ confirmation" in out["challenger"].budget_note


def test_under_a_tight_deadline_the_most_promising_drafters_are_confirmed_and_the_rest_say_so(monkeypatch):
    """In a fresh demo the confirmation of all six drafters (~2.2 min) did not fit the 0.9 min left, so none
    was confirmed and the head stayed at γ=4 (1.16x) where γ=2 was predicted at 1.35x. Now the drafters with
    the largest predicted speedups go first, as many as fit."""
    from specdistill.budget import Deadline
    from specdistill.speculative import gamma
    from specdistill.speculative.harness_bench import BenchConfig

    monkeypatch.setattr(gamma, "measure_verify_costs", lambda *a, **k: dict(BF16_COSTS))
    first = {"challenger": replace(_result("challenger", 4, 1.07, cost=0.071), stats={"seconds": 30.0, "generated_tokens": 400}),
             "self-spec:8": replace(_result("self-spec:8", 4, 0.44, cost=0.36), stats={"seconds": 30.0, "generated_tokens": 400})}
    ran = {}

    def confirm(target, tokenizer, drafters, prompts, config, *, gammas, deadline):
        ran.update(gammas)
        return {n: _result(n, g, 1.31) for n, g in gammas.items()}

    monkeypatch.setattr(gamma, "run_bench_many", confirm)
    # one drafter's confirmation takes 30 + 400/21 ≈ 49 s, both 79 s: 60 s leave time for the head alone
    out = gamma.bench_at_best_gamma(None, None, {n: object() for n in first}, [], BenchConfig(gamma=4, repeats=1), first,
                                    deadline=Deadline.after(1.0))
    assert list(ran) == ["challenger"] and out["challenger"].speedup == 1.31 and out["challenger"].budget_note == ""
    assert out["self-spec:8"].gamma == 4 and "(confirmed: challenger)" in out["self-spec:8"].budget_note


def test_nothing_runs_again_when_every_drafter_is_at_its_best_gamma(monkeypatch):
    from specdistill.speculative import gamma
    from specdistill.speculative.harness_bench import BenchConfig

    monkeypatch.setattr(gamma, "measure_verify_costs", lambda *a, **k: dict(BF16_COSTS))
    monkeypatch.setattr(gamma, "run_bench_many", lambda *a, **k: pytest.fail("no γ moved: no second run"))
    first = {"ngram": _result("ngram", 4, 1.32, cost=0.004)}
    assert gamma.bench_at_best_gamma(None, None, {"ngram": object()}, [], BenchConfig(gamma=4), first)["ngram"].gamma == 4


def test_a_run_that_never_drafted_predicts_no_gain_and_moves_no_gamma(monkeypatch):
    """`bench --ngram --max-new-tokens 4`: every step a plain step (u = 1.0) failed after the whole
    benchmark ("plain-step share must be in [0, 1)") and lost its result; the nightly calls the same code."""
    from specdistill.speculative import gamma
    from specdistill.speculative.gamma import plain_step_share, render_curve, speedup_curve
    from specdistill.speculative.harness_bench import BenchConfig

    stats = {"requests": 4, "generated_tokens": 16, "rounds": 0, "target_forwards": 16}
    assert plain_step_share(stats) == 1.0
    assert predict_speedups([], 0.0, dict(BF16_COSTS), range(1, 5), plain_share=1.0) == {g: 1.0 for g in range(1, 5)}
    curve = speedup_curve(None, [], 0.0, range(1, 5), plain_share=1.0, measured=dict(BF16_COSTS))
    assert curve["best_gamma"] is None and "no drafting round" in render_curve(curve, "float32", 0.0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        predict_speedups([], 0.0, dict(BF16_COSTS), range(1, 5), plain_share=1.5)

    monkeypatch.setitem(RECORDED, "idle-ngram", dict(per_position=[0.0] * 4, cost=0.004, speedup=0.98, stats=stats))
    monkeypatch.setattr(gamma, "measure_verify_costs", lambda *a, **k: dict(BF16_COSTS))
    monkeypatch.setattr(gamma, "run_bench_many", lambda *a, **k: pytest.fail("nothing to confirm without a round"))
    first = {"idle-ngram": _result("idle-ngram", 4, 0.98, cost=0.004)}
    out = gamma.bench_at_best_gamma(None, None, {"idle-ngram": object()}, [], BenchConfig(gamma=4), first)
    assert (out["idle-ngram"].gamma, out["idle-ngram"].speedup) == (4, 0.98)
    assert out["idle-ngram"].gamma_search.predicted_best is None
