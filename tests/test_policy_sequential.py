"""When the monitor has measured enough prompts: the replay's bound on either side of the red line,
the fallback's leader ahead of target-only and of every rival, at 95%."""

from __future__ import annotations

import pytest

from specdistill.ops.policy import speedup_lower_bound
from specdistill.ops.policy.sequential import acceptance_interval, acceptance_settled, leader_settled

STEADY_FAST = [1.7, 1.8, 1.75, 1.9, 1.72, 1.8]
STEADY_SLOW = [1.2, 1.25, 1.15, 1.3, 1.2, 1.22]
NEAR = [1.68, 1.85, 1.7, 1.88, 1.75, 1.78]
FLAT = [0.95, 1.0, 0.98, 1.02, 0.97, 0.99]


def test_a_replay_far_under_the_red_line_settles_and_one_straddling_it_does_not():
    rounds = [30] * 6
    low = acceptance_settled(rounds, [3, 4, 2, 5, 4, 3], [0.5])
    assert low.settled and "lies under 0.500" in low.why
    lo, hi = acceptance_interval(rounds, [3, 4, 2, 5, 4, 3])
    assert lo <= 21 / 180 <= hi < 0.5
    straddles = acceptance_settled(rounds, [5, 25, 8, 24, 12, 20], [0.5])
    assert not straddles.settled and "straddles 0.500" in straddles.why
    # a second line (the drop from the champion's own at registration) must be cleared too
    high = [22, 23, 24, 22, 23, 24]
    assert acceptance_settled(rounds, high, [0.5]).settled
    assert not acceptance_settled(rounds, high, [0.5, 0.76]).settled
    assert "over 0.500, over 0.700" in acceptance_settled(rounds, high, [0.5, 0.7]).why


def test_a_replay_settles_no_sooner_than_its_minimum_prompts():
    few = acceptance_settled([30] * 3, [1, 1, 1], [0.5])
    assert not few.settled and "3 prompts read, fewer than the 6" in few.why
    assert acceptance_settled([30] * 3, [1, 1, 1], [0.5], min_prompts=3).settled
    assert not acceptance_settled([0] * 6, [0] * 6, [0.5]).settled  # no round drafted: nothing to bound
    assert acceptance_interval([0, 0], [0, 0]) is None


def test_a_leader_ahead_of_the_bar_and_of_every_rival_settles_the_choice():
    s = leader_settled({"ngram": STEADY_FAST, "self-spec:8": STEADY_SLOW, "self-spec:12": FLAT})
    assert s.settled and "the leader ngram is at least" in s.why and "ahead of self-spec:8" in s.why
    # its bound is the serving choice's own
    assert f"at least {speedup_lower_bound(STEADY_FAST):.2f}x" in s.why


def test_a_leader_not_yet_ahead_of_a_close_rival_does_not_settle():
    s = leader_settled({"ngram": STEADY_FAST, "suffix": NEAR})
    assert not s.settled and "is not yet ahead of" in s.why


def test_a_leader_whose_gain_comes_from_a_few_prompts_does_not_settle():
    few_carry = [3.5, 1.0, 1.02, 0.98, 3.2, 1.01]
    s = leader_settled({"ngram": few_carry, "self-spec:8": FLAT})
    assert not s.settled and "lower bound over 6 prompts" in s.why and "not above 1.05x" in s.why


def test_no_mode_that_can_beat_target_only_settles_the_choice_off():
    s = leader_settled({"ngram": FLAT, "self-spec:8": [0.9, 0.92, 0.95, 0.91, 0.9, 0.93]})
    assert s.settled and "no mode can beat target-only" in s.why


def test_the_choice_needs_its_minimum_prompts_and_the_same_prompts_for_every_mode():
    s = leader_settled({"ngram": STEADY_FAST[:4], "self": STEADY_SLOW[:4]})
    assert not s.settled and "4 prompts measured, fewer than the 5" in s.why
    with pytest.raises(ValueError, match="same prompts"):
        leader_settled({"ngram": STEADY_FAST, "self": STEADY_SLOW[:4]})


def test_modes_that_can_no_longer_win_are_named_and_the_leader_never():
    from specdistill.ops.policy.sequential import beaten

    out = beaten({"ngram": STEADY_FAST, "self-spec:8": STEADY_SLOW, "self-spec:12": FLAT, "suffix": NEAR})
    assert set(out) == {"self-spec:8", "self-spec:12"}  # the close rival stays in the running
    assert out["self-spec:12"].startswith("its 95% upper bound over 6 prompts is") and "behind ngram" in out["self-spec:8"]
    assert beaten({"ngram": STEADY_FAST[:4], "self": FLAT[:4]}) == {}  # too few prompts to drop anything
    assert beaten({"ngram": FLAT}) == {}
