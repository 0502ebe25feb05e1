"""Wall-clock budgets (`specdistill.budget`): deadlines and the whole run's share per stage."""

from __future__ import annotations

import math

import pytest

from specdistill.budget import Deadline, share


def test_deadline_counts_down_and_never_goes_negative():
    d = Deadline.after(2.0, now=1000.0)
    assert d.at == 1120.0 and d.remaining(now=1060.0) == 60.0 and d.minutes(now=1060.0) == 1.0
    assert not d.expired(now=1119.9) and d.expired(now=1120.0) and d.remaining(now=2000.0) == 0.0
    assert Deadline.after(None).remaining() == math.inf and Deadline().minutes() is None and not Deadline().expired()
    assert Deadline(5.0).sooner(Deadline(3.0)).at == 3.0 and Deadline(None).sooner(Deadline(3.0)).at == 3.0
    assert Deadline(5.0).sooner(None).at == 5.0
    with pytest.raises(ValueError, match="≥ 0 minutes"):
        Deadline.after(-1)


def test_a_stage_gets_its_own_budget_cut_to_its_share_of_what_the_run_has_left():
    now = 0.0
    # 20 minutes left for stages of 8, 6, 6 minutes: enough for all, each keeps its own budget
    assert share(Deadline(1200.0), [8, 6, 6], now=now).at == 480.0
    # 10 minutes left: the first stage gets 8/20 of them
    assert share(Deadline(600.0), [8, 6, 6], now=now).at == pytest.approx(240.0)
    # no run deadline: the stage's own budget; no own budget: the run's deadline
    assert share(Deadline(None), [8, 6], now=now).at == 480.0
    assert share(Deadline(600.0), [None, 6], now=now).at == 600.0
    assert share(Deadline(None), [None], now=now).at is None
    # the run is over: every later stage's deadline is now
    assert share(Deadline(0.0), [3, 3], now=100.0).expired(now=100.0)
