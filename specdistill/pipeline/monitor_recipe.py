"""The monitor recipe: its typed config, `MonitorConfig`, that deploy/monitor/*.yaml and dotted `key=value`
overrides map onto, naming the nightly recipe its incremental distillation runs."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import Field

from specdistill.ops.policy import MAX_RELATIVE_DROP, RED_LINE
from specdistill.ops.serving import read_serving_config
from specdistill.ops.targets import current_target
from specdistill.pipeline.nightly_recipe import NightlyConfig, load_nightly_config
from specdistill.recipe import ConfigError, Gamma, LayerCount, NewTokens, Prompts, Repeats, Seconds, Strict, Tokens, load_model_config


class MonitorConfig(Strict):
    target: str | None = None  # the target being served (None: the last `target register`ed, else demo)
    nightly_config: str | None = None  # the nightly flow's config for incremental distillation
    nightly_overrides: list[str] = []
    red_line: float = Field(RED_LINE, gt=0.0, lt=1.0)  # first-position acceptance below this: fallback + retrain
    # first-position acceptance this far (relatively) under the champion's own at registration: retrain, keep serving
    max_relative_drop: float = Field(MAX_RELATIVE_DROP, gt=0.0, lt=1.0)
    # the replay reads at most this many of the newest prompts, and stops sooner once the 95% interval of
    # first-position acceptance clears the lines the decision reads (`ops.policy.sequential`)
    replay_prompts: Prompts = 12
    gamma: Gamma | None = None  # None: the γ serving.json names (what is served), else the nightly's bench.gamma
    max_new_tokens: NewTokens = 32
    min_draft_tokens: Tokens = 64  # fewer sampled tokens: no sample, no decision
    live_metrics_url: str | None = None  # a serving engine's /metrics (vLLM or llama.cpp names); else replay
    live_interval_s: Seconds = 30.0
    fallback_exit_layers: list[LayerCount] = [4, 8, 12]
    fallback_min_tokens: Tokens = 64
    fallback_repeats: Repeats = 1
    # the fallback bench measures at most this many prompts, and stops once its 95% bounds settle the choice
    fallback_prompts: Prompts = 16
    fallback_suffix_corpus: str | None = None  # None: the state directory's current corpus (the nightly's), if any
    replay_share: float = Field(0.25, ge=0.0, lt=1.0)  # of older traffic in the incremental run
    # the decision (replay, fallback choice) ends within this many minutes of the flow's start, retraining aside;
    # the two stages share what is left in proportion to their own budgets, as the nightly's stages do
    deadline_minutes: float | None = Field(8.0, ge=0.0)
    replay_max_minutes: float | None = Field(1.5, ge=0.0)
    fallback_max_minutes: float | None = Field(6.0, ge=0.0)
    # torch threads for the replay and the fallback bench: auto probes 1, half and all cores and keeps the
    # fastest, again when other work comes or goes (a monitor runs beside a serving engine); null: torch's
    threads: int | Literal["auto"] | None = "auto"
    retrain: bool = True  # false: decide (and fall back) only; the incremental nightly run is left to the caller

    def target_ref(self) -> str:
        if self.target:
            return self.target
        registered = current_target()
        return registered.ref if registered else "demo"

    @cached_property
    def nightly(self) -> NightlyConfig:
        return load_nightly_config(self.nightly_config, [f"target={self.target_ref()}", *self.nightly_overrides])

    def replay_gamma(self) -> int:
        """`gamma`, else what serving.json serves, else the nightly's `bench.gamma`."""
        if self.gamma is not None:
            return self.gamma

        served = read_serving_config(self.nightly.serving_path)
        return served.num_speculative_tokens if served is not None and served.mode != "off" else self.nightly.bench.gamma


def load_monitor_config(path: str | Path | None = None, overrides: list[str] | None = None) -> MonitorConfig:
    config = load_model_config(MonitorConfig, path, overrides, what="monitor config")
    try:
        _ = config.nightly  # the nightly config it names must be valid too, before any work
    except ConfigError as exc:
        raise ConfigError(f"{path or 'monitor config'}: nightly_config: {exc}") from None
    return config
