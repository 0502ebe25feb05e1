"""The gate's verdict follows its thresholds, names every reason, and refuses malformed input."""

from __future__ import annotations

import pytest

from specdistill.speculative.gate import GateConfig, evaluate, gate_config


def result(lossless=True, alpha=0.6, tau=2.5, speedup=1.2, **extra):
    return {"lossless": lossless, "acceptance_rate": alpha, "accepted_length": tau, "speedup": speedup, **extra}


def test_default_gate_passes_a_good_draft_and_lists_reasons():
    verdict = evaluate(result())
    assert verdict.passed
    assert len(verdict.reasons) == 3 and not verdict.failures
    assert any("acceptance rate 0.600 >= 0.500" in r for r in verdict.reasons)


@pytest.mark.parametrize(
    "kwargs, failing",
    [
        ({"lossless": False, "lossless_mismatches": 3}, "3 outputs differ"),
        ({"lossless": None}, "sampling run"),
        ({"alpha": 0.49}, "acceptance rate 0.490 < 0.500"),
        ({"speedup": 0.95}, "speedup 0.95 < 1.00"),
    ],
)
def test_each_default_threshold_can_fail_alone(kwargs, failing):
    verdict = evaluate(result(**kwargs))
    assert not verdict.passed
    assert len(verdict.failures) == 1 and failing in verdict.failures[0]


def test_production_profile_needs_tau_3_and_speedup_1_5():
    assert evaluate(result(tau=3.2, speedup=1.6), gate_config("production")).passed
    verdict = evaluate(result(tau=2.9, speedup=1.4), gate_config("production"))
    assert not verdict.passed
    assert len(verdict.failures) == 2
    assert evaluate(result(tau=2.9, speedup=1.4)).passed  # same numbers pass the default bar


def test_challenger_tau_against_champion_with_tolerance():
    champion = result(tau=3.0)
    assert evaluate(result(tau=2.96), GateConfig(), champion).passed
    verdict = evaluate(result(tau=2.9), GateConfig(), champion)
    assert not verdict.passed and "worse" in verdict.failures[0]
    assert evaluate(result(tau=2.9), gate_config(max_accepted_length_drop=0.2), champion).passed


def test_thresholds_can_be_switched_off_and_verdict_serializes():
    verdict = evaluate(result(alpha=0.1, speedup=0.5), GateConfig(min_acceptance_rate=None, min_speedup=None))
    assert verdict.passed and len(verdict.checks) == 1
    d = verdict.to_dict()
    assert d["passed"] and d["checks"][0]["name"] == "lossless"
    assert "PASS" in verdict.render()


def test_bad_input_errors():
    with pytest.raises(ValueError, match="lacks \\['speedup'\\]"):
        evaluate({"lossless": True, "acceptance_rate": 0.5, "accepted_length": 2})
    with pytest.raises(ValueError, match="unknown gate profile"):
        gate_config("staging")
    with pytest.raises(ValueError, match="unknown gate setting"):
        gate_config(min_alpha=0.3)
    with pytest.raises(ValueError, match="champion"):
        evaluate(result(), GateConfig(), champion=[1, 2])


def test_must_beat_is_a_check_of_its_own_and_a_missing_baseline_sets_no_bar():
    baselines = {"generic": result(alpha=0.4), "ngram": result(alpha=0.7)}
    verdict = evaluate(result(alpha=0.6), GateConfig(), baselines=baselines, must_beat=["generic", "ngram", "absent"])
    beats = {c.name: c for c in verdict.checks if c.name.startswith("beats ")}
    assert set(beats) == {"beats generic", "beats ngram"}  # "absent" was not run this time: no check
    assert beats["beats generic"].passed and (beats["beats generic"].value, beats["beats generic"].threshold) == (0.6, 0.4)
    assert not beats["beats ngram"].passed
    assert not verdict.passed and verdict.failures == ["acceptance rate 0.600 <= ngram 0.700"]
    assert not verdict.to_dict()["promote"]
    tie = evaluate(result(alpha=0.4), GateConfig(min_acceptance_rate=None), baselines=baselines, must_beat=["generic"])
    assert not tie.passed  # equal is not beating
    assert evaluate(result(alpha=0.6), GateConfig(), baselines=baselines).passed  # must_beat empty: baselines only listed


def test_promotion_needs_a_pass_and_a_better_tau_than_the_champion():
    assert evaluate(result(tau=2.5)).to_dict()["promote"]  # no champion: a pass promotes
    same = evaluate(result(tau=2.5), GateConfig(), champion=result(tau=2.5)).to_dict()
    assert same["passed"] and not same["beats_champion"] and not same["promote"]
    assert same["reasons"][-1].endswith("the champion stays") and not same["failures"]
    better = evaluate(result(tau=2.6), GateConfig(), champion=result(tau=2.5)).to_dict()
    assert better["beats_champion"] and better["promote"]
    failed = evaluate(result(tau=2.6, alpha=0.1), GateConfig(), champion=result(tau=2.5)).to_dict()
    assert failed["beats_champion"] and not failed["promote"]
    assert not any("champion stays" in r for r in failed["reasons"])
    assert set(same) == {"passed", "checks", "reasons", "failures", "beats_champion", "promote"}


def test_promotion_needs_a_tau_gain_of_at_least_the_margin():
    champion = result(tau=1.33)
    small = evaluate(result(tau=1.34), GateConfig(), champion=champion)  # default margin 0.02
    assert small.passed and not small.beats_champion and not small.promote
    assert small.reasons[-1] == ("accepted length 1.34 does not beat the champion's 1.33 (gain +0.010, promotion "
                                 "margin min_accepted_length_gain 0.020): the champion stays")
    big = evaluate(result(tau=1.36), GateConfig(), champion=champion)
    assert big.promote and "promotion margin min_accepted_length_gain 0.020" in big.reasons[-1]
    assert big.reasons[-1].endswith("the challenger replaces it")
    assert evaluate(result(tau=1.35), GateConfig(), champion=champion).promote  # exactly the margin is enough
    wider = gate_config(min_accepted_length_gain=0.05)
    assert not evaluate(result(tau=1.36), wider, champion=champion).promote
    assert "margin min_accepted_length_gain 0.050" in evaluate(result(tau=1.36), wider, champion=champion).reasons[-1]
    no_margin = GateConfig(min_accepted_length_gain=0.0)
    assert evaluate(result(tau=1.34), no_margin, champion=champion).promote
    assert not evaluate(result(tau=1.33), no_margin, champion=champion).promote  # equal never replaces it
    with pytest.raises(ValueError, match="min_accepted_length_gain"):
        evaluate(result(), GateConfig(min_accepted_length_gain=-0.1), champion=champion)
