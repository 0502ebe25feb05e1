"""What a serving decision becomes in serving.json: the nightly's choice (`stages.choose_mode`, written by
`stages.promote` or `stages.write_serving`) and the monitor's fallback (`stages.monitor`) as
`ops.serving.ServingConfig`, and how the winner's γ was chosen, in words (the decision's note, the report).
"""

from __future__ import annotations

from typing import Any

from specdistill.data.results import BenchResult
from specdistill.modeling.drafts import early_exit_dir, export_early_exit_draft
from specdistill.modeling.models import shared_model
from specdistill.ops.policy import Role
from specdistill.ops.serving import ServingConfig
from specdistill.pipeline.layout import sglang_corpus_path
from specdistill.pipeline.outputs import Champion, ServingDecision, TargetInfo
from specdistill.speculative.specs import DrafterSpec
from specdistill.speculative.suffix_corpus import read_corpus_meta


def gamma_note(r: BenchResult) -> str:
    """How an entry's γ was chosen, in words: the predicted best and what each measured γ ran at."""
    search = r.gamma_search
    if search is None or search.predicted_best is None:
        return f"γ={r.gamma} as benchmarked (no γ search)"
    best, predicted = search.predicted_best, search.predicted_speedups
    runs = ", ".join(f"{x:.2f}x at γ={g}" for g, x in sorted(search.measured.items()))
    if best == r.gamma and len(search.measured) == 1:
        return f"γ={best} predicted best ({predicted[best]:.2f}x) and measured {runs}"
    if best == r.gamma:
        kept = "confirmed"
    elif best in search.measured:  # the confirmation ran and did not beat the benchmark's γ
        kept = f"slower when measured, γ={r.gamma} kept"
    else:  # no time was left to measure it
        kept = f"not measured, γ={r.gamma} kept"
    return f"γ={best} predicted best ({predicted[best]:.2f}x), {kept}: measured {runs}"


def serving_config(decision: ServingDecision, target: TargetInfo, registered_version: str | None = None,
                   registered_dir: str | None = None, champion: Champion | None = None) -> ServingConfig:
    """The serving config for a decision: its drafter's serving keys (`DrafterSpec.serving_keys`: the n-gram
    window measured, the exit layer, the corpus), with the draft's directory, or the exported early-exit
    draft for self-speculation."""
    d = decision
    common = dict(mode=d.mode, num_speculative_tokens=d.gamma, target_fingerprint=target.fingerprint,
                  reason=f"nightly: {d.reason}" + (f"; {d.gamma_note}" if d.gamma_note else ""),
                  measured=d.measured, measured_on=d.measured_on, engine=d.engine, llamacpp_args=d.llamacpp_args,
                  hardware=target.hardware)
    spec = d.spec
    if d.mode == "off" or spec is None:
        return ServingConfig(**common)
    if not spec.path:
        return ServingConfig(**{**draft_free_fields(spec, target.fingerprint, target.path, target.dtype), **common})
    if d.name == Role.CHALLENGER:  # served from its registered copy once it is registered
        draft_dir, version = registered_dir or spec.path, registered_version
    else:
        draft_dir, version = spec.path, champion.version if champion else None
    tree = spec.of.tree  # SGLang verifies a tree for a head; engines that verify a chain run its chain depth
    return ServingConfig(draft_dir=draft_dir, draft_version=version, draft_kind=spec.of.draft_kind,
                         tree_width=d.tree_width if tree else 1,
                         chain_speculative_tokens=d.chain_gamma if tree and d.tree_width > 1 else None, **common)


def draft_free_fields(spec: DrafterSpec, fingerprint: str, target_path: str, dtype: str) -> dict[str, Any]:
    """The serving.json fields of a drafter without a draft of its own (the nightly's winner, the monitor's
    fallback): its serving keys, self-speculation's early-exit draft exported from the target in the dtype it
    was measured in (a copy: on the CPU), and for SGLang a suffix corpus's size and its export as answer texts."""
    fields = spec.serving_keys()
    if spec.exit_layer is not None:
        loaded = shared_model(target_path, dtype=dtype)
        fields["draft_dir"] = str(export_early_exit_draft(loaded, spec.exit_layer, early_exit_dir(fingerprint, spec.exit_layer)))
    if spec.corpus:
        sglang = sglang_corpus_path(spec.corpus)
        fields.update(suffix_corpus_tokens=read_corpus_meta(spec.corpus).tokens,
                      suffix_corpus_sglang=str(sglang) if sglang.is_file() else None)
    return fields
