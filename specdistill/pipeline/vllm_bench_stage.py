"""Stage (serving.engine vllm): each servable mode measured in a real vLLM, started from the very
`speculative_config` block `serving.json` would carry for it.

The mode's serving config is built as `serve.serving_config` builds the one it writes (the drafter's
serving keys from its kind, the draft's directory and kind, self-speculation's exported early-exit draft),
and its `vllm()` block is what vLLM is started with. A mode vLLM refuses gets an entry that cannot be
served (not lossless, speedup 0) carrying vLLM's own error, so the serving choice skips it and says why.
"""

from __future__ import annotations

from dataclasses import replace

from specdistill.budget import Deadline
from specdistill.data.results import BenchResult
from specdistill.ops.serving import ServingConfig
from specdistill.pipeline.config import NightlyConfig
from specdistill.speculative.specs import DrafterSpec


def mode_serving_config(spec: DrafterSpec, gamma: int, target_ref: str) -> ServingConfig:
    """The serving config `serving.json` would carry for a drafter spec (`draft:REF`, `self-spec:K`, `ngram...`):
    its serving keys (`DrafterSpec.serving_keys`), with a draft directory. A draft reference
    (`models:/NAME@ALIAS` included) is resolved, and a registered one verified, here: vLLM is handed a local
    HF directory, never a reference it cannot read. A suffix corpus is ours only (vLLM's suffix trees fill
    from served requests: docs/serving.md)."""
    if not spec.served:
        raise ValueError(f"drafter {str(spec)!r} has no vLLM mode: no serving engine runs a {spec.kind} drafter")
    keys = dict(spec.serving_keys(), num_speculative_tokens=gamma)
    if spec.path:
        from specdistill.modeling.eagle3_io import is_eagle3_dir  # lazy: keeps torch off import
        from specdistill.modeling.models import resolve_model_dir  # lazy: keeps torch off import

        draft_dir = resolve_model_dir(spec.path)
        return ServingConfig(draft_dir=str(draft_dir), draft_kind="eagle3" if is_eagle3_dir(draft_dir) else "layers",
                             **keys)
    if spec.exit_layer is not None:
        from specdistill.modeling.drafts import export_early_exit_draft  # lazy: keeps torch off import
        from specdistill.modeling.models import load_model  # lazy: keeps torch off import

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


def vllm_engine_benchmark(config: NightlyConfig, prompts, servable: dict[str, DrafterSpec], bcfg,
                          deadline: Deadline | None = None) -> dict[str, BenchResult]:
    """`engine_bench.engine_benchmark` for serving.engine vllm: results keyed by drafter name."""
    from specdistill.engines.vllm_bench import bench_vllm, served_dtype  # lazy: keeps torch off import

    s, b = config.serving, config.bench
    configs = {name: mode_serving_config(spec, b.gamma, config.target) for name, spec in servable.items()}
    run = bench_vllm(config.target, {name: c.vllm() for name, c in configs.items()}, prompts, bcfg,
                     threads=s.threads, dtype=config.dtype, deadline=deadline)
    out = {name: replace(r, spec=str(servable[name])) for name, r in run.results.items()}
    for name, cause in run.refused.items():
        out[name] = refused_entry(name, servable[name], cause, b.gamma, served_dtype(config.dtype))
    for entry in out.values():
        entry.stats["vllm_version"] = run.version
    return out
