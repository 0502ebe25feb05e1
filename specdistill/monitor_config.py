"""What the monitoring flow is configured with, how it turns a drop into an incremental run, and
how every decision is recorded (log store, MLflow, Prometheus, a readable report)."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from specdistill import paths
from specdistill.pipeline import NightlyConfig, load_nightly_config


class MonitorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: str | None = None  # the target being served (None: the last `target register`ed, else demo)
    nightly_config: str | None = None  # the nightly flow's config for incremental distillation
    nightly_overrides: list[str] = []
    threshold: float = Field(0.5, gt=0.0, lt=1.0)  # acceptance below this: fallback + retrain
    replay_prompts: int = Field(12, ge=1)
    gamma: int = Field(4, ge=1)
    max_new_tokens: int = Field(32, ge=1)
    min_draft_tokens: int = Field(64, ge=1)  # fewer sampled tokens: no sample, no decision
    live_metrics_url: str | None = None  # a serving engine's /metrics (vLLM names); else replay
    live_interval_s: float = Field(30.0, gt=0.0)
    fallback_exit_layers: list[int] = [4, 8, 12]
    fallback_min_tokens: int = Field(64, ge=1)
    fallback_repeats: int = Field(1, ge=1)
    replay_share: float = Field(0.25, ge=0.0, lt=1.0)  # of older traffic in the incremental run

    def target_ref(self) -> str:
        from specdistill.targets import current_target

        if self.target:
            return self.target
        registered = current_target()
        return registered.ref if registered else "demo"

    @property
    def nightly(self) -> NightlyConfig:
        return load_nightly_config(self.nightly_config, [f"target={self.target_ref()}", *self.nightly_overrides])


def load_monitor_config(path: str | Path | None = None, overrides: list[str] | None = None) -> MonitorConfig:
    from specdistill.config import ConfigError, load_model_config

    config = load_model_config(MonitorConfig, path, overrides, what="monitor config")
    try:
        config.nightly  # the nightly config it names must be valid too, before any work
    except ConfigError as exc:
        raise ConfigError(f"{path or 'monitor config'}: nightly_config: {exc}") from None
    return config


def incremental_overrides(config: MonitorConfig, change: dict) -> list[str]:
    """The nightly run the monitor starts: traffic since the target update plus a replay share of
    older traffic; all traffic when nothing has arrived since (the update is then the only news)."""
    from datetime import datetime

    from specdistill.logstore import LogStore

    overrides = [f"target={change['current']['path']}", *config.nightly_overrides,
                 f"window.replay_share={config.replay_share}"]
    since = change["current"]["registered_at"] if change.get("drifted") else None
    if since:
        store = LogStore(config.nightly.log_db)
        try:
            fresh = store.count(since=datetime.fromisoformat(since), split="train")
        finally:
            store.close()
        if fresh:
            overrides.append(f"window.since={since}")
    return overrides


def record_decision(config: MonitorConfig, outcome: dict) -> dict:
    """Every decision with its numbers: a log store row, an MLflow run, and Prometheus gauges."""
    import mlflow

    from specdistill import registry
    from specdistill.logstore import LogStore
    from specdistill.metrics import SpecDecodeMetrics
    from specdistill.serving import read_serving_config

    target = outcome["change"]["current"]
    sample = outcome.get("sample") or {}
    champion = outcome.get("champion") or {}
    kind = outcome["decision"]
    store = LogStore(config.nightly.log_db)
    try:
        row = store.add_decision(kind, target["fingerprint"], champion.get("version"),
                                 json.dumps(outcome, default=str, sort_keys=True))
    finally:
        store.close()

    registry.client()
    with mlflow.start_run(experiment_id=registry.experiment_for(config.nightly.target_name),
                          run_name=f"monitor-{kind}"):
        mlflow.set_tags({"kind": "monitor", "decision": kind, "target_fingerprint": target["fingerprint"],
                         "target_changed": str(outcome["change"]["changed"]),
                         "draft_version": str(champion.get("version"))})
        if sample.get("acceptance_rate") is not None:
            mlflow.log_metrics({"acceptance_rate": sample["acceptance_rate"],
                                "accepted_length": sample.get("mean_accepted_length") or 0.0})
        fallback = outcome.get("fallback") or {}
        for c in fallback.get("candidates", []):
            name = c["mode"] + (f"_at_{c['exit_layer']}" if c.get("exit_layer") else "")
            mlflow.log_metric(f"fallback_{name}_speedup", c["speedup"])
        mlflow.log_text(json.dumps(outcome, indent=2, default=str), "decision.json")

    metrics = SpecDecodeMetrics()
    if sample.get("ok") and sample.get("rounds") is not None:
        metrics.record(rounds=int(sample.get("rounds", 0)), proposed=int(sample.get("proposed", 0)),
                       accepted=int(sample.get("accepted", 0)),
                       accepted_per_position=[int(x) for x in sample.get("accepted_per_position", [])])
    serving = read_serving_config(config.nightly.serving_path)
    if serving is not None:
        metrics.set_serving(serving.mode, target_fingerprint=target["fingerprint"], draft_version=serving.draft_version)
    pushed = metrics.push(job="specdistill-monitor")
    return {"log_store_row": row, "pushed": pushed}


def render_outcome(outcome: dict) -> str:
    change, sample = outcome["change"], outcome.get("sample") or {}
    lines = [f"target {change['current']['fingerprint']}" + (
        f" (changed from {change['previous']['fingerprint']})" if change.get("changed") and change.get("previous") else "")]
    if sample:
        if sample.get("ok"):
            lines.append(f"acceptance α {sample['acceptance_rate']:.3f}, τ {sample.get('mean_accepted_length') or 0:.2f} "
                         f"over {sample.get('proposed', sample.get('draft_tokens', 0)):g} draft tokens ({sample.get('source', 'live')})")
        else:
            lines.append(f"no acceptance sample: {sample.get('reason')}")
    lines.append(f"decision: **{outcome['decision']}**")
    fb = outcome.get("fallback")
    if fb:
        lines.append(f"fallback: {fb.get('mode')} — {fb.get('reason')}")
    inc = outcome.get("incremental")
    if inc:
        reg = inc["registered"]
        lines.append(f"incremental distillation: version {reg['version']}, gate {'PASS' if inc['verdict']['passed'] else 'FAIL'}"
                     + (", promoted: serving the draft again" if inc["promoted"] else ", not promoted: fallback stays"))
    return "\n\n".join(lines)


def fallback_dir(fingerprint: str, exit_layer: int) -> Path:
    return paths.ensure(paths.home() / "fallback") / f"early-exit-{fingerprint}-{exit_layer}"


def detect_drift(config: MonitorConfig, champion: dict | None) -> dict:
    """Has the served target changed since the last run, or since the champion was distilled for it?"""
    from specdistill.targets import detect_change

    changed, current, previous = detect_change(config.target_ref())
    trained_for = (champion or {}).get("tags", {}).get("target_fingerprint")
    drifted = changed or (trained_for is not None and trained_for != current.fingerprint)
    return {"changed": changed, "drifted": drifted, "champion_target": trained_for,
            "current": current.to_dict(), "previous": previous.to_dict() if previous else None}


def sample_acceptance(config: MonitorConfig, champion: dict, target: dict) -> dict:
    """A live engine's counters when configured, else the newest logged prompts replayed."""
    from specdistill.logstore import LogStore

    store = LogStore(config.nightly.log_db)
    try:
        if config.live_metrics_url:
            from specdistill.metrics import sample_live_acceptance

            live = sample_live_acceptance(config.live_metrics_url, config.live_interval_s, config.min_draft_tokens)
            if live.ok:
                store.add_acceptance_sample(target["fingerprint"], champion["version"], 0, int(live.drafts),
                                            int(live.draft_tokens), int(live.accepted), [])
            return {**live.__dict__, "source": "live", "proposed": live.draft_tokens, "rounds": None}
        from specdistill.monitor import replay_acceptance

        sample = replay_acceptance(target["path"], champion["dir"], store, n_prompts=config.replay_prompts,
                                   gamma=config.gamma, max_new_tokens=config.max_new_tokens,
                                   target_version=target["fingerprint"], draft_version=champion["version"],
                                   min_draft_tokens=config.min_draft_tokens)
        return sample.to_dict()
    finally:
        store.close()


def measure_fallback(config: MonitorConfig, target: dict) -> dict:
    from specdistill.logstore import LogStore
    from specdistill.models import load_model
    from specdistill.monitor import choose_fallback, prompts_from_store

    loaded = load_model(target["path"])
    store = LogStore(config.nightly.log_db)
    try:
        prompts = prompts_from_store(store, loaded.tokenizer, config.replay_prompts)
    finally:
        store.close()
    decision = choose_fallback(loaded, prompts, exit_layers=config.fallback_exit_layers, gamma=config.gamma,
                               max_new_tokens=config.max_new_tokens, min_tokens=config.fallback_min_tokens,
                               repeats=config.fallback_repeats)
    return decision.to_dict()


def apply_fallback(config: MonitorConfig, fallback: dict, target: dict) -> dict | None:
    """Switch the serving config to the measured-fastest fallback (under the promotion lock)."""
    from specdistill import registry
    from specdistill.monitor import export_early_exit_draft
    from specdistill.serving import ServingConfig, write_serving_config

    if not fallback.get("decided"):
        return None  # no decision on too few tokens: serve as before
    mode, k = fallback["mode"], fallback.get("exit_layer")
    draft_dir = None
    if mode == "self_speculation":
        draft_dir = str(export_early_exit_draft(target["path"], k, fallback_dir(target["fingerprint"], k)))
    serving = ServingConfig(mode=mode, draft_dir=draft_dir, exit_layer=k, num_speculative_tokens=config.gamma,
                            target_fingerprint=target["fingerprint"], reason=f"monitor fallback: {fallback['reason']}")
    with registry.promotion_lock():
        path = write_serving_config(serving, config.nightly.serving_path)
    return {"mode": mode, "exit_layer": k, "serving_config": str(path)}
