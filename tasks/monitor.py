"""The monitoring flow's tasks: each wraps one library call."""

from __future__ import annotations

from prefect import task

from specdistill.pipeline import monitor as mc
from specdistill.pipeline.config import MonitorConfig


@task(name="detect-target-change", retries=2, retry_delay_seconds=5)
def detect_target_change(config: MonitorConfig, champion: dict | None) -> dict:
    return mc.detect_drift(config, champion)


@task(name="sample-acceptance")
def sample_acceptance(config: MonitorConfig, champion: dict, target: dict) -> dict:
    return mc.sample_acceptance(config, champion, target)


@task(name="choose-fallback")
def choose_fallback(config: MonitorConfig, target: dict) -> dict:
    return mc.measure_fallback(config, target)


@task(name="apply-fallback", retries=2, retry_delay_seconds=5)
def apply_fallback(config: MonitorConfig, fallback: dict, target: dict) -> dict | None:
    return mc.apply_fallback(config, fallback, target)


@task(name="record-decision", retries=2, retry_delay_seconds=5)
def record_decision(config: MonitorConfig, outcome: dict) -> dict:
    return mc.record_decision(config, outcome)
