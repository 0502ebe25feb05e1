"""The nightly pipeline's tasks: each wraps one call of `specdistill.pipeline.nightly`.

Retries go on I/O (the log store, the registry); compute stages are cached by content instead, so
a rerun resumes rather than recomputes.
"""

from __future__ import annotations

from prefect import task

from specdistill.pipeline import nightly as pipeline
from specdistill.pipeline.config import NightlyConfig
from tasks.common import content_key

CACHED = dict(cache_key_fn=content_key, persist_result=True)


@task(name="load-target")
def load_target(config: NightlyConfig) -> dict:
    return pipeline.describe_target(config.target)


@task(name="ingest-logs", retries=2, retry_delay_seconds=5)
def ingest_logs(source: pipeline.SourceConfig, config: NightlyConfig) -> dict:
    return pipeline.ingest_source(source, config.log_db)


@task(name="select-window", retries=2, retry_delay_seconds=5)
def select_window(config: NightlyConfig) -> dict:
    return pipeline.select_window(config).to_dict()


@task(name="current-champion", retries=2, retry_delay_seconds=5)
def current_champion(config: NightlyConfig) -> dict | None:
    return pipeline.champion_of(config)


@task(name="align-vocab")
def align_vocab(config: NightlyConfig, champion: dict | None) -> dict | None:
    return pipeline.align_champion(config, champion)


@task(name="generate-responses", **CACHED)
def generate_responses(config: NightlyConfig, window: dict, split: str, target_fingerprint: str,
                       record_teacher: bool) -> dict:
    return pipeline.generate_responses(config, window, split, record_teacher=record_teacher)


@task(name="distill", **CACHED)
def distill(config: NightlyConfig, train_data: dict, heldout_data: dict, warm_start: str | None,
            target_fingerprint: str) -> dict:
    return pipeline.distill_draft(config, train_data, heldout_data, warm_start)


@task(name="generic-baseline", **CACHED)
def generic_baseline(config: NightlyConfig, window: dict, heldout_data: dict, target_fingerprint: str) -> dict:
    return pipeline.distill_draft(config, {}, heldout_data, generic=True, window=window)


@task(name="benchmark", **CACHED)
def benchmark(config: NightlyConfig, window: dict, drafters: dict[str, str], target_fingerprint: str) -> dict:
    return pipeline.benchmark(config, window, drafters)


@task(name="gate")
def gate(config: NightlyConfig, challenger: dict, champion: dict | None, baselines: dict) -> dict:
    return pipeline.gate(config, challenger, champion, baselines)


@task(name="register", retries=2, retry_delay_seconds=5)
def register(config: NightlyConfig, target: dict, window: dict, trained: dict, results: dict, verdict: dict,
             parent: str | None, report_path: str | None) -> dict:
    return pipeline.register(config, target, window, trained, results, verdict, parent, report_path)


@task(name="promote-and-write-serving-config", retries=2, retry_delay_seconds=5)
def promote(config: NightlyConfig, registered: dict, target: dict, expected_champion: str | None) -> dict:
    return pipeline.promote(config, registered, target, expected_champion)
