"""Wall-clock budgets: a stage stops cleanly at its count or its time, whichever comes first.

The same nightly runs on machines an order of magnitude apart (a bf16 CPU answers 4x faster than
an fp32 one; a GPU, 100x), so a count alone makes a run's length a property of the hardware. The
nightly's `deadline_minutes` is shared among the stages still to run in proportion to their own
budgets (`share`), so a slow machine does less of each stage rather than running past its window.
Deadlines are absolute wall-clock times, so they mean the same in every process and thread.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Deadline:
    at: float | None = None  # seconds since the epoch; None: no limit

    @classmethod
    def after(cls, minutes: float | None, *, now: float | None = None) -> Deadline:
        if minutes is None:
            return cls(None)
        if minutes < 0 or math.isnan(minutes):
            raise ValueError(f"a time budget must be ≥ 0 minutes, got {minutes}")
        return cls((time.time() if now is None else now) + 60.0 * minutes)

    def remaining(self, now: float | None = None) -> float:
        if self.at is None:
            return math.inf
        return max(0.0, self.at - (time.time() if now is None else now))

    def expired(self, now: float | None = None) -> bool:
        return self.at is not None and self.remaining(now) <= 0.0

    def sooner(self, other: Deadline | None) -> Deadline:
        if other is None or other.at is None:
            return self
        if self.at is None:
            return other
        return self if self.at <= other.at else other

    def minutes(self, now: float | None = None) -> float | None:
        left = self.remaining(now)
        return None if math.isinf(left) else left / 60.0


def share(run: Deadline, budgets: Sequence[float | None], *, now: float | None = None) -> Deadline:
    """The deadline of the first of the stages still to run, whose own budgets (minutes) are
    `budgets`: its own budget, cut to its proportional share of what the whole run has left.

    Stages without a budget of their own (None) take no share and get the run's deadline.
    """
    now = time.time() if now is None else now
    own = budgets[0]
    mine = Deadline.after(own, now=now) if own is not None else Deadline(None)
    if run.at is None:
        return mine
    total = sum(b for b in budgets if b is not None)
    if own is None or total <= 0:
        return mine.sooner(run)
    return mine.sooner(Deadline(now + run.remaining(now) * own / total))
