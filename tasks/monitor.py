"""The monitoring flow's tasks: each wraps one call of `specdistill.pipeline.stages.monitor`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefect import task

from specdistill.pipeline.monitor_recipe import MonitorConfig
from specdistill.pipeline.outputs import AppliedFallback, Champion, MonitorOutcome, RecordedDecision
from specdistill.pipeline.stages import monitor as mc

if TYPE_CHECKING:  # annotations only, each from the module that defines it
    from specdistill.ops.policy.common import Sample
    from specdistill.ops.replay import FallbackDecision
    from specdistill.ops.targets import TargetChange, TargetVersion


@task(name="check-serving-config")
def check_serving_config(config: MonitorConfig) -> None:
    return mc.check_serving_config(config)


@task(name="detect-target-change", retries=2, retry_delay_seconds=5)
def detect_target_change(config: MonitorConfig, champion: Champion | None) -> TargetChange:
    return mc.detect_drift(config, champion)


@task(name="sample-acceptance")
def sample_acceptance(config: MonitorConfig, champion: Champion, target: TargetVersion,
                      deadline_at: float | None = None) -> Sample:
    return mc.sample_acceptance(config, champion, target, deadline_at)


@task(name="choose-fallback")
def choose_fallback(config: MonitorConfig, target: TargetVersion, deadline_at: float | None = None) -> FallbackDecision:
    return mc.measure_fallback(config, target, deadline_at)


@task(name="apply-fallback", retries=2, retry_delay_seconds=5)
def apply_fallback(config: MonitorConfig, fallback: FallbackDecision, target: TargetVersion) -> AppliedFallback | None:
    return mc.apply_fallback(config, fallback, target)


@task(name="record-decision", retries=2, retry_delay_seconds=5)
def record_decision(config: MonitorConfig, outcome: MonitorOutcome) -> RecordedDecision:
    return mc.record_decision(config, outcome)
