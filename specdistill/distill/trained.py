"""What a training run reports: a draft kind's held-out acceptance (`HeldoutAcceptance`, a point of the
run's curve) and the run's result (`Trained`: what `train.distill` returns and writes to result.json,
and what the nightly reads back).

Each writes the JSON the trainer always wrote (metrics.jsonl, result.json, the draft's meta), keys in
that order and absent ones left out."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdistill.data.record import Record
from specdistill.distill.distill_recipe import FEATURE_KINDS
from specdistill.modeling.eagle3_files import DRAFT_MODEL, kind_name


@dataclass(frozen=True)
class HeldoutAcceptance:
    """Greedy top-1 agreement with the target's own continuation on the held-out examples, and τ(γ) it
    implies under the i.i.d. model; an EAGLE-3 head adds its per-position numbers and its chained τ."""

    acceptance: float
    tau: float
    eval_tokens: int
    acceptance_per_position: list[float] | None = None  # eagle3: top-1 agreement at each unrolled position
    accepted_per_position: list[float] | None = None  # eagle3: share accepted through position i (the chain)
    chain_gamma: int | None = None  # eagle3: the γ of `tau_chain`, written as its key `tau_chain_<γ>`
    tau_chain: float | None = None  # eagle3: 1 + Σ accepted_per_position[:γ]

    def to_dict(self) -> dict:
        out: dict = {"acceptance": self.acceptance, "tau": self.tau}
        if self.acceptance_per_position is not None:
            out |= {"acceptance_per_position": self.acceptance_per_position,
                    "accepted_per_position": self.accepted_per_position, f"tau_chain_{self.chain_gamma}": self.tau_chain}
        out["eval_tokens"] = self.eval_tokens
        return out


@dataclass(frozen=True)
class Trained(Record):
    """A distillation run: `train.distill()`'s result, written to result.json (`result_json`) and taken
    in by the nightly (`pipeline.stages.distill.distill_draft`, from the run or from the file of a run that
    finished before)."""

    steps: int
    tokens: int
    train_minutes: float
    loss: float | None
    stop: str
    trainable_parameters: int
    frozen_parameters: int
    curve: list[dict]  # metrics.jsonl's points: step, tokens, minutes and the held-out acceptance
    draft_dir: str | None = None  # None: a rank other than 0, which writes no draft
    draft_vocab: int | None = None
    layers: list[int] = field(default_factory=list)
    kind: str = DRAFT_MODEL  # or "eagle3"; a result.json written before says `layers` (read as draft_model)
    clock: str = "wall"  # what train_minutes counts: "wall" or "cpu"
    rank_weight_digests: list[str] | None = None  # multi-rank runs only
    unroll_steps: int | None = None  # eagle3 only
    feature_disk_bytes: int | None = None  # eagle3 only
    feature_bytes_per_answer_token: float | None = None  # eagle3 only
    stale_dropped: int = 0  # answers not trained on: their cached teacher rows were written for other token ids
    features: str | None = None  # eagle3 only: cache | online
    features_reason: str | None = None  # eagle3 only: why (auto: the disk budget)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", kind_name(self.kind))  # one name inside, whatever name the file gave

    def result_json(self, *, curve: bool = True) -> dict:
        """result.json (and, without the curve, the draft's meta): the run's numbers, the task's keys, then
        the ranks' digests and the draft's directory where there are any."""
        out = {"steps": self.steps, "tokens": self.tokens, "train_minutes": self.train_minutes, "clock": self.clock,
               "loss": self.loss, "stop": self.stop, "trainable_parameters": self.trainable_parameters,
               "frozen_parameters": self.frozen_parameters, **({"curve": self.curve} if curve else {}),
               "kind": self.kind, "draft_vocab": self.draft_vocab, "layers": self.layers}
        if self.kind not in FEATURE_KINDS:
            out["stale_dropped"] = self.stale_dropped
        else:
            out |= {"unroll_steps": self.unroll_steps, "stale_dropped": self.stale_dropped,
                    "feature_disk_bytes": self.feature_disk_bytes,
                    "feature_bytes_per_answer_token": self.feature_bytes_per_answer_token,
                    "features": self.features, "features_reason": self.features_reason}
        if self.rank_weight_digests is not None:
            out["rank_weight_digests"] = self.rank_weight_digests
        if self.draft_dir is not None:
            out["draft_dir"] = self.draft_dir
        return out
