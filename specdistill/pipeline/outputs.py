"""What each stage hands to the next: the shapes of the dicts that cross a task boundary.

They are TypedDicts, so at runtime they stay plain JSON-friendly dicts (Prefect persists them and
`tasks.common.content_key` hashes them) while the stage signatures say what is inside. Several
mirror a library dataclass's `to_dict()`; tests/test_stage_outputs.py keeps the two in step.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict

from specdistill.ops.metrics import LiveSample
from specdistill.ops.monitor import AcceptanceSample, FallbackDecision
from specdistill.ops.targets import TargetChange

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


class Promoted(TypedDict):
    version: str
    serving_config: str  # the serving config file that now points at the new champion


# --------------------------------------------------------------------------------------------
# monitor


Sample = AcceptanceSample | LiveSample  # the champion's acceptance: replayed here, or a live engine's counters


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
    fallback: FallbackDecision
    serving: AppliedFallback | None
    incremental: dict  # the nightly run's warm_start, verdict, registered, promoted, serving
    decision_reason: str  # the numbers the decision was taken on (`ops.policy.judge_acceptance`)
    report: str


class MonitorOutcome(_OutcomeOptional):
    """What one monitor run saw and did: the record `record_decision` stores and the report renders."""

    change: TargetChange
    decision: str  # keep | fallback | retrain | no-sample | no-champion
