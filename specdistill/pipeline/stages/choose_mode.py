"""Which mode the serving engine runs after a nightly run.

Every mode measured on the held-out prompts goes through the one no-slowdown guard
(`ops.policy.fastest_mode`, which the monitor's fallback uses too). Every mode arrives at its own γ,
chosen by measurement in the benchmark stage (`speculative.gamma.bench_at_best_gamma`), so modes are
compared at their best and the winner is served at it. The `champion` alias is not decided here: it
names the best draft (the gate), even when another mode is faster on this hardware; the report says so.
"""

from __future__ import annotations

from specdistill.data.results import BenchResult
from specdistill.hardware import cpu_info
from specdistill.ops.policy import Candidate, GateVerdict, fastest_mode, servable, unserved_faster_challenger
from specdistill.pipeline.nightly_recipe import NightlyConfig
from specdistill.pipeline.outputs import ServingDecision, Window
from specdistill.pipeline.serving import gamma_note
from specdistill.speculative.gamma import best_gamma, predict_speedups
from specdistill.speculative.specs import DrafterSpec


def serving_candidates(results: dict[str, BenchResult], verdict: GateVerdict) -> dict[str, BenchResult]:
    return servable(results, verdict.promote)


def _candidates(entries: dict[str, BenchResult], gamma: int | None = None) -> list[Candidate]:
    return [Candidate(name, DrafterSpec.parse(r.spec).mode, r.speedup, r.lossless, gamma or r.gamma,
                      prompt_speedups=list(r.prompt_speedups), accepted_length=r.accepted_length or None)
            for name, r in entries.items()]


def _served(decision: ServingDecision, entries: dict[str, BenchResult], name: str) -> BenchResult:
    """The winning entry, written into the decision: its name, its drafter (its record's text, parsed), its speedup."""
    r = entries[name]
    decision.name, decision.spec, decision.speedup = name, DrafterSpec.parse(r.spec), r.speedup
    return r


def choose_serving(config: NightlyConfig, window: Window, results: dict[str, BenchResult],
                   verdict: GateVerdict, speeds: dict[str, BenchResult] | None = None) -> ServingDecision:
    """`speeds` (from `engine_bench.engine_benchmark`) when the serving engine is not the harness: there γ is the
    benchmark's K (the harness's γ search models the harness's verification cost, not the engine's). In the
    harness each entry was benchmarked at its own best γ already (`pipeline.stages.bench.benchmark`), and the
    winner is served at that γ."""
    b, s = config.bench, config.serving
    in_engine = s.engine != "harness"
    if in_engine and speeds is None:
        raise ValueError(f"serving.engine {s.engine}: the engine's measurements are missing")
    entries = speeds if in_engine else results
    refused = {name: r.refused for name, r in entries.items() if r.refused}
    candidates = {name: r for name, r in serving_candidates(entries, verdict).items() if name not in refused}
    choice = fastest_mode(_candidates(candidates, b.gamma if in_engine else None), s.margin, confidence=s.confidence,
                          min_prompts=s.min_prompts)
    some = next(iter(entries.values()), None)
    dtype = some.dtype if some else "?"
    decision = ServingDecision(mode=choice.mode, gamma=b.gamma, reason=choice.reason, measured_on=f"PyTorch harness, {dtype}",
                               measured={name: r.speedup for name, r in entries.items() if name not in refused},
                               speedup_lower_bound=choice.lower_bound, confidence=choice.confidence)
    if in_engine:
        decision.engine, decision.gamma_note = s.engine, f"γ=K={b.gamma} as measured in {s.engine}"
        decision.measured_on = f"{s.engine}, {dtype}" + (f", {s.threads} threads" if s.engine in ("llamacpp", "vllm") else "")
        if s.engine == "vllm" and some is not None:
            decision.measured_on += f", vLLM {some.engine_version or '?'}, {cpu_info().describe()}"
        if refused:
            decision.reason += "; not served, vLLM refused: " + "; ".join(f"{n} ({why})" for n, why in refused.items())
        if some is not None and s.engine == "llamacpp":  # target-only: the measured command without the mode's flags
            decision.llamacpp_args = some.llamacpp_args[:4]
        if choice.candidate is not None:
            decision.llamacpp_args = _served(decision, candidates, choice.candidate.name).llamacpp_args
        return decision
    held_back = unserved_faster_challenger(results, verdict, choice.candidate.speedup if choice.candidate else 1.0)
    if held_back:
        decision.reason += f"; {held_back}"
    if choice.candidate is None:
        return decision
    r = _served(decision, candidates, choice.candidate.name)
    search = r.gamma_search
    decision.gamma, decision.tree_width, decision.gamma_note = r.gamma, r.tree_width, gamma_note(r)
    if search is not None:
        decision.predicted_speedups, decision.verify_costs = dict(search.predicted_speedups), dict(search.verify_costs)
        decision.chain_gamma = chain_gamma(r)
    return decision


def chain_gamma(r: BenchResult) -> int | None:
    """For a head measured as a tree: the chain depth engines that verify chains only should run it at, the γ
    its own chain (the tree's top-1 branch, counted by position) predicts fastest on the measured verify costs."""
    search = r.gamma_search
    if r.tree_width <= 1 or search is None or r.cost_ratio is None or not r.per_position_acceptance:
        return None
    gammas = [g for g in sorted(search.verify_costs) if g + 1 in search.verify_costs]
    return best_gamma(predict_speedups(r.per_position_acceptance, r.cost_ratio, search.verify_costs, gammas))
