"""The monitoring flow's stages: has the target drifted, how well does the champion still draft on
the traffic the nightly evaluates on, which fallback to serve, how a drop becomes an incremental
nightly run, and how every decision is recorded (log store, MLflow, Prometheus). The decision in
words is `pipeline.report.render_outcome`."""

from __future__ import annotations

import contextlib
import json
import logging
from datetime import datetime

from specdistill import hardware
from specdistill.acceptance import DraftCounts
from specdistill.budget import Deadline, share
from specdistill.data.logstore import LogStore
from specdistill.modeling.models import LoadedModel, shared_model
from specdistill.ops import replay
from specdistill.ops.metrics import SpecDecodeMetrics, sample_live_acceptance
from specdistill.ops.policy import FIRST_POSITION_TAG, SHAPE_GAMMA_TAG, SHAPE_TREE_TAG, Decision, judge_acceptance
from specdistill.ops.replay import AcceptanceSample, FallbackDecision, held_out_prompts
from specdistill.ops.serving import ServingConfig, ServingConfigError, read_serving_config, write_serving_config
from specdistill.ops.targets import TargetChange, TargetVersion, detect_change
from specdistill.pipeline.layout import current_corpus_path
from specdistill.pipeline.monitor_recipe import MonitorConfig
from specdistill.pipeline.outputs import AppliedFallback, Champion, MonitorOutcome, RecordedDecision, Sample
from specdistill.pipeline.serving import draft_free_fields
from specdistill.speculative.threads import ThreadWatch, chosen_threads

STAGES = ("replay", "fallback")  # the monitor's budgeted stages, in the order they run
PROBE_PROMPT_TOKENS = 64  # the thread probe times decoding, not a long prompt's prefill (which favours more threads)


def incremental_overrides(config: MonitorConfig, change: TargetChange) -> list[str]:
    """The nightly run the monitor starts: traffic since the target update plus a replay share of
    older traffic; all traffic when nothing has arrived since (the update is then the only news).
    After a target update, the new version's answer pool starts with the old pool's most recent
    prompts answered by the new target (`pool.reanswer_prompts` of them)."""
    overrides = [f"target={change.current.path}", *config.nightly_overrides,
                 f"window.replay_share={config.replay_share}"]
    old = change.champion_target or (change.previous.fingerprint if change.previous else None)
    if change.drifted and old and old != change.current.fingerprint:
        overrides.append(f"pool.reanswer_from={old}")  # the new version's pool starts from the old one's prompts
    since = change.current.registered_at if change.drifted else None
    if since:
        with LogStore(config.nightly.log_db) as store:
            fresh = store.count(since=datetime.fromisoformat(since), split="train")
        if fresh:
            overrides.append(f"window.since={since}")
    return overrides


def record_decision(config: MonitorConfig, outcome: MonitorOutcome) -> RecordedDecision:
    """Every decision with its numbers: a log store row, an MLflow run, and Prometheus gauges."""
    import mlflow  # lazy: keeps mlflow off import

    from specdistill.ops import registry  # lazy: keeps mlflow off import

    target, sample, champion, kind = outcome.change.current, outcome.sample, outcome.champion, outcome.decision
    with LogStore(config.nightly.log_db) as store:
        row = store.add_decision(kind, target.fingerprint, champion.version if champion else None, outcome.to_json())

    registry.client()
    with mlflow.start_run(experiment_id=registry.experiment_for(config.nightly.target_name),
                          run_name=f"monitor-{kind}"):
        mlflow.set_tags({"kind": "monitor", "decision": kind, "target_fingerprint": target.fingerprint,
                         "target_changed": str(outcome.change.changed),
                         "draft_version": str(champion.version if champion else None)})
        if sample is not None and sample.acceptance_rate is not None:
            mlflow.log_metrics({"acceptance_rate": sample.acceptance_rate,
                                "accepted_length": sample.mean_accepted_length or 0.0})
        if sample is not None and sample.first_position_acceptance is not None:
            mlflow.log_metric("first_position_acceptance", sample.first_position_acceptance)
        if outcome.stage_seconds:  # what the decision cost: each stage's minutes, beside the deadline
            mlflow.log_metrics({f"{stage}_minutes": seconds / 60 for stage, seconds in outcome.stage_seconds.items()})
        fallback = outcome.fallback
        for c in fallback.candidates if fallback else []:
            name = c.mode + (f"_at_{c.exit_layer}" if c.exit_layer else "")
            mlflow.log_metric(f"fallback_{name}_speedup", c.speedup)
        mlflow.log_text(json.dumps(outcome.to_dict(), indent=2, default=str), "decision.json")

    metrics = SpecDecodeMetrics()
    if isinstance(sample, AcceptanceSample) and sample.ok:  # a live engine's counters are its own to export
        metrics.record(sample.counts.served(sample.gamma))
    serving = _read_serving(config, metrics)  # a bad file: the decision is kept (stored above), and the run fails
    if serving is not None:
        metrics.set_serving(serving.mode, target_fingerprint=target.fingerprint, draft_version=serving.draft_version)
    pushed = metrics.push(job="specdistill-monitor")
    return RecordedDecision(log_store_row=row, pushed=pushed)


def check_serving_config(config: MonitorConfig) -> None:
    """Before the monitor samples anything: the serving config must be readable (or absent: nothing
    served yet). A corrupt one is an alert, never a success (`_read_serving`)."""
    _read_serving(config, SpecDecodeMetrics())


def _read_serving(config: MonitorConfig, metrics: SpecDecodeMetrics) -> ServingConfig | None:
    """The serving config; a corrupt one is counted in `specdistill_serving_config_errors_total` (pushed when a
    Pushgateway is configured) and raised as a `ServingConfigError` naming the file, so the run fails and marks
    no pipeline success."""
    try:
        return read_serving_config(config.nightly.serving_path)
    except ServingConfigError as exc:
        metrics.serving_config_errors.inc()
        try:
            metrics.push(job="specdistill-monitor")
        except Exception as push_error:  # an unreachable Pushgateway must not hide the error it reports
            logging.getLogger(__name__).warning("could not push the serving config error to the Pushgateway: %s",
                                                push_error)
        raise ServingConfigError(f"{exc}; the monitor stops and records no success (fix the file, or remove it "
                                 "to serve without speculation until the nightly writes one)") from None


def judge(config: MonitorConfig, sample: Sample, champion: Champion | None = None,
          change: TargetChange | None = None) -> tuple[Decision, str]:
    """(decision, why): keep, fallback, retrain or no-sample (`ops.policy.judge_acceptance`): the sampled
    first-position acceptance against the red line, and against the champion's own at registration (its tag).
    On the champion's own target (`change.drifted` false) only a replay sure to be under the line falls back."""
    return judge_acceptance(sample, config.red_line, registered=_registered(champion),
                            max_relative_drop=config.max_relative_drop,
                            target_changed=True if change is None else change.drifted)


def _registered(champion: Champion | None) -> float | None:
    """The champion's own first-position acceptance at registration (its tag), if it has one."""
    value = champion.tags.get(FIRST_POSITION_TAG) if champion else None
    try:
        return float(value) if value not in (None, "") else None
    except ValueError:
        return None


def decision_lines(config: MonitorConfig, champion: Champion | None) -> list[float]:
    """The first-position acceptances the decision turns on (`judge`): the red line, and the drop from the
    champion's own at registration. A replay whose 95% interval clears them all has read enough."""
    registered = _registered(champion)
    drop = [registered * (1.0 - config.max_relative_drop)] if registered else []
    return [config.red_line, *drop]


def decision_deadline(config: MonitorConfig, now: float | None = None) -> float | None:
    """When the decision (replay, fallback choice) must be taken, fixed as the flow starts (seconds since
    the epoch; None: no deadline): `deadline_minutes` from now."""
    return Deadline.after(config.deadline_minutes, now=now).at


def stage_deadline(config: MonitorConfig, stage: str, deadline_at: float | None, now: float | None = None) -> Deadline:
    """A stage's own budget, cut to its share of what the decision's deadline has left (`budget.share`)."""
    budgets = {"replay": config.replay_max_minutes, "fallback": config.fallback_max_minutes}
    if stage not in budgets:
        raise ValueError(f"{stage!r} is not a budgeted monitor stage ({', '.join(STAGES)})")
    later = STAGES[STAGES.index(stage):]
    return share(Deadline(deadline_at), [budgets[s] for s in later], now=now)


def measured_on(config: MonitorConfig) -> str:
    """The device the monitor measures on, in words (its report's stage minutes are read against it)."""
    return hardware.describe_device(config.nightly.device)


def measuring_threads(config: MonitorConfig, target: LoadedModel,
                      prompt_ids: list[int] | None) -> contextlib.AbstractContextManager[ThreadWatch | None]:
    """torch's thread count while the monitor measures, put back after: `threads: auto` probes it for
    the load found (`speculative.threads.ThreadWatch`, again when the load moves), a number sets it."""
    ids = list(prompt_ids)[-PROBE_PROMPT_TOKENS:] if prompt_ids else None
    return chosen_threads(config.threads, target.model, ids)


def detect_drift(config: MonitorConfig, champion: Champion | None) -> TargetChange:
    """Has the served target changed since the last run, or since the champion was distilled for it?"""
    changed, current, previous = detect_change(config.target_ref())
    trained_for = champion.tags.get("target_fingerprint") if champion else None
    drifted = changed or (trained_for is not None and trained_for != current.fingerprint)
    return TargetChange(changed=changed, drifted=drifted, champion_target=trained_for, current=current, previous=previous)


def sample_acceptance(config: MonitorConfig, champion: Champion, target: TargetVersion,
                      deadline_at: float | None = None) -> Sample:
    """A live engine's counters when configured, else the newest logged prompts replayed (prompts as
    the nightly defines them, within its `window.max_prompt_tokens`) until the 95% interval settles the
    decision (`decision_lines`) or the replay's share of the deadline runs out."""
    nightly = config.nightly
    with LogStore(nightly.log_db) as store:
        if config.live_metrics_url:
            live = sample_live_acceptance(config.live_metrics_url, config.live_interval_s, config.min_draft_tokens)
            if live.ok:  # the engine's counters' deltas (per position where it exports them), as whole counts
                c = live.counts
                per_position = [round(a) for a in c.accepted_per_position] if c.rounds else []
                store.add_acceptance_sample(target.fingerprint, champion.version, len(per_position), DraftCounts(
                    int(c.rounds), int(c.proposed), int(c.accepted), per_position))
            return live

        deadline = stage_deadline(config, "replay", deadline_at)
        loaded = shared_model(target.path, dtype=nightly.dtype, device=nightly.device)
        first, _ = held_out_prompts(store, loaded.tokenizer, 1, max_prompt_tokens=nightly.window.max_prompt_tokens)
        gamma, tree_width = replay_shape(config, champion)
        with measuring_threads(config, loaded, first[0].ids if first else None) as watch:
            sample = replay.replay_acceptance(
                loaded, champion.dir, store, n_prompts=config.replay_prompts, gamma=gamma, tree_width=tree_width,
                max_new_tokens=config.max_new_tokens, target_version=target.fingerprint, draft_version=champion.version,
                min_draft_tokens=config.min_draft_tokens, max_prompt_tokens=nightly.window.max_prompt_tokens,
                settle_lines=decision_lines(config, champion), deadline=deadline,
                between_prompts=watch.check if watch else None)
        sample.threads = watch.describe() if watch else ""
        return sample


def replay_shape(config: MonitorConfig, champion: Champion) -> tuple[int, int]:
    """(γ, tree width) the champion is replayed at: the shape its registration measured it at (its tags), so the
    red line reads at the monitor what it read at the gate; a version registered without them (or the monitor's
    own `gamma`) at what serving.json serves, as a chain."""
    tags = champion.tags
    try:
        gamma, width = int(tags[SHAPE_GAMMA_TAG]), int(tags.get(SHAPE_TREE_TAG, "1"))
    except (KeyError, ValueError):
        return config.replay_gamma(), 1
    if config.gamma is not None or gamma < 1 or width < 1:
        return config.replay_gamma(), 1
    return gamma, width


def measure_fallback(config: MonitorConfig, target: TargetVersion, deadline_at: float | None = None) -> FallbackDecision:
    """Each fallback timed against target-only decoding on the same replayed prompts (see `ops.replay.choose_fallback`),
    prompt by prompt until the 95% bounds settle the choice or the stage's share of the deadline runs out."""
    nightly = config.nightly
    deadline = stage_deadline(config, "fallback", deadline_at)
    loaded = shared_model(target.path, dtype=nightly.dtype, device=nightly.device)
    with LogStore(nightly.log_db) as store:
        prompts, _ = held_out_prompts(store, loaded.tokenizer, config.fallback_prompts,
                                      max_prompt_tokens=nightly.window.max_prompt_tokens)

    corpus = config.fallback_suffix_corpus or (str(current_corpus_path()) if current_corpus_path().is_file() else None)
    with measuring_threads(config, loaded, prompts[0].ids if prompts else None) as watch:
        decision = replay.choose_fallback(loaded, prompts, exit_layers=config.fallback_exit_layers, gamma=config.replay_gamma(),
                                          max_new_tokens=config.max_new_tokens, min_tokens=config.fallback_min_tokens,
                                          repeats=config.fallback_repeats, suffix_corpus=corpus, settle=True,
                                          deadline=deadline, between_rounds=watch.check if watch else None)
    decision.threads = watch.describe() if watch else ""
    return decision


def apply_fallback(config: MonitorConfig, fallback: FallbackDecision, target: TargetVersion) -> AppliedFallback | None:
    """Switch the serving config to the measured-fastest fallback (under the promotion lock)."""
    from specdistill.ops import registry  # lazy: keeps mlflow off import

    if not fallback.decided:
        return None  # no decision on too few tokens: serve as before
    spec = fallback.spec
    fields = draft_free_fields(spec, target.fingerprint, target.path, config.nightly.dtype) if spec else {"mode": "off"}
    serving = ServingConfig(**fields, num_speculative_tokens=config.replay_gamma(), target_fingerprint=target.fingerprint,
                            reason=f"monitor fallback: {fallback.reason}")
    with registry.promotion_lock():
        path = write_serving_config(serving, config.nightly.serving_path)
    return AppliedFallback(mode=fallback.mode, exit_layer=fallback.exit_layer, serving_config=str(path))
