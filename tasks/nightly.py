"""The nightly pipeline's tasks: each wraps one call of a stage (`specdistill.pipeline.stages`), or of the tail
reserve, the success marker or retention (`specdistill.pipeline`).

Retries go on I/O (the log store, the registry). What a rerun reuses is decided by one layer per stage:
the library's content-addressed directories for every stage that writes one (answers, pool, suffix
corpus, distillation, the generic baseline: a rerun finds them and recomputes nothing that finished),
Prefect's result cache, keyed by content, only for the two benchmarks, which keep nothing on disk of
their own. Inputs and outputs are the library's own dataclasses: the records of
`specdistill.pipeline.outputs`, and those defined where they are computed (`BenchResult`, `GateVerdict`,
`RegisteredDraft`, `IngestResult`, `Trained`, `TailReserve`). Prefect persists them as it pickles any result;
`tasks.common.content_key` hashes them by their `to_dict()`. Types from below the pipeline are imported
for annotations only: the tasks call the library through `specdistill.pipeline`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from prefect import task

from specdistill.pipeline import retention, success, tail
from specdistill.pipeline.nightly_recipe import NightlyConfig, SourceConfig
from specdistill.pipeline.outputs import (
    Champion,
    GeneratedData,
    PooledData,
    Promoted,
    ServingDecision,
    TargetInfo,
    Untrained,
    WarmStart,
    Window,
)
from specdistill.pipeline.stages import align as align_stage
from specdistill.pipeline.stages import bench, choose_mode, corpus, engine_bench, pool
from specdistill.pipeline.stages import champion as champion_stage
from specdistill.pipeline.stages import distill as distill_stage
from specdistill.pipeline.stages import ingest as ingest_stage
from specdistill.pipeline.stages import promote as promote_stage
from specdistill.pipeline.stages import register as register_stage
from specdistill.pipeline.stages import target as target_stage
from specdistill.pipeline.stages import window as window_stage
from specdistill.pipeline.stages import write_serving as write_serving_stage
from specdistill.pipeline.stages.answers import stage as answer_stage
from specdistill.pipeline.tail import TailReserve
from tasks.common import content_key

if TYPE_CHECKING:  # annotations only, each from the module that defines it
    from specdistill.data.ingest import IngestResult
    from specdistill.data.results import BenchResult
    from specdistill.distill.trained import Trained
    from specdistill.ops.policy.gate import GateVerdict
    from specdistill.ops.registry import RegisteredDraft
    from specdistill.speculative.specs import DrafterSpec

CACHED = dict(cache_key_fn=content_key, persist_result=True)  # for stages with no directory of their own


@task(name="load-target")
def load_target(config: NightlyConfig) -> TargetInfo:
    return target_stage.describe_target(config.target, config.dtype, config.device)


@task(name="ingest-logs", retries=2, retry_delay_seconds=5)
def ingest_logs(source: SourceConfig, config: NightlyConfig) -> IngestResult:
    return ingest_stage.ingest_source(source, config.log_db)


@task(name="select-window", retries=2, retry_delay_seconds=5)
def select_window(config: NightlyConfig) -> Window:
    return window_stage.select_window(config)


@task(name="current-champion", retries=2, retry_delay_seconds=5)
def current_champion(config: NightlyConfig) -> Champion | None:
    return champion_stage.champion_of(config)


@task(name="training-start", retries=2, retry_delay_seconds=5)
def training_start(config: NightlyConfig, target_fingerprint: str, champion: Champion | None) -> Champion | None:
    return champion_stage.training_start(config, target_fingerprint, champion)


@task(name="align-vocab")
def align_vocab(config: NightlyConfig, champion: Champion | None) -> WarmStart | None:
    return align_stage.align_champion(config, champion)


# not result-cached: the stage resumes itself from its answers file and verified cache shards, so a
# shard quarantined as corrupt is answered again on the next run instead of hidden by a cached result
@task(name="generate-responses", retries=1, retry_delay_seconds=5)
def generate_responses(config: NightlyConfig, window: Window, split: str, target_fingerprint: str,
                       record_teacher: bool, deadline_at: float | None = None) -> GeneratedData:
    return answer_stage.generate_responses(config, window, split, record_teacher=record_teacher, deadline_at=deadline_at)


@task(name="reserve-tail")
def reserve_tail(config: NightlyConfig, window: Window, champion: bool) -> TailReserve:
    return tail.reserve_tail(config, window, champion=champion)


@task(name="suffix-corpus")
def suffix_corpus(config: NightlyConfig, train_data: GeneratedData, target_fingerprint: str) -> str:
    return corpus.nightly_corpus(config, train_data, target_fingerprint)


@task(name="pool-answers", retries=2, retry_delay_seconds=5)
def pool_answers(config: NightlyConfig, window: Window, train_data: GeneratedData, heldout_data: GeneratedData,
                 target_fingerprint: str) -> PooledData:
    return pool.pool_answers(config, window, train_data, heldout_data, target_fingerprint,
                            answer=answer_stage.generate_responses)


@task(name="distill")
def distill(config: NightlyConfig, train_data: GeneratedData, heldout_data: GeneratedData, warm_start: str | None,
            target_fingerprint: str, deadline_at: float | None = None) -> Trained | Untrained:
    return distill_stage.distill_draft(config, train_data, heldout_data, warm_start, deadline_at=deadline_at)


@task(name="generic-baseline")
def generic_baseline(config: NightlyConfig, window: Window, heldout_data: GeneratedData, target_fingerprint: str,
                     deadline_at: float | None = None) -> Trained | Untrained:
    return distill_stage.distill_draft(config, None, heldout_data, generic=True, window=window, deadline_at=deadline_at)


@task(name="benchmark", **CACHED)
def benchmark(config: NightlyConfig, window: Window, drafters: dict[str, DrafterSpec], target_fingerprint: str,
              deadline_at: float | None = None) -> dict[str, BenchResult]:
    return bench.benchmark(config, window, drafters, deadline_at)


@task(name="engine-benchmark", **CACHED)
def engine_benchmark(config: NightlyConfig, window: Window, drafters: dict[str, DrafterSpec],
                     target_fingerprint: str, deadline_at: float | None = None) -> dict[str, BenchResult]:
    return engine_bench.engine_benchmark(config, window, drafters, deadline_at)


@task(name="gate")
def gate(config: NightlyConfig, challenger: BenchResult, champion: BenchResult | None, baselines: dict[str, BenchResult],
         speeds: dict[str, BenchResult] | None = None) -> GateVerdict:
    return bench.gate(config, challenger, champion, baselines, speeds)


@task(name="register", retries=2, retry_delay_seconds=5)
def register(config: NightlyConfig, target: TargetInfo, window: Window, trained: Trained, results: dict[str, BenchResult],
             verdict: GateVerdict, parent: str | None, report_path: str | None,
             speeds: dict[str, BenchResult] | None = None, warm_start: WarmStart | None = None) -> RegisteredDraft:
    return register_stage.register(config, target, window, trained, results, verdict, parent, report_path, speeds, warm_start)


@task(name="choose-serving-mode")
def choose_serving(config: NightlyConfig, window: Window, results: dict[str, BenchResult],
                   verdict: GateVerdict, speeds: dict[str, BenchResult] | None = None) -> ServingDecision:
    return choose_mode.choose_serving(config, window, results, verdict, speeds)


@task(name="promote-and-write-serving-config", retries=2, retry_delay_seconds=5)
def promote(config: NightlyConfig, registered: RegisteredDraft, target: TargetInfo, expected_champion: str | None,
            serving: ServingDecision) -> Promoted:
    return promote_stage.promote(config, registered, target, expected_champion, serving)


@task(name="write-serving-config", retries=2, retry_delay_seconds=5)
def write_serving(config: NightlyConfig, target: TargetInfo, serving: ServingDecision, champion: Champion | None) -> str:
    return write_serving_stage.write_serving(config, target, serving, champion)


@task(name="mark-pipeline-success", retries=2, retry_delay_seconds=5)
def mark_success(config: NightlyConfig, flow: str, target_fingerprint: str) -> float:
    return success.mark_pipeline_success(config.log_db, flow, target_fingerprint)


@task(name="prune-old-traffic", retries=2, retry_delay_seconds=5)
def prune(config: NightlyConfig) -> str:
    """After a success: `retention_days` of traffic kept, the rest and what was derived from it pruned."""
    report = retention.prune(timedelta(days=config.retention_days), log_db=config.log_db)
    return report.render()
