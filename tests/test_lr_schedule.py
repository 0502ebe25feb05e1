"""The learning-rate schedule follows whichever budget runs out first: steps or minutes."""

from __future__ import annotations

import pytest

from specdistill.distill.distill_recipe import OptimConfig
from specdistill.distill.train import lr_at


def test_a_time_capped_run_decays_to_its_floor():
    cfg = OptimConfig(lr=1e-3, min_lr_ratio=0.1, warmup_steps=10, max_steps=400, max_minutes=3.0)
    assert lr_at(5, cfg, 1.0) == pytest.approx(1e-3 * 6 / 10)  # warmup is by steps
    # step 150 of 400 alone would be early in the cosine; 3 minutes spent means the end of it
    assert lr_at(150, cfg, 0.0) > 0.7e-3
    assert lr_at(150, cfg, 90.0) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))  # halfway by time
    assert lr_at(150, cfg, 180.0) == pytest.approx(1e-4)
    assert lr_at(150, cfg, 999.0) == pytest.approx(1e-4)


def test_without_a_time_budget_the_steps_clock_it():
    cfg = OptimConfig(lr=1e-3, min_lr_ratio=0.0, warmup_steps=0, max_steps=100)
    assert lr_at(50, cfg, 1e6) == pytest.approx(0.5e-3)
    assert lr_at(100, cfg) == pytest.approx(0.0)
