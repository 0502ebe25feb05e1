"""The nightly recipe: its typed config, `NightlyConfig`, that deploy/nightly/*.yaml and dotted `key=value` overrides
map onto (`specdistill.recipe.load_model_config`; two sections live in `generation_section`), and where a
nightly run's outputs live, keyed by the content of what produced them (`config_hash`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import fields as dataclass_fields
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_type_hints

from pydantic import Field, create_model, field_validator, model_validator

from specdistill import bounds, paths
from specdistill.data.prompts import MAX_PROMPT_TOKENS
from specdistill.data.results import BenchSettings
from specdistill.distill.distill_recipe import DataConfig, DistillConfig, DraftKind, Eagle3Config, LossConfig, OptimConfig, TeacherConfig
from specdistill.env import masked_logs, stash_secrets
from specdistill.modeling.eagle3_files import DRAFT_MODEL
from specdistill.ops.policy import (
    CONFIDENCE,
    DEFAULT_MARGIN,
    MIN_SERVED_PROMPTS,
    GateConfig,
    Role,
    gate_config,
)
from specdistill.pipeline.generation_section import GenerationConfig, RemeasureConfig
from specdistill.recipe import (
    Days,
    Gamma,
    Kept,
    LayerCount,
    Minutes,
    Prompts,
    Seed,
    Steps,
    Strict,
    Threads,
    Tokens,
    TreeWidth,
    count,
    load_model_config,
)

if TYPE_CHECKING:
    from specdistill.engines.endpoint_bench import EngineBenchConfig
    from specdistill.speculative.harness_bench import BenchConfig


class SourceConfig(Strict):
    path: str  # a file, or "sharegpt" / "humaneval" for the shipped demo traffic
    format: Literal["sharegpt", "openai", "jsonl", "humaneval"]
    slice: str = "chat"  # benchmark slice its prompts report under
    # a .gz's cap (None: 100x its size); the rest is quarantined
    max_decompressed_bytes: int | None = Field(None, ge=1, le=bounds.MAX_BYTES)


class WindowConfig(Strict):
    days: Days | None = None  # traffic that arrived in the last N days (None: all of it)
    since: datetime | None = None  # or since this moment (the monitor: since the target update)
    # the head is data-limited (+0.075 position-1 acceptance per doubling of unique answer tokens). The window's
    # logged responses are labelled at prefill speed and its prompts decoded until the answers' time budget is
    # spent, so more prompts than the budget decodes leave a sample of them decoded and all of them labelled
    train_prompts: Prompts = 2048
    eval_prompts: Prompts = 10
    replay_share: float = Field(0.25, ge=0.0, lt=1.0)  # of train prompts drawn from before the window
    max_prompt_tokens: count(bounds.MAX_SEQUENCE, low=16) = MAX_PROMPT_TOKENS  # the monitor replays within the same bound
    seed: Seed = 0


# the flat keys of the `train:` section before it became the distillation config itself
_MOVED_TRAIN_KEYS = {"lr": "optim.lr", "batch_size": "optim.batch_size", "max_steps": "optim.max_steps",
                     "max_minutes": "optim.max_minutes", "bf16": "optim.bf16", "eagle3_steps": "eagle3.steps"}
# what each run sets on its training config (`NightlyTrain.for_run`), and from where
_SET_PER_RUN = {"target": "`target`", "draft": "the champion (warm start)", "data": "the night's answers",
                "teacher": "the night's teacher cache", "out_dir": "the run's content-addressed directory",
                "device": "`device`", "threads": "`bench.threads`"}
_EAGLE3_SET_PER_RUN = {"feature_dir": "the night's teacher cache", "feature_dtype": "`dtype`"}


class NightlyOptim(OptimConfig):
    """`train.optim` with the nightly's defaults. The time budget binds, not the steps: the demo's head was still
    rising at the end of 3 minutes on 1,216 answers (0.381, 0.426, 0.435 held-out first-position acceptance at
    steps 500, 750, 840), so it gets 4.5 of the run's 18. bf16 null: autocast when the run's dtype is bf16 and the CPU
    measures it faster (`train_autocast`): once 1.43x the steps per minute on a native-bf16 CPU, 0.71x on a Xeon
    with AVX-512 BF16 and no AMX. Warmup null: derived."""

    warmup_steps: count(bounds.MAX_STEPS, low=0) | None = None
    # the minutes bind on a 2-core CPU: after the faster step the demo's head ran its 1000 steps in 2.0 of its
    # 4.5 minutes and was still rising (0.443, 0.463 held-out first-position acceptance at steps 750, 1000); with AMX
    # the 2-step head ran 2,232 steps in its 4.5 minutes, and one step costs about two-thirds of that
    max_steps: Steps = 4000
    max_minutes: Minutes | None = 4.5
    bf16: bool | None = None


class NightlyTrain(DistillConfig):
    """The YAML `train:` section: the distillation config itself (`distill.distill_recipe.DistillConfig`, the keys of
    `specdistill distill --config`) as a recipe without its run's inputs, with the nightly's defaults and one
    key of its own (`incremental_lr`); each run's inputs are set by `for_run`, nowhere else."""

    is_recipe: ClassVar[bool] = True

    kind: DraftKind = "eagle3"  # the better kind per CPU-minute (benchmarks/experiments/eagle_budget.py)
    data: DataConfig | None = None  # the night's answers (`for_run`)
    teacher: TeacherConfig = TeacherConfig(mode="cache")  # the night's teacher cache (`for_run`)
    optim: NightlyOptim = NightlyOptim()
    checkpoint_every: Steps | None = None  # null: `distill.distill_recipe.derived_schedule`
    eval_every: Steps | None = None  # null: as checkpoint_every
    incremental_lr: float = Field(3e-4, gt=0.0)  # optim.lr of a warm start from the champion
    # a warm start's head (its first position trained by the nights before) spends its minutes on depth: one
    # unroll step more than the head was trained with, up to `incremental_steps` (a curriculum over nights), and
    # the share of entries the later steps train at (None: `eagle3.steps`, `eagle3.deep_share`). One step at a
    # time by measurement (benchmarks/head_depth.py, warm from a 1-step head, equal compute): 2 steps lifted
    # position 2 given 1 from 0.04 to 0.39 and held the first at 0.477 (against 0.496), chained τ(3) 1.68
    # against 1.51; jumping to 3 steps at share 0.5 trained position 3 (0.31) but held the first at 0.46
    incremental_steps: int | None = Field(3, ge=1, le=16)
    incremental_deep_share: float | None = Field(None, gt=0.0, le=1.0)

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in _MOVED_TRAIN_KEYS.items():
                if old in data:
                    raise ValueError(f"`train.{old}` is now `train.{new}`")
            if isinstance(data.get("loss"), str):
                raise ValueError("`train.loss` is now `train.loss.kind`")
        return data

    @model_validator(mode="after")
    def _run_inputs_unset(self):
        for prefix, section, keys in (("", self, _SET_PER_RUN), ("eagle3.", self.eagle3, _EAGLE3_SET_PER_RUN)):
            for key, source in keys.items():
                if key in section.model_fields_set:
                    raise ValueError(f"train.{prefix}{key} is set by each run from {source}: leave it out")
        return self

    def for_run(self, config: NightlyConfig, *, data: DataConfig, out_dir: str | Path, teacher: TeacherConfig,
                warm_start: str | None = None, max_minutes: float | None = None, generic: bool = False,
                feature_dir: str | None = None, deepen: bool = True, warm_depth: int | None = None) -> DistillConfig:
        """The distillation config of one run: this recipe with the run's inputs (its data, teacher cache and
        output directory, the warm start, the minutes the deadline leaves, the run's target, device, dtype and
        threads) and what they imply: a warm start keeps its draft's vocabulary and trains at
        `incremental_lr` and (a head of this target version, `deepen`) one unroll step deeper than `warm_depth`,
        the steps it was trained with; the generic baseline is a layer draft on plain CE. Validated whole."""
        update: dict[str, Any] = {
            "target": config.target, "draft": warm_start, "data": data.model_dump(), "teacher": teacher.model_dump(),
            "out_dir": str(out_dir), "device": config.device,
            "threads": config.bench.threads if isinstance(config.bench.threads, int) else None,
            "optim": {**self.optim.model_dump(), "bf16": train_autocast(config)},
        }
        if max_minutes is not None:
            update["optim"]["max_minutes"] = max_minutes
        if warm_start:
            update["optim"]["lr"], update["draft_vocab"] = self.incremental_lr, None
        if generic:
            update.update(kind=DRAFT_MODEL, loss=LossConfig(kind="ce").model_dump(), eagle3=Eagle3Config().model_dump())
        elif self.on_features:
            update["eagle3"] = {**self.eagle3.model_dump(), "feature_dir": feature_dir, "feature_dtype": config.dtype}
            # `deepen` false: a warm start from a head trained for another target version, whose first position
            # the update undid (the demo's champion read 0.119 on its updated target): it retrains that first
            if warm_start and deepen and self.incremental_steps is not None:
                update["eagle3"]["steps"] = next_depth(warm_depth, self.incremental_steps)
            if warm_start and deepen and self.incremental_deep_share is not None:
                update["eagle3"]["deep_share"] = self.incremental_deep_share
        raw = {**self.model_dump(exclude={"incremental_lr", "incremental_steps", "incremental_deep_share"}), **update}
        return DistillConfig.model_validate(raw)


def next_depth(warm_depth: int | None, cap: int) -> int:
    """The unroll a warm night trains: one step past its head's (a head of unknown depth counts as one), at
    most `cap`; never shallower than the head, so a night cannot undo depth earlier nights trained."""
    depth = max(1, warm_depth or 1)
    return depth if depth >= cap else depth + 1


def train_autocast(config: NightlyConfig) -> bool:
    """`train.optim.bf16`, or (null) bf16 autocast when the run's models run in bf16 and, on a CPU, when a
    training step measures faster under it there (`distill.autocast`: once per CPU, cached in the state
    directory; without AMX a native-bf16 Xeon trains the head faster in fp32)."""
    if config.train.optim.bf16 is not None:
        return config.train.optim.bf16
    import torch  # lazy: keeps torch off the config's import

    from specdistill.modeling.models import resolve_device, resolve_dtype  # lazy: keeps torch off import

    if resolve_dtype(config.dtype) != torch.bfloat16:
        return False
    if resolve_device(config.device).type != "cpu":
        return True
    from specdistill.distill.autocast import probe_autocast  # lazy: keeps torch off import

    r = config.remeasure
    return probe_autocast(run_root() / "autocast", load_shift=r.load_shift, max_uses=r.max_runs, max_days=r.max_days).autocast


class PoolConfig(Strict):
    """The answer pool (`distill.pool`): each night's answers join their target version's pool and the
    night trains on it, newest first. `max_tokens` caps the answer tokens trained on (tonight's always in):
    the demo's head trains ~100k tokens a minute on 2 cores, so 400k is about one epoch of its 3 minutes
    and its feature rows take ~1.4 GB of memory. `max_gb` caps the pool's disk (the oldest nights leave
    first). After a target update the new version's pool starts with the old pool's `reanswer_prompts`
    most recent prompts answered by the new target (`reanswer_from`: the old fingerprint, set by the
    monitor); the pools of the `keep_versions` most recent target versions are kept."""

    enabled: bool = True
    max_tokens: Tokens | None = 400_000
    max_gb: float | None = Field(20.0, gt=0.0)
    keep_versions: Kept = 2
    reanswer_prompts: count(bounds.MAX_PROMPTS, low=0) = 256
    reanswer_from: str | None = None


class BenchSection(BenchSettings):
    """The YAML `bench:` section: the shared benchmark settings (`data.results.BenchSettings`: γ, tokens,
    repeats, with their one default each, for the harness and a serving engine alike), and what the nightly
    benchmarks and how long. `gamma` is the first benchmark's; then each drafter's is measured."""

    # EAGLE-3 heads, greedy: first-position candidates verified as a tree (1: a chain). Serving: SGLang's
    # --speculative-eagle-topk; vLLM and llama.cpp verify a chain
    tree_width: TreeWidth = 4
    self_spec_layers: list[LayerCount] = [8]
    ngram: bool = True
    # the suffix drafter over the window's train answers, and its hybrid with the challenger
    suffix: bool = True
    hybrid: bool = True
    suffix_max_tokens: Tokens | None = 10_000_000  # corpus cap: the newest answers that fit
    generic_draft: bool = True  # train the off-the-shelf baseline once (plain CE on human answers)
    # its training minutes (null: the draft's train.optim.max_minutes): a reference point, not the product, so
    # the demo's deadline goes to the head and the benchmark (a layer draft at 0.24 first-position acceptance after
    # 3 minutes; 0.69x at 1 minute against 0.72x at 2 on AMX; its stage costs ~1.3 minutes more than its training)
    generic_minutes: Minutes | None = 1.0
    # torch threads for the benchmark: auto probes 1, half and all cores and keeps the fastest (a shared
    # machine's busy cores stall every thread; `speculative.threads`); null: torch's default
    threads: Threads | Literal["auto"] | None = "auto"
    # the benchmark's wall-clock budget, γ confirmation included (null: none): past it no new prompt or
    # repeat starts (the prompts a decision needs, `serving.min_prompts` and the gate's `min_prompts`, are
    # measured) and the γ confirmation is skipped; the report says so
    max_minutes: Minutes | None = 4.0

    def bench_config(self) -> BenchConfig:
        from specdistill.speculative.harness_bench import BenchConfig  # lazy: torch, only when benchmarking

        return BenchConfig(**self.model_dump(include=set(BenchSettings.model_fields)))

    def engine_bench_config(self) -> EngineBenchConfig:
        from specdistill.engines.endpoint_bench import EngineBenchConfig  # lazy: HTTP client, only when benchmarking

        return EngineBenchConfig(**self.model_dump(include=set(BenchSettings.model_fields)))


# every `GateConfig` field as an optional key of the same type: the model checks an override's name and type
# at load, the profile (`ops.policy.PROFILES`) holds every default
_GATE_HINTS = get_type_hints(GateConfig)
GateOverrides = create_model("GateOverrides", __base__=Strict,
                             **{f.name: (_GATE_HINTS[f.name], None) for f in dataclass_fields(GateConfig)})


class GateSection(Strict):
    """The YAML `gate:` section: a profile of `ops.policy.GateConfig` (`ops.policy.PROFILES`, where every
    gate default lives), typed overrides of its fields (only the keys given apply), and the baselines to
    beat. The draft gate (`ops.policy.evaluate`) decides the `champion` alias: lossless, first-position
    acceptance at the red line (α at the measured γ is reported beside it), better than the champion
    (τ up by at least `min_accepted_length_gain`) and than the `must_beat` baselines. The nightly's
    profile, `draft`, has no speedup bar: speed on the measuring hardware is the serving choice's job
    (`ServingSection`), and a draft slower than n-gram on a 2-core CPU can still be the best draft for a GPU."""

    profile: Literal["draft", "default", "production"] = "draft"
    overrides: GateOverrides = GateOverrides()  # type: ignore[valid-type]
    must_beat: list[str] = [Role.GENERIC.value]  # baselines whose first-position acceptance the challenger must exceed

    def gate_config(self) -> GateConfig:
        return gate_config(self.profile, **self.overrides.model_dump(exclude_unset=True))


class ServingSection(Strict):
    """What `serving.json` names: the fastest lossless mode measured, only if its gain holds over the
    held-out prompts (`ops.policy.fastest_mode`: the `confidence` lower bound of its per-prompt speedups
    beats target-only decoding by `margin`; the no-slowdown guard the monitor uses too); its γ by
    measurement, the smaller one where the curve is flat.

    `engine` is where the speeds are measured (the gate's speed bar and this choice): this PyTorch
    harness; llama.cpp's llama-server, built here and started per mode on the target's GGUF; vLLM
    (`make vllm`), started per mode from the `speculative_config` serving.json would carry; or
    running OpenAI-compatible servers, one per mode, named in `endpoints` (`target-only` required)."""

    margin: float = Field(DEFAULT_MARGIN, ge=0.0)
    confidence: float = Field(CONFIDENCE, gt=0.0, lt=1.0)  # one-sided level of the speedup's lower bound
    min_prompts: Prompts = MIN_SERVED_PROMPTS  # fewer per-prompt speeds (a benchmark the deadline cut): not served
    choose_gamma: bool = True  # every drafter at the γ its measured curve predicts best, confirmed by a second run
    max_gamma: Gamma = 8
    engine: Literal["harness", "llamacpp", "vllm", "openai"] = "harness"
    threads: Threads = 2  # llama-server threads; vLLM CPU's OpenMP threads
    endpoints: dict[str, str] = {}  # engine openai: mode name (target-only, ngram, challenger, ...) -> base URL


class NightlyConfig(Strict):
    """Defaults are the demo world sized to finish in minutes on a 2-core CPU (`specdistill demo` runs them
    with the few changes of its recipe, `DEMO_RECIPE`)."""

    target: str = "demo"
    target_name: str = "SmolLM2-135M-Instruct"
    sources: list[SourceConfig] = [
        SourceConfig(path="sharegpt", format="sharegpt", slice="chat"),
        SourceConfig(path="humaneval", format="humaneval", slice="code"),
    ]
    window: WindowConfig = WindowConfig()
    generation: GenerationConfig = GenerationConfig()
    train: NightlyTrain = NightlyTrain()
    pool: PoolConfig = PoolConfig()
    bench: BenchSection = BenchSection()
    gate: GateSection = GateSection()
    serving: ServingSection = ServingSection()
    remeasure: RemeasureConfig = RemeasureConfig()  # when a kept measurement (answer engine, autocast) is taken again
    # the one dtype and device every stage's models run in: answers, features, training, benchmark, exports
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 where the hardware has it (CUDA, AVX-512 BF16, AMX)
    device: str = "auto"  # auto: the GPU when torch sees one, else the CPU; cpu, cuda or cuda:N (every stage's models)
    # the whole run's wall-clock deadline (null: none), shared by the budgeted stages (answers, training,
    # the generic baseline, the benchmark) in proportion to their own budgets: a slow machine does less of
    # each instead of running past its window (pipeline.stage_budgets). The demo's budgets fit 18 minutes.
    deadline_minutes: Minutes | None = 18.0
    log_db: str | None = None  # default: SQLite under $SPECDISTILL_HOME
    # after a run succeeds, traffic and what was derived from it older than this many days leave the log
    # store and the state directory (`pipeline.retention.prune`; a registered draft's window stays); null: kept
    retention_days: float | None = Field(default=None, gt=0)
    serving_path: str | None = None  # default: $SPECDISTILL_HOME/serving.json

    @field_validator("device")
    @classmethod
    def _device_exists(cls, device: str) -> str:
        from specdistill.modeling.models import check_device  # lazy: keeps torch off import

        return check_device(device)

    @model_validator(mode="after")
    def _engine_reaches_the_target(self):
        g = self.generation
        if g.backend == "openai" and not g.url and g.engine == "llamacpp" and not (self.target == "demo" or self.target.endswith(".gguf")):
            raise ValueError(f"generation.backend=openai needs generation.url, or a GGUF target to start llama-server "
                             f"on ('demo' or a .gguf file); target is {self.target!r}")
        return self


# what `specdistill demo` runs: deploy/nightly/demo.yaml, the demo's changes to these defaults. The package
# ships it as recipes/demo.yaml (in a checkout a link to the deploy file, in a built wheel its copy), so the
# demo reads the one file from a clone, an editable install or an installed wheel, in any directory
DEMO_RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "demo.yaml"


def flow_overrides(overrides: list[str] | None) -> list[str]:
    """`key=value` overrides as a flow's parameters (Prefect stores them): each credential replaced by
    `${SPECDISTILL_SECRET_n}`, its value kept in this process's environment, where loading finds it."""
    return stash_secrets(list(overrides or []))


def masked_flow_logs() -> contextlib.AbstractContextManager[None]:
    """While a flow runs, every credential in a record of Prefect's loggers (the flow-run log Prefect keeps
    in its database, the console) is masked before a handler sees it: a driver's error quotes URLs."""
    return masked_logs("prefect")


def load_nightly_config(path: str | Path | None = None, overrides: list[str] | None = None) -> NightlyConfig:
    """YAML file plus dotted `key=value` overrides; unknown keys fail here, before any work."""
    return load_model_config(NightlyConfig, path, overrides, what="nightly config")


def config_hash(obj: Any) -> str:
    """A short content key for a config (or any JSON-able value): the name of the directory its outputs go to."""
    data = obj.model_dump(mode="json") if hasattr(obj, "model_dump") else obj
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:12]


def run_root() -> Path:
    return paths.ensure_private(paths.home() / "nightly")  # traffic, answers, corpora: the owner only

def target_tokenizer(config: NightlyConfig):
    """The target's tokenizer, for the stages that read text without loading the target."""
    from transformers import AutoTokenizer  # lazy: transformers stays off the config's import

    from specdistill.modeling.models import resolve_model_dir  # lazy: torch stays off the config's import

    return AutoTokenizer.from_pretrained(resolve_model_dir(config.target))
