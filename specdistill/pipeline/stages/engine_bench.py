"""Stage: the servable modes' speeds measured in the serving engine (`serving.engine`), on the same
held-out prompts as the harness benchmark.

The harness benchmark stays the judge of a draft's quality (α, τ, losslessness: properties of the
draft, measured exactly); speed is a property of the engine that serves, so the gate's speed bar and
the serving choice read these numbers when an engine is configured. llama.cpp gets each mode as
llama-server does it: a draft (or self-speculation's early-exit draft) exported to GGUF with
`draft-simple`, an EAGLE-3 head exported to GGUF with `draft-eagle3`, n-gram lookup as `ngram-simple`;
the off-the-shelf baseline is never served, so not measured. vLLM gets each mode from the very
`speculative_config` block `serving.json` would carry for it (`mode_serving_config`); a mode vLLM refuses gets
an entry that cannot be served (not lossless, speedup 0) carrying vLLM's own error, so the serving choice
skips it and says why.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from specdistill.acceptance import DEFAULT_GAMMA
from specdistill.data.prompts import Prompt
from specdistill.data.results import BenchResult
from specdistill.engines.endpoint_bench import TARGET_ONLY, run_engine_bench
from specdistill.engines.llamacpp import engine as llamacpp
from specdistill.engines.llamacpp.engine import bench_llamacpp, ngram_mode, target_gguf
from specdistill.engines.vllm.bench import bench_vllm, served_dtype
from specdistill.modeling.drafts import export_early_exit_draft
from specdistill.modeling.models import load_model, resolve_model_dir, shared_model
from specdistill.ops.policy import Role
from specdistill.ops.serving import ServingConfig
from specdistill.pipeline.nightly_recipe import NightlyConfig
from specdistill.pipeline.outputs import Window
from specdistill.pipeline.stage_budgets import stage_deadline
from specdistill.speculative.specs import DRAFT_MODEL, DrafterSpec


def mode_for_spec(spec: DrafterSpec, target: Path, k: int = DEFAULT_GAMMA):
    """The llama-server mode of a drafter spec (`draft_model:REF|GGUF` or `ngram`): the draft's GGUF mode, or
    n-gram lookup of the spec's longest n (plain `ngram`: `acceptance.NGRAM_WINDOW`); self-speculation
    reaches llama.cpp as its exported early-exit draft, i.e. as `draft_model:DIR` (`llamacpp_spec`). A draft
    reference other than a GGUF file (`models:/NAME@ALIAS` included) is resolved to its directory first."""
    if spec.path:
        draft = spec.path if spec.path.endswith(".gguf") else resolve_model_dir(spec.path)
        return llamacpp.draft_mode(draft, target, k)
    if spec.ngram_sizes:
        return ngram_mode(spec.ngram_sizes[1], k) if spec.arg else ngram_mode(k=k)
    raise ValueError(f"drafter {str(spec)!r} has no llama.cpp mode (draft_model:DIR or ngram)")


def llamacpp_spec(config: NightlyConfig, spec: DrafterSpec) -> DrafterSpec:
    """A drafter spec llama.cpp can run: self-speculation becomes its exported early-exit draft."""
    if spec.exit_layer is None:
        return spec
    target = shared_model(config.target, dtype=config.dtype, device=config.device)  # the run's dtype, as every stage
    return DrafterSpec(DRAFT_MODEL, str(export_early_exit_draft(target, spec.exit_layer)))


def engine_benchmark(config: NightlyConfig, window: Window, drafters: dict[str, DrafterSpec],
                     deadline_at: float | None = None) -> dict[str, BenchResult]:
    """Each servable drafter against target-only in `config.serving.engine`, interleaved per prompt, until
    its share of the run's deadline (`bench.max_minutes`, as the harness benchmark; servers' start-up
    included). Results are keyed by drafter name, with the `spec` the harness benchmark used."""
    s, b = config.serving, config.bench
    deadline = stage_deadline(config, "engine benchmark", deadline_at)
    # the eval prompts' chat turns: the engine applies the template
    prompts = [Prompt(text=p.messages[-1]["content"], slice=p.slice, messages=p.messages) for p in window.eval]
    bcfg = b.engine_bench_config()
    servable = {name: spec for name, spec in drafters.items() if Role.served(name) and spec.served}
    if s.engine == "llamacpp":
        # llama.cpp's lookup cache is its own file format (docs/serving.md): the suffix drafter is not measured there
        servable = {name: spec for name, spec in servable.items() if spec.runs_in_llamacpp}
        gguf = target_gguf(config.target)
        modes = {name: mode_for_spec(llamacpp_spec(config, spec), gguf, b.gamma) for name, spec in servable.items()}
        results = bench_llamacpp(config.target, modes, prompts, bcfg, threads=s.threads, deadline=deadline)
        out = {name: replace(r, spec=str(servable[name])) for name, r in results.items()}
        for name, mode in modes.items():  # the command line measured (the draft GGUF included): what serving.json names
            out[name].stats["llamacpp_args"] = ["-m", str(gguf), "-t", str(s.threads), *mode.args()]
        return out
    if s.engine == "vllm":
        configs = {name: mode_serving_config(spec, b.gamma, config.target) for name, spec in servable.items()}
        run = bench_vllm(config.target, {name: c.vllm() for name, c in configs.items()}, prompts, bcfg,
                         threads=s.threads, dtype=config.dtype, deadline=deadline)
        out = {name: replace(r, spec=str(servable[name])) for name, r in run.results.items()}
        for name, cause in run.refused.items():
            out[name] = refused_entry(name, servable[name], cause, b.gamma, served_dtype(config.dtype))
        for entry in out.values():
            entry.stats["vllm_version"] = run.version
        return out
    if s.engine == "openai":
        if TARGET_ONLY not in s.endpoints or len(s.endpoints) < 2:
            raise ValueError(f"serving.engine openai needs serving.endpoints with {TARGET_ONLY!r} and at least one mode "
                             f"(got {sorted(s.endpoints)})")
        unknown = [n for n in s.endpoints if n != TARGET_ONLY and n not in drafters]
        if unknown:
            raise ValueError(f"serving.endpoints names modes this run did not benchmark: {unknown} (known: {sorted(drafters)})")
        results = run_engine_bench(dict(s.endpoints), prompts, bcfg, engine="openai", dtype="served", deadline=deadline)
        return {name: replace(r, spec=str(drafters[name])) for name, r in results.items()}
    raise ValueError(f"serving.engine {s.engine!r} has no separate engine benchmark (the harness benchmark is it)")


def mode_serving_config(spec: DrafterSpec, gamma: int, target_ref: str) -> ServingConfig:
    """The serving config `serving.json` would carry for a drafter spec (`draft_model:REF`, `self-spec:K`, `ngram...`):
    its serving keys (`DrafterSpec.serving_keys`), with a draft directory. A draft reference
    (`models:/NAME@ALIAS` included) is resolved, and a registered one verified, here: vLLM is handed a local
    HF directory, never a reference it cannot read. A suffix corpus is ours only (vLLM's suffix trees fill
    from served requests: docs/serving.md)."""
    if not spec.served:
        raise ValueError(f"drafter {str(spec)!r} has no vLLM mode: no serving engine runs a {spec.kind} drafter")
    keys = dict(spec.serving_keys(), num_speculative_tokens=gamma)
    if spec.path:
        resolved = spec.resolved(str(resolve_model_dir(spec.path)))  # a registered head is an eagle3 draft
        return ServingConfig(draft_dir=resolved.arg, **{**keys, **resolved.serving_keys()})
    if spec.exit_layer is not None:
        target = load_model(target_ref, dtype="float32")  # a weight copy for vLLM to load
        return ServingConfig(draft_dir=str(export_early_exit_draft(target, spec.exit_layer)), **keys)
    return ServingConfig(**keys)


def refused_entry(name: str, spec: DrafterSpec, cause: str, gamma: int, dtype: str) -> BenchResult:
    """A mode vLLM would not start: measured as nothing, never served, vLLM's reason kept."""
    return BenchResult(drafter=name, gamma=gamma, max_new_tokens=0, repeats=0, greedy=True, lossless=False,
                       lossless_mismatches=0, acceptance_rate=0.0, accepted_length=1.0, per_position_acceptance=[],
                       request_acceptance_p10=0.0, request_acceptance_p50=0.0, request_acceptance_p90=0.0,
                       tokens_per_second_target_only=0.0, tokens_per_second_speculative=0.0, speedup=0.0,
                       cost_ratio=None, ideal_speedup=None, slices=[], stats={"vllm_refused": cause}, dtype=dtype,
                       engine="vllm", spec=str(spec))
