"""What each stage hands to the next that has no home in a lower layer, each a dataclass
(`data.record.Record`); the other stage outputs are the library's own dataclasses, defined once where they
are computed. All become JSON (benchmark.json, gate.json, the decision record, `--json`) through
`data.record.to_dict`, which is also what `tasks.common.content_key` hashes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdistill.data.prompts import Prompt
from specdistill.data.record import Record
from specdistill.data.results import BenchResult
from specdistill.distill.trained import Trained  # noqa: F401  (the training run, as stages hand it on)
from specdistill.ops.metrics import LiveSample
from specdistill.ops.policy import CONFIDENCE, Decision, GateVerdict
from specdistill.ops.replay import AcceptanceSample, FallbackDecision
from specdistill.ops.targets import TargetChange
from specdistill.speculative.specs import DrafterSpec

if TYPE_CHECKING:  # for annotations only: the registry imports MLflow
    from specdistill.ops.registry import RegisteredDraft


@dataclass
class ServingDecision(Record):
    """The mode written for serving and every number behind it (`serving_config` turns it into serving.json)."""

    mode: str  # draft | self-spec | ngram | suffix | off
    reason: str
    measured: dict[str, float]  # every candidate's measured speedup
    measured_on: str  # engine and dtype
    gamma: int
    name: str | None = None  # the measured entry that won (None: off)
    spec: DrafterSpec | None = None  # its JSON is the spec's text
    speedup: float = 1.0  # measured, at `gamma`
    predicted_speedups: dict[int, float] = field(default_factory=dict)  # the winner's predicted curve over γ
    verify_costs: dict[int, float] = field(default_factory=dict)  # target forward over k tokens ÷ a 1-token step
    gamma_note: str = ""
    engine: str = "harness"  # harness | llamacpp | vllm | openai: where the speeds were measured
    llamacpp_args: list[str] = field(default_factory=list)  # llama-server flags of the chosen mode, as measured
    tree_width: int = 1  # first-position candidates the chosen head was measured with (1: a chain)
    chain_gamma: int | None = None  # a head served as a tree: the chain depth its measured chain predicts best
    speedup_lower_bound: float | None = None  # the served mode's lower confidence bound (None: off, or no per-prompt speeds)
    confidence: float = CONFIDENCE  # its one-sided level


# --------------------------------------------------------------------------------------------
# nightly


@dataclass
class TargetInfo(Record):
    """The run's target, loaded once at the start (`stages.target.describe_target`)."""

    ref: str
    path: str
    fingerprint: str
    num_layers: int
    vocab_size: int
    dtype: str  # what every stage runs the target in (float32 | bfloat16)
    hardware: str = ""  # the GPU or CPU (model and the flags that matter) the run measured on


# a registered version's tag (`stages.register`), read where training starts (`stages.champion`): "true" when it was
# benched beside the champion (its `parent`) and measured no worse on the same prompts
NO_WORSE_TAG = "no_worse_than_champion"


@dataclass
class Champion(Record):
    """The registry's current best draft (its `champion` alias)."""

    name: str
    version: str
    dir: str  # the local draft directory
    tags: dict[str, str] = field(default_factory=dict)  # the version's tags: target_fingerprint, first-position acceptance


@dataclass
class WarmStart(Champion):
    """The champion as a warm start for this target (`dir` is the transplanted copy when `transplanted`)."""

    transplanted: bool = False
    vocab_report: dict = field(default_factory=dict)
    unfit: str = ""  # why the champion's shapes do not fit this target (then training starts from the target)

    @property
    def usable(self) -> bool:
        return not self.unfit

    def lineage_tags(self) -> dict[str, str]:
        """Which draft tonight's training started from, and for which target version it was trained (MLflow tags)."""
        return {"warm_start_version": self.version, "warm_start_target_fingerprint": self.tags.get("target_fingerprint", ""),
                **({"warm_start_unfit": self.unfit[:500]} if self.unfit else {})}


@dataclass
class Window(Record):
    """The night's prompts: train prompts (recent traffic plus a replay share) and held-out eval prompts,
    each a logged conversation's prompt turns (`data.prompts.Prompt`: id, messages, slice)."""

    train: list[Prompt]
    eval: list[Prompt]
    key: str  # content hash: the cache key of everything computed from this window
    since: str | None
    replayed: int

    def split(self, name: str) -> list[Prompt]:
        if name not in ("train", "eval"):
            raise ValueError(f"a window's split is train or eval, not {name!r}")
        return self.train if name == "train" else self.eval


def window_key(train: list[Prompt], evals: list[Prompt], target: str) -> str:
    """The window's content hash, over what identifies its prompts (id, turns, slice)."""
    payload = [[{"id": p.id, "messages": p.messages, "slice": p.slice} for p in split]
               for split in (train, evals)] + [target]
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class LoggedData(Record):
    """What the logged responses gave tonight (`pipeline.stages.answers.logged`; the report's data line)."""

    own: int = 0  # logged answers of the current target, used as they are
    own_tokens: int = 0
    other: int = 0  # other models' responses labelled by the target
    other_tokens: int = 0
    refused: int = 0  # claimed by the current target, not text it writes (`logged.own_text_check`): answered again
    refused_why: dict[str, int] = field(default_factory=dict)  # reason -> count
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    not_labelled: int = 0  # left for lack of time
    minutes: float = 0.0


@dataclass
class GeneratedData(Record):
    """The target's answers to a split of the window (`pipeline.stages.answers.stage.generate_responses`), or the pool's view."""

    path: str  # JSONL of target-generated records
    teacher_cache: str | None
    answers: int
    tokens: int
    answered_by: str = ""  # the harness's dtype, or the engine and its weights (`llamacpp:Q4_1`)
    engine_choice: str | None = None  # generation.backend auto: the measurement that chose it (a report line)
    logged: LoggedData | None = None  # train answers: what the logged responses gave (labelled by prefill)


@dataclass
class PoolSummary(Record):
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


@dataclass
class PooledData(GeneratedData):
    pool: PoolSummary | None = None  # None when pool.enabled is false: the night's own answers


@dataclass
class Untrained(Record):
    """A training that did not run: the run's deadline left it too little (the draft: the night fails, in this one
    sentence, with the champion and serving.json as they were; the generic baseline: skipped, the report says why)."""

    reason: str


@dataclass
class Promoted(Record):
    version: str
    serving_config: str  # the serving config file that now points at the new champion


@dataclass
class NightlyRun(Record):
    """What one nightly run measured and decided: the flow's result (`pipeline run --json` prints its to_dict)."""

    target: TargetInfo
    window: str  # the window's key
    pool: PoolSummary | None  # None: pool.enabled false
    warm_start: WarmStart | None
    results: dict[str, BenchResult]
    verdict: GateVerdict
    registered: RegisteredDraft
    promoted: Promoted | None  # None: the champion stays
    serving: ServingDecision
    report: str


# --------------------------------------------------------------------------------------------
# monitor


Sample = AcceptanceSample | LiveSample  # the champion's acceptance: replayed here, or a live engine's counters


@dataclass
class AppliedFallback(Record):
    mode: str
    exit_layer: int | None
    serving_config: str


@dataclass
class RecordedDecision(Record):
    log_store_row: int  # the decisions table's row
    pushed: bool  # the gauges went to a Pushgateway


@dataclass
class MonitorOutcome(Record):
    """What one monitor run saw and did: the record `record_decision` stores and the report renders."""

    change: TargetChange
    decision: Decision
    champion: Champion | None = None
    sample: Sample | None = None
    decision_reason: str = ""  # the numbers the decision was taken on (`ops.policy.judge_acceptance`)
    fallback: FallbackDecision | None = None
    serving: AppliedFallback | None = None
    incremental: NightlyRun | None = None  # the incremental nightly run the monitor started
    report: str = ""
    stage_seconds: dict[str, float] = field(default_factory=dict)  # wall time per stage, in the order they ran
    deadline_minutes: float | None = None  # the decision's (`MonitorConfig.deadline_minutes`)
    measured_on: str = ""  # the device the stages ran on, in words

    def to_json(self) -> str:  # the log store's decisions table's payload
        return json.dumps(self.to_dict(), default=str, sort_keys=True)
