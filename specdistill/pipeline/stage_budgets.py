"""The nightly's time budgets: each budgeted stage's deadline, and the stage times the report shows.

A stage's deadline is its own budget cut to its share of what the run's `deadline_minutes` has left
(`budget.share`), the share of each stage still to run in proportion to its own budget. Stages without
a budget of their own (ingest, the held-out answers, features, registration) take their time from
what is left for the later ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specdistill import hardware
from specdistill.budget import Deadline, share
from specdistill.pipeline.nightly_recipe import NightlyConfig


def stage_budgets(config: NightlyConfig) -> dict[str, float | None]:
    """Each budgeted stage's own budget in minutes (None: none; a stage the run skips: absent)."""
    b, train_minutes = config.bench, config.train.optim.max_minutes
    budgets = {"answers": config.generation.max_minutes, "distill": train_minutes}
    if b.generic_draft:
        budgets["generic"] = b.generic_minutes if b.generic_minutes is not None else train_minutes
    budgets["benchmark"] = b.max_minutes
    if config.serving.engine != "harness":
        budgets["engine benchmark"] = b.max_minutes
    return budgets


# what the stages after the benchmark take (the gate, registration, the serving config): 0.2 minute in
# one demo, 0.5 in another on a slow instance of the same 2-core Xeon (2026-12-03)
CLOSING_MINUTES = 0.5


def run_deadline(config: NightlyConfig, now: float | None = None) -> float | None:
    """The budgeted stages' deadline (seconds since the epoch), fixed when the flow starts; None without
    one: `deadline_minutes` less `CLOSING_MINUTES`, so the closing stages end inside the run's deadline."""
    if config.deadline_minutes is None:
        return None
    return Deadline.after(max(0.0, config.deadline_minutes - CLOSING_MINUTES), now=now).at


def stage_deadline(config: NightlyConfig, stage: str, deadline_at: float | None, now: float | None = None) -> Deadline:
    budgets = stage_budgets(config)
    if stage not in budgets:
        raise ValueError(f"{stage!r} is not a budgeted stage ({', '.join(budgets)})")
    later = list(budgets)[list(budgets).index(stage):]
    return share(Deadline(deadline_at), [budgets[s] for s in later], now=now)


@dataclass
class StageClock:
    """Wall time per stage of one run, and what a budget cut, for the report."""

    started: float = field(default_factory=time.time)
    seconds: dict[str, float] = field(default_factory=dict)
    cuts: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # optional work the deadline left no time for, and why
    notes: list[str] = field(default_factory=list)  # how a stage was run where the run measured it (the answer engine)
    _last: float | None = None

    def lap(self, stage: str) -> None:
        """The time since the previous lap (or the start) was spent on `stage`."""
        now = time.time()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - (self._last or self.started)
        self._last = now

    def report(self, config: NightlyConfig) -> str:
        total = (self._last or time.time()) - self.started
        rows = " · ".join(f"{stage} {s / 60:.1f}" for stage, s in self.seconds.items())
        budget = f" of a {config.deadline_minutes:g}-minute deadline" if config.deadline_minutes is not None else ""
        lines = [f"**stage times** (minutes, {total / 60:.1f} in all{budget}): {rows}",
                 f"measured on: {hardware.describe_device(config.device)}", *self.notes]
        lines += [f"- cut by its time budget: {cut}" for cut in self.cuts]
        lines += [f"- skipped for lack of time: {skip}" for skip in self.skipped]
        return "\n".join(lines)
