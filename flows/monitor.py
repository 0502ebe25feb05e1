"""The monitoring flow: is the champion still drafting well for the target being served?

    target fingerprint changed? -> sample acceptance (replay of recent prompts, or a live engine's
    counters) -> Prometheus metrics -> first-position acceptance >= 0.5: keep the champion
                                    -> below 0.5: switch serving to the fastest fallback (self-speculation,
                                       n-gram, or off) and run the nightly distill-benchmark-gate-promote
                                       path warm-started from the champion; a promotion puts the serving
                                       config back in draft mode.
                                    -> above 0.5 but far under the champion's own at registration (drift):
                                       keep serving it and run the same incremental path.

A serving config that cannot be read stops the run before anything is sampled: it is counted as an
error and the pipeline's success is not marked (`pipeline.stages.monitor.check_serving_config`).

The decision (replay, fallback choice) is budgeted: `deadline_minutes` from the flow's start, shared by
the two stages; each reads prompts until a 95% bound settles it or its time runs out. The report gives
each stage's minutes. `retrain=false` stops after the decision and the fallback.

Runs on a schedule and on the `specdistill.target.updated` event (deploy/prefect.yaml).
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from flows.nightly import nightly
from specdistill.pipeline.monitor_recipe import load_monitor_config
from specdistill.pipeline.nightly_recipe import flow_overrides
from specdistill.pipeline.outputs import MonitorOutcome
from specdistill.pipeline.report import render_outcome
from specdistill.pipeline.stage_budgets import StageClock
from specdistill.pipeline.stages import monitor as mc
from specdistill.state_lock import state_lock
from tasks import monitor as t
from tasks import nightly as nt


@flow(name="monitor", log_prints=True)
def monitor(config_path: str | None = None, overrides: list[str] | None = None,
            fingerprint: str | None = None) -> MonitorOutcome:
    with state_lock("monitor"):  # one run per state directory; the nightly it starts runs inside it
        return _monitor(config_path, overrides, fingerprint)


def _monitor(config_path: str | None, overrides: list[str] | None, fingerprint: str | None) -> MonitorOutcome:
    config = load_monitor_config(config_path, overrides)
    deadline_at, clock = mc.decision_deadline(config), StageClock()  # deadline_minutes, shared by replay and fallback
    log = get_run_logger()
    if fingerprint:
        log.info("triggered by specdistill.target.updated for target %s", fingerprint)

    t.check_serving_config(config)  # a corrupt serving config fails the run here: an alert, never a success
    champion = nt.current_champion(config.nightly)
    change = t.detect_target_change(config, champion)
    if champion is None:
        log.info("no champion registered yet: nothing to monitor")
        return MonitorOutcome(change, mc.Decision.NO_CHAMPION)
    clock.lap("start")

    sample = t.sample_acceptance(config, champion, change.current, deadline_at)
    decision, why = mc.judge(config, sample, champion, change)
    outcome = MonitorOutcome(change, decision, champion=champion, sample=sample, decision_reason=why,
                             deadline_minutes=config.deadline_minutes,
                             measured_on=mc.measured_on(config))
    clock.lap("replay")
    if decision == mc.Decision.FALLBACK:
        outcome.fallback = t.choose_fallback(config, change.current, deadline_at)
        outcome.serving = t.apply_fallback(config, outcome.fallback, change.current)
        clock.lap("fallback")
    if decision in (mc.Decision.FALLBACK, mc.Decision.RETRAIN) and config.retrain:
        # a nested flow's parameters are stored too: its overrides carry no credential (`flow_overrides`)
        outcome.incremental = nightly(config_path=config.nightly_config,
                                      overrides=flow_overrides(mc.incremental_overrides(config, change)))
        clock.lap("retraining")
    outcome.stage_seconds = dict(clock.seconds)
    t.record_decision(config, outcome)
    clock.lap("record")
    outcome.stage_seconds = dict(clock.seconds)
    report = render_outcome(outcome)
    create_markdown_artifact(report, key="monitor-decision", description="acceptance and what the monitor did")
    log.info("\n%s", report)
    outcome.report = report
    nt.mark_success(config.nightly, "monitor", change.current.fingerprint)
    return outcome


if __name__ == "__main__":
    monitor()
