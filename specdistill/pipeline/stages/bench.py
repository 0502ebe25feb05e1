"""The nightly's benchmark and gate stages: which drafters are measured (the drafts by their role,
the draft-free modes by name), every one on the same held-out prompts at its own best γ, and the
gate's verdict on the challenger (`ops.policy.evaluate`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from specdistill.data.prompts import Prompt, encode_chat
from specdistill.data.results import BenchResult
from specdistill.modeling.models import shared_model
from specdistill.ops.policy import GateVerdict, Role, evaluate
from specdistill.pipeline.nightly_recipe import NightlyConfig, target_tokenizer
from specdistill.pipeline.outputs import Trained, WarmStart, Window
from specdistill.pipeline.stage_budgets import stage_deadline
from specdistill.pipeline.tail import fit_drafters, measure_decode, skipped_note
from specdistill.speculative import drafter_from_spec
from specdistill.speculative.gamma import bench_at_best_gamma
from specdistill.speculative.harness_bench import run_bench_many
from specdistill.speculative.specs import SELF_SPEC, DrafterSpec, hybrid_model
from specdistill.speculative.threads import ThreadChoice, chosen_threads


def measured_drafters(config: NightlyConfig, trained: Trained, warm_start: WarmStart | None,
                      generic: Trained | None, suffix_corpus: str | None = None) -> dict[str, DrafterSpec]:
    """The benchmark's entries and their drafter specs: the drafts by their role (the challenger, the
    champion as warm-started, the generic baseline), the draft-free modes by their own names; with a
    `suffix_corpus` (the target's own train answers), the suffix drafter alone and (`bench.hybrid`) beside
    the challenger."""
    drafters = {Role.CHALLENGER.value: DrafterSpec.for_draft(trained.draft_dir)}
    if warm_start:
        drafters[Role.CHAMPION.value] = DrafterSpec.for_draft(warm_start.dir)
    if generic:
        drafters[Role.GENERIC.value] = DrafterSpec.for_draft(generic.draft_dir)
    for spec in (DrafterSpec(SELF_SPEC, str(layer)) for layer in config.bench.self_spec_layers):
        drafters[str(spec)] = spec  # a draft-free mode's entry is named by its spec
    if config.bench.ngram:
        drafters["ngram"] = DrafterSpec("ngram")
    if suffix_corpus:
        drafters["suffix"] = DrafterSpec("suffix", suffix_corpus)
        if config.bench.hybrid:
            drafters["hybrid"] = DrafterSpec("hybrid", f"{trained.draft_dir},{suffix_corpus}")
    return drafters


def benchmark(config: NightlyConfig, window: Window, drafters: dict[str, DrafterSpec],
              deadline_at: float | None = None) -> dict[str, BenchResult]:
    """Every drafter on the same held-out prompts, sharing one interleaved target-only run per prompt,
    then (`serving.choose_gamma`) each at the γ its curve predicts best, confirmed by a second run.

    Each drafter is built by `speculative.drafter_from_spec` (a corpus is checked against the target's
    fingerprint); results are keyed by the given name and carry the spec they ran as text (`BenchResult.spec`).
    """
    target = shared_model(config.target, dtype=config.dtype, device=config.device)
    tokenizer = target_tokenizer(config)
    prompts = [Prompt(text="", slice=p.slice, ids=encode_chat(tokenizer, p.messages)) for p in window.eval]
    # `auto`: the thread count for the load found, probed again between prompt rounds when the load moves (a
    # neighbour that comes or goes mid-benchmark), as the monitor measures; the process's count put back after
    with chosen_threads(config.bench.threads, target.model, prompts[0].ids if prompts else None) as watch:
        drafters, skipped = _fit(config, drafters, target, prompts, watch.choices[0] if watch else None, deadline_at)
        results = _bench(config, drafters, target, prompts, deadline_at, watch.check if watch else None)
    probe = {"thread_probe": watch.choices[0].to_dict(), "thread_watch": watch.describe()} if watch else {}
    return {name: replace(result, spec=str(drafters[name]), stats={**result.stats, **probe},
                          budget_note="; ".join(x for x in (result.budget_note, skipped) if x))
            for name, result in results.items()}


def _fit(config: NightlyConfig, drafters: dict[str, DrafterSpec], target, prompts: list[Prompt],
         threads: ThreadChoice | None, deadline_at: float | None) -> tuple[dict[str, DrafterSpec], str]:
    """The entries the benchmark's share of the deadline has time for (`pipeline.tail.fit_drafters`: the
    challenger and the champion always), at the decode speed the thread probe measured (timed here without
    one), and the report's note on those left out (empty: every one fits, or no deadline)."""
    deadline = stage_deadline(config, "benchmark", deadline_at)
    if deadline.at is None or not prompts:
        return drafters, ""
    rate = max(threads.tokens_per_second.values()) if threads and threads.tokens_per_second else None
    if rate is None:
        rate, _ = measure_decode(target.model, prompts[0].ids, config.bench.threads)
    seconds = deadline.remaining()
    kept, skipped = fit_drafters(config, drafters, seconds, rate)
    return {n: drafters[n] for n in kept}, skipped_note(skipped, seconds, rate) if skipped else ""


def _bench(config: NightlyConfig, drafters: dict[str, DrafterSpec], target, prompts, deadline_at: float | None,
           between_rounds: Callable[[], object] | None = None) -> dict[str, BenchResult]:
    b, s = config.bench, config.serving
    bcfg = b.bench_config()
    made = {name: drafter_from_spec(target.model, spec, tree_width=_served_tree_width(spec, b.tree_width),
                                    target_fingerprint=target.fingerprint,
                                    target_tokenizer=target.tokenizer_digest)
            for name, spec in drafters.items()}
    deadline = stage_deadline(config, "benchmark", deadline_at)  # `bench.max_minutes`, its share of the run's deadline
    gammas = {name: first_gamma(spec, bcfg.gamma) for name, spec in drafters.items()}
    # however late the run, the prompts the gate and the serving choice need are measured (past the deadline)
    needed = max(s.min_prompts, config.gate.gate_config().min_prompts or 0)
    results = run_bench_many(target.model, target.tokenizer, made, prompts, bcfg, gammas=gammas, deadline=deadline,
                             min_prompts=needed, between_rounds=between_rounds)
    if s.choose_gamma and deadline.expired():
        skipped = "time budget reached: each drafter's γ was not searched (measured at the benchmark's γ only)"
        results = {name: replace(r, budget_note="; ".join(x for x in (r.budget_note, skipped) if x))
                   for name, r in results.items()}
    elif s.choose_gamma:
        results = bench_at_best_gamma(target.model, target.tokenizer, made, prompts, bcfg, results, range(1, s.max_gamma + 1),
                                      deadline=deadline)
    return results


def first_gamma(spec: DrafterSpec, gamma: int) -> int:
    """The γ a drafter is first measured at: the benchmark's, or less where its kind knows its draft proposes
    fewer positions (`Kind.first_gamma`: an EAGLE-3 head no deeper than it was trained to unroll). Where the
    budget skips the γ search, this γ is the one served."""
    return spec.of.first_gamma(spec, gamma)


def _served_tree_width(spec: DrafterSpec, width: int) -> int:
    """The tree width a drafter is measured with: vLLM and SGLang verify trees for the kinds served as one
    (`Kind.tree`: EAGLE-3 heads) only, so any other draft is measured as the chain it would be served as (a
    hybrid's head, measured only, verifies the tree the head alone would)."""
    model = hybrid_model(spec.arg) if spec.kind == "hybrid" else spec
    return width if model.of.tree else 1


def gate(config: NightlyConfig, challenger: BenchResult, champion: BenchResult | None,
         baselines: dict[str, BenchResult] | None = None, speeds: dict[str, BenchResult] | None = None) -> GateVerdict:
    """The gate's verdict (`ops.policy.evaluate`) under the run's profile, overrides and `must_beat`.
    With `speeds` (the serving engine's measurements) its speed bar reads the engine's speedups."""
    if speeds:
        if Role.CHALLENGER in speeds:
            challenger = replace(challenger, speedup=speeds[Role.CHALLENGER].speedup)
        if champion is not None and Role.CHAMPION in speeds:
            champion = replace(champion, speedup=speeds[Role.CHAMPION].speedup)
    g = config.gate
    return evaluate(challenger, g.gate_config(), champion=champion, baselines=baselines, must_beat=g.must_beat)
