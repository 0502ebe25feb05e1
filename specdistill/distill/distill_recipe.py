"""The distill recipe: its typed config, `DistillConfig`, that deploy/distill/*.yaml (`specdistill distill --config`)
and `key=value` overrides map onto; the nightly recipe's `train:` section extends it.

The resolved config is saved next to every checkpoint, so a checkpoint always says how it was made.
"""

from __future__ import annotations

import os
from typing import Annotated, ClassVar, Literal

import yaml
from pydantic import BeforeValidator, Field, field_validator, model_validator

from specdistill import bounds, paths
from specdistill.modeling.eagle3_files import DRAFT_MODEL, EAGLE3, kind_name
from specdistill.recipe import BatchSize, Gamma, Kept, Layer, Minutes, Prompts, Seed, Steps, Strict, Threads, TopK, count, load_model_config

# a layer-extracted draft, or an EAGLE-3 head over target features; a config written before reads `layers` as
# `draft_model` (`kind_name`)
DraftKind = Annotated[Literal["draft_model", "eagle3"], BeforeValidator(kind_name)]
FEATURE_KINDS = frozenset({EAGLE3})  # the kinds trained on the target's hidden states (a feature pass writes them)
Divergence = Literal["fkl", "rkl", "jsd", "tv"]  # the losses against a teacher distribution alone


def derived_schedule(max_steps: int) -> tuple[int, int]:
    """The warmup and the checkpoint (and eval) interval a run of `max_steps` gets when the config leaves
    them null (the nightly's `train:` section does): warmup up to 20 steps but at most a tenth of the run,
    and four checkpoints a run but at least 10 steps apart. The one place these are derived."""
    return min(20, max_steps // 10), max(10, max_steps // 4)


class DataConfig(Strict):
    path: str  # JSONL of target-generated records (prompt_ids + response_ids) or of {"messages": [...]}
    kind: Literal["generated", "conversations"] = "generated"
    max_len: count(bounds.MAX_SEQUENCE, low=8) = 512
    limit: Prompts | None = None  # use only the first N records (budgeted experiments)
    heldout_path: str | None = None  # target-generated JSONL for the acceptance estimate
    heldout_limit: count(bounds.MAX_PROMPTS, low=0) = 40
    replay_path: str | None = None  # older data mixed in during incremental distillation
    replay_kind: Literal["generated", "conversations"] = "generated"
    replay_share: float = Field(0.0, ge=0.0, lt=1.0)


class LossConfig(Strict):
    kind: Literal[Divergence, "ce", "mix"] = "fkl"
    temperature: float = Field(1.0, gt=0.0)
    beta: float = Field(0.5, gt=0.0, lt=1.0)  # JSD(β)
    alpha: float = Field(0.5, ge=0.0, le=1.0)  # mix: (1-a)·CE + a·T²·KL
    top_k: TopK | None = None  # online teacher cut to top-k + residual bucket
    hidden_weight: float = Field(0.0, ge=0.0)  # + w·(1 - cos(h_draft, h_target)), online teacher only
    selective_keep: float | None = Field(None, gt=0.0, le=1.0)  # AdaSPEC: keep this share of tokens
    selective_reference: str | None = None  # the reference draft for AdaSPEC


class TeacherConfig(Strict):
    mode: Literal["online", "cache", "none"] = "online"  # none: hard labels only (loss kind ce)
    cache_dir: str | None = None


class OptimConfig(Strict):
    lr: float = Field(1e-3, gt=0.0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: count(bounds.MAX_STEPS, low=0) | None = 20  # null: derived from max_steps (`derived_schedule`)
    max_steps: Steps = 1000
    batch_size: BatchSize = 4  # sequences per rank per micro-step
    grad_accum: BatchSize = 1
    clip: float | None = Field(1.0, gt=0.0)
    # null: bf16 exactly when the models run in bf16, which only a caller that knows their dtype decides (the
    # nightly, by its `dtype`: `pipeline.nightly_recipe.NightlyTrain.for_run`); a run itself needs true or false
    bf16: bool | None = False
    max_tokens: count(bounds.MAX_TOKENS, low=0) | None = None  # stop after this many trained (assistant) tokens
    max_minutes: Minutes | None = None  # stop after this much training time (eval excluded)
    clock: Literal["wall", "cpu"] = "wall"  # what max_minutes counts: wall time, or this process's CPU time


class Eagle3Config(Strict):
    """The EAGLE-3 head (kind: eagle3): its feature layers, the training-time-test unroll, the feature cache."""

    layers: list[Layer] | None = None  # target layers whose inputs are the features; None: (2, N/2, N-3)
    # unrolled draft steps per training position (EAGLE-3 uses 7). 1 by measurement on 2 CPU cores, where the
    # head is served at γ=1 (a tree of first-position candidates) and the gate reads first-position acceptance:
    # 600 steps on the demo's answers gave 0.374 against 0.341 with 2 steps in two-thirds of the minutes, on 64
    # unseen prompts (benchmarks/head_recipe.py); the price is the 2nd position (chained τ(4) 1.39 against 1.47).
    # Set 2 or more where the head is served at γ > 1
    steps: Gamma = 1
    # share of the entries at which the steps after the first train (the first trains at all): depth at a
    # fraction of its cost, since those steps then run at the drawn entries alone (`Eagle3Draft.unroll(deep=...)`)
    deep_share: float = Field(1.0, gt=0.0, le=1.0)
    decay: float = Field(0.8, gt=0.0, le=1.0)  # weight of step j: decay^j
    # weight of the pull of step 0's output at t toward the projected target features at t+1 (what the next step
    # reads toward what the first reads there: `modeling.eagle3.feature_alignment`); 0: off
    align_weight: float = Field(0.0, ge=0.0, le=100.0)
    eval_steps: Gamma = 4  # held-out acceptance at draft positions 1..eval_steps
    # prompt positions stored before each training answer (None: the whole prompt); 0 by measurement: as
    # good or better held-out acceptance per CPU-minute, 2.4x less disk (benchmarks/experiments/eagle_budget.py)
    prompt_context: count(bounds.MAX_SEQUENCE, low=0) | None = 0
    feature_dir: str | None = None  # default: <out_dir>/features
    # held-out features, always evaluated as served (whole prompt): default <feature_dir>-heldout (written
    # when prompt_context is not None), or this cache
    heldout_feature_dir: str | None = None
    feature_max_gb: float | None = Field(20.0, gt=0.0)  # refuse a feature cache larger than this, before the run
    # cache: the features on disk (written by the answer pass or one target pass); online: the target's feature
    # pass inside each training batch, no feature cache; auto: online when the cache would exceed feature_max_gb
    features: Literal["cache", "online", "auto"] = "cache"
    feature_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # the target's dtype in the feature pass
    teacher_top_k: TopK = 32  # k of a teacher cache written in the same pass


class DistillConfig(Strict):
    target: str = "demo"
    kind: DraftKind = DRAFT_MODEL
    draft: str | None = None  # warm start: an existing draft directory (incremental distillation)
    layers: str = "0,1,2,29"  # target layers for a new draft: '0,1,2,29', 'evenly:K', 'first:K'
    draft_vocab: TopK | str | None = 8192  # N (most frequent answer tokens), a draft dir, or None (full)
    freeze: list[str] | None = None  # substrings of parameter names kept frozen; None: the kind's default
    eagle3: Eagle3Config = Eagle3Config()
    data: DataConfig
    loss: LossConfig = LossConfig()
    teacher: TeacherConfig = TeacherConfig()
    optim: OptimConfig = OptimConfig()
    out_dir: str = "distill-out"
    checkpoint_every: Steps | None = 100  # null: derived from optim.max_steps (`derived_schedule`)
    eval_every: Steps | None = 50  # null: as checkpoint_every
    keep_checkpoints: Kept = 2
    seed: Seed = 0
    threads: Threads | None = None
    device: str = "auto"  # auto: each rank's GPU (LOCAL_RANK) when there is one; cpu, cuda or cuda:N
    progress: bool = True

    @field_validator("device")
    @classmethod
    def _device_exists(cls, device: str) -> str:
        from specdistill.modeling.models import check_device  # lazy: torch, only when validated

        return check_device(device)

    # a recipe without its run's inputs (the nightly's `train:` section) skips the checks of those inputs;
    # the config it makes for a run is checked whole
    is_recipe: ClassVar[bool] = False

    @model_validator(mode="after")
    def _consistent(self):
        if self.teacher.mode == "none" and self.loss.kind != "ce":
            raise ValueError(f"loss.kind={self.loss.kind!r} needs a teacher: set teacher.mode to online or cache")
        if self.loss.hidden_weight > 0 and self.teacher.mode != "online":
            raise ValueError("loss.hidden_weight needs teacher.mode=online (the cache holds no hidden states)")
        if self.loss.selective_keep is not None and not self.loss.selective_reference:
            raise ValueError("loss.selective_keep needs loss.selective_reference (a reference draft directory)")
        if self.on_features:
            if self.teacher.mode != "cache":
                raise ValueError("kind=eagle3 trains from caches: set teacher.mode=cache and teacher.cache_dir "
                                 "(written in the feature pass when it does not exist yet)")
            if self.loss.kind in ("ce", "mix") or self.loss.hidden_weight > 0 or self.loss.selective_keep is not None:
                raise ValueError("kind=eagle3 takes a divergence loss (loss.kind fkl, rkl, jsd or tv) and no "
                                 "hidden_weight or selective distillation")
        if not self.is_recipe:
            self._check_run_inputs()
        self._derive_schedule()
        return self

    def _check_run_inputs(self) -> None:
        if self.data is None:
            raise ValueError("data.path is required")
        if self.teacher.mode == "cache" and not self.teacher.cache_dir:
            raise ValueError("teacher.mode=cache needs teacher.cache_dir" + (
                " (written in the feature pass when it does not exist yet)" if self.on_features else ""))
        if self.on_features and self.data.replay_path:
            raise ValueError("kind=eagle3 has no replay data yet (data.replay_path)")
        if self.optim.bf16 is None:
            raise ValueError("optim.bf16 is null: set true or false (null is for a caller that resolves it by the "
                             "models' dtype, as the nightly does)")

    def _derive_schedule(self) -> None:
        """Null warmup and intervals become `derived_schedule`'s values, visible in the saved config. Written
        past assignment validation (the values are in range by construction; validating would recurse)."""
        warmup, interval = derived_schedule(self.optim.max_steps)
        if self.optim.warmup_steps is None:
            self.__dict__["optim"] = self.optim.model_copy(update={"warmup_steps": warmup})
        for name in ("checkpoint_every", "eval_every"):
            if getattr(self, name) is None:
                self.__dict__[name] = interval

    @property
    def on_features(self) -> bool:
        """Trained on the target's hidden states at some of its layers (an EAGLE-3 head), which a feature pass
        writes beside the teacher cache; a layer draft reads tokens only."""
        return self.kind in FEATURE_KINDS

    @property
    def frozen_patterns(self) -> list[str]:
        """The layer kind keeps the target's embeddings and head; an EAGLE-3 head trains its own lm_head."""
        if self.freeze is not None:
            return list(self.freeze)
        return ["embed_tokens"] if self.on_features else ["embed_tokens", "lm_head"]


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> DistillConfig:
    return load_model_config(DistillConfig, path, overrides)


def save_config(config: DistillConfig, path: str | os.PathLike) -> None:
    paths.atomic_write_text(path, yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), mode=paths.PUBLIC_FILE_MODE)
