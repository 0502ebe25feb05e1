"""What each stage hands to the next: the shapes of the dicts that cross a task boundary.

They are TypedDicts, so at runtime they stay plain JSON-friendly dicts (Prefect persists them and
`tasks.common.content_key` hashes them) while the stage signatures say what is inside. Several
mirror a library dataclass's `to_dict()`; tests/test_stage_outputs.py keeps the two in step.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import NotRequired, TypedDict

from specdistill.ops.monitor import FallbackCandidate

# --------------------------------------------------------------------------------------------
# nightly


class TargetInfo(TypedDict):
    ref: str
    path: str
    fingerprint: str
    num_layers: int
    vocab_size: int
    dtype: str  # what every stage runs the target in (float32 | bfloat16)
    hardware: NotRequired[str]  # the GPU or CPU (model and the flags that matter) the run measured on


class IngestSummary(TypedDict):
    """`data.ingest.IngestResult.to_dict()`."""

    source: str
    format: str
    run_id: int | None
    read: int
    stored: int
    duplicates: int
    quarantined: int
    start_offset: int
    end_offset: int
    truncation: dict | None
    note: str | None
    seconds: float
    conserved: bool


class Champion(TypedDict):
    name: str
    version: str
    dir: str  # the local draft directory
    tags: dict[str, str]


class WarmStart(Champion):
    """The champion as a warm start for this target (`dir` is the transplanted copy when `transplanted`)."""

    transplanted: bool
    vocab_report: dict


class WindowPrompt(TypedDict):
    id: str  # the conversation's id in the log store
    messages: list[dict]  # the prompt turns, ending with a user turn
    slice: str


class WindowDict(TypedDict):
    train: list[WindowPrompt]
    eval: list[WindowPrompt]
    key: str  # content hash: the cache key of everything computed from this window
    since: str | None
    replayed: int


class GeneratedData(TypedDict):
    path: str  # JSONL of target-generated records
    teacher_cache: str | None
    answers: int
    tokens: int


class PoolSummary(TypedDict):
    fingerprint: str  # the target version the pool belongs to
    nights: dict[str, dict]  # night (window key) -> {"answers", "tokens"} trained on, newest first
    duplicates: int  # prompts answered on several nights, trained once (the newest answer)
    held_out: int  # pooled answers left out because their prompt has been evaluated on
    over_budget: int  # older answers left out by pool.max_tokens
    skipped: list[str]  # shards or nights not trained on, and why
    evicted: list[dict]  # nights whose data the disk cap deleted tonight (key, bytes)
    retired: list[dict]  # other target versions' pools dropped by pool.keep_versions
    reanswered: int  # the old version's prompts the new target answered into this pool tonight
    disk_bytes: int


class PooledData(GeneratedData, total=False):
    pool: PoolSummary  # absent when pool.enabled is false: the night's own answers


class _TrainedOptional(TypedDict, total=False):
    rank_weight_digests: list[str]  # multi-rank runs only
    kind: str  # "layers" or "eagle3"
    clock: str  # what train_minutes counts: "wall" or "cpu"
    unroll_steps: int  # eagle3 only
    feature_disk_bytes: int  # eagle3 only
    feature_bytes_per_answer_token: float  # eagle3 only


class Trained(_TrainedOptional):
    """`distill.train.distill()`'s result (also its result.json)."""

    steps: int
    tokens: int
    train_minutes: float
    loss: float | None
    stop: str
    trainable_parameters: int
    frozen_parameters: int
    curve: list[dict]
    draft_vocab: int | None
    layers: list[int]
    draft_dir: str


def mirror(cls: type, name: str, **extra: type) -> type:
    """A TypedDict with exactly the fields of dataclass `cls` (plus `extra`): the keys have one home,
    the dataclass, and a stage output can never drift from what `to_dict()` produces."""
    hints = typing.get_type_hints(cls)
    return TypedDict(name, {f.name: hints[f.name] for f in dataclasses.fields(cls)} | extra)


class Promoted(TypedDict):
    version: str
    serving_config: str  # the serving config file that now points at the new champion


# --------------------------------------------------------------------------------------------
# monitor


class TargetVersionDict(TypedDict):
    """`ops.targets.TargetVersion.to_dict()`."""

    fingerprint: str
    path: str
    ref: str
    registered_at: str


class TargetChange(TypedDict):
    changed: bool  # the served target's fingerprint differs from the last run's
    drifted: bool  # changed, or the champion was distilled for another target
    champion_target: str | None
    current: TargetVersionDict
    previous: TargetVersionDict | None


class ReplaySample(TypedDict):
    """`ops.monitor.AcceptanceSample.to_dict()`."""

    ok: bool
    reason: str
    source: str
    target_fingerprint: str
    draft_version: str
    gamma: int
    requests: int
    rounds: int
    proposed: int
    accepted: int
    generated_tokens: int
    accepted_per_position: list[int]
    acceptance_rate: float | None
    first_position_acceptance: float | None
    mean_accepted_length: float | None
    per_position_acceptance: list[float]
    vocab_mismatch: bool
    vocab_transplanted: bool
    conversation_ids: list[int]
    sample_ids: list[int]
    seconds: float


class LiveSampleDict(TypedDict):
    """`ops.metrics.LiveSample`'s fields plus the keys a replay sample is read by."""

    ok: bool
    reason: str
    acceptance_rate: float | None
    first_position_acceptance: float | None
    mean_accepted_length: float | None
    draft_tokens: float
    accepted: float
    drafts: float
    per_position_acceptance: list[float]  # vLLM's per-position counters, Δ between the scrapes
    source: str  # "live"
    proposed: float
    rounds: None


Sample = ReplaySample | LiveSampleDict


FallbackCandidateDict = mirror(FallbackCandidate, "FallbackCandidateDict")  # `ops.monitor.FallbackCandidate`


class FallbackChoice(TypedDict):
    """`ops.monitor.FallbackDecision.to_dict()`."""

    decided: bool
    mode: str | None
    exit_layer: int | None
    speedup: float | None
    reason: str
    candidates: list[FallbackCandidateDict]
    margin: float
    generated_tokens: int
    suffix_corpus: str | None


class AppliedFallback(TypedDict):
    mode: str
    exit_layer: int | None
    serving_config: str


class RecordedDecision(TypedDict):
    log_store_row: int  # the decisions table's row
    pushed: bool  # the gauges went to a Pushgateway


class _OutcomeOptional(TypedDict, total=False):
    champion: Champion
    sample: Sample
    fallback: FallbackChoice
    serving: AppliedFallback | None
    incremental: dict  # the nightly run's warm_start, verdict, registered, promoted, serving
    decision_reason: str  # the numbers the decision was taken on (`ops.policy.judge_acceptance`)
    report: str


class MonitorOutcome(_OutcomeOptional):
    """What one monitor run saw and did: the record `record_decision` stores and the report renders."""

    change: TargetChange
    decision: str  # keep | fallback | retrain | no-sample | no-champion
