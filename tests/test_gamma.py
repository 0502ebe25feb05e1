"""γ is chosen from measured per-position acceptance, draft cost and verification cost."""

from __future__ import annotations

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
