"""What a run leaves for people: the nightly's Markdown report (every drafter on the same prompts
and the gate's decision), the numbers and files a registration carries into MLflow, and the
monitor's decision in words."""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

from specdistill import paths
from specdistill.data.record import to_dict
from specdistill.data.results import BenchResult
from specdistill.env import mask_secrets
from specdistill.ops.policy import Decision, GateVerdict, Role, first_position
from specdistill.ops.registry import RegisteredDraft
from specdistill.pipeline.layout import sglang_corpus_path
from specdistill.pipeline.nightly_recipe import NightlyConfig, run_root
from specdistill.pipeline.outputs import MonitorOutcome, Promoted, ServingDecision, TargetInfo, Trained, Window
from specdistill.pipeline.serving import gamma_note
from specdistill.speculative.specs import DrafterSpec
from specdistill.speculative.threads import ThreadChoice

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# The nightly's report


def lossless_cell(r: BenchResult) -> str:
    """The lossless verdict in words: exact matches, near-tie divergences (max fp32 margin), real mismatches."""
    if r.lossless is None:
        return "n/a (sampling)"
    exact, ties, bad = r.lossless_exact, r.lossless_near_ties, r.lossless_mismatches
    if bad:
        return f"NO: {bad} real mismatch{'es' if bad > 1 else ''}"
    if r.lossless_criterion is None and not exact:  # a result recorded before near-ties were told apart
        return "yes"
    if ties:
        return f"yes: {exact} exact, {ties} near-tie (≤ {r.lossless_max_margin:.2f})"
    return f"yes: {exact} exact"


def report_table(results: dict[str, BenchResult], verdict: GateVerdict | None = None, registered: RegisteredDraft | None = None,
                 promoted: Promoted | None = None, serving: ServingDecision | None = None,
                 target: TargetInfo | None = None, speeds: dict[str, BenchResult] | None = None) -> str:
    """Markdown: the challenger against the champion and the baselines on the same prompts, the gate
    (which draft is champion) and the serving choice (which mode is fastest here), each with its numbers."""
    lines = ["| drafter | first-position acceptance | acceptance α | accepted length τ | γ | speedup | cost ratio c | lossless |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in results.items():
        c = "" if r.cost_ratio is None else f"{r.cost_ratio:.3f}"
        gamma = f"{r.gamma} (tree {r.tree_width})" if r.tree_width > 1 else f"{r.gamma}"
        first = f"{r.first_position_acceptance:.3f}" if r.per_position_acceptance else "–"  # –: no per-position counts
        lines.append(f"| {name} | {first} | {r.acceptance_rate:.3f} | {r.accepted_length:.2f} | {gamma} | "
                     f"{r.speedup:.2f}x | {c} | {lossless_cell(r)} |")
    lines.append("| no speculation | – | – | 1.00 | – | 1.00x | – | yes |")
    lines += drafter_specs(results) + acceptance_by_position(results) + first_position_by_slice(results)
    if any(r.tree_width > 1 for r in results.values()):
        lines += ["", "γ (tree W): a draft tree verified in one target forward (greedy): an EAGLE-3 head grows γ deep, "
                      "each step expanding its W likeliest nodes into their top W, and the γ+W-1 likeliest nodes are "
                      "verified (EAGLE-2, as SGLang drafts); another draft proposes a chain of γ plus its next W-1 "
                      "candidates for the first position. α and acceptance by position are its top-1 chain's, τ counts "
                      "the other branches' accepted tokens too"]
    any_r = next(iter(results.values()), None)
    if any_r is not None:
        dtype = any_r.dtype or (target.dtype if target else "")
        probe, watched = any_r.stats.get("thread_probe"), any_r.stats.get("thread_watch")
        threads = watched or (ThreadChoice.from_dict(probe).describe() if probe else
                              (f"{any_r.threads} threads" if any_r.threads else ""))
        lines += ["", f"measured with the PyTorch harness{' in ' + dtype if dtype else ''}{', ' + threads if threads else ''}: "
                      f"{any_r.max_new_tokens} new tokens a prompt, target-only {any_r.tokens_per_second_target_only:.1f} "
                      f"tokens/s; speedups are interleaved medians against it on the same held-out prompts"]
    searched = {name: r for name, r in results.items() if r.gamma_search is not None}
    if searched:
        lines += ["", "γ per drafter, by measurement:", *(f"- {name}: {gamma_note(r)}" for name, r in searched.items())]
    if speeds:
        lines += ["", *engine_table(speeds)]
    if verdict is not None:
        lines += ["", f"**gate (champion draft): {'PASS' if verdict.passed else 'FAIL'}**", ""]
        lines += [f"- {reason}" for reason in verdict.reasons]
    if serving is not None:
        lines += ["", _serving_line(serving)]
        lines += _draft_vs_serving(results, verdict, serving)
    if registered is not None:
        alias = Role.CHAMPION if promoted else Role.CHALLENGER
        lines += ["", f"registered: `{registered.name}` version {registered.version} (alias `{alias}`)"]
    if promoted:
        lines.append(f"serving config: `{promoted.serving_config}`")
    elif registered is not None:
        lines.append("champion unchanged")
    return "\n".join(lines)


def engine_table(speeds: dict[str, BenchResult]) -> list[str]:
    """The servable modes as the serving engine measured them (the serving choice reads these)."""
    some = next(iter(speeds.values()))
    lines = [f"speeds in the serving engine: **{some.engine}**, {some.dtype}, {some.max_new_tokens} new tokens "
             f"a prompt, target-only {some.tokens_per_second_target_only:.1f} tokens/s (wall clock); α from the engine's counters",
             "", "| mode | acceptance α | accepted length τ | K | speedup | lossless (engine logprobs) |", "|---|---:|---:|---:|---:|---|"]
    for name, r in speeds.items():
        lines.append(f"| {name} | {r.acceptance_rate:.3f} | {r.accepted_length:.2f} | {r.gamma} | "
                     f"{r.speedup:.2f}x | {lossless_cell(r)} |")
    return lines + drafter_specs(speeds)


def drafter_specs(results: dict[str, BenchResult]) -> list[str]:
    """What each short name in a table stands for, below it: the specs carry corpus and draft paths,
    too long for a table's first column in a terminal."""
    specs = [f"- {name}: `{r.spec}`" for name, r in results.items() if r.spec and r.spec != name]
    return ["", "drafters:", *specs] if specs else []


def acceptance_by_position(results: dict[str, BenchResult]) -> list[str]:
    """Each drafter's acceptance at draft positions 1..γ (share of rounds that reached it) and, in brackets,
    given the positions before it were accepted: where a draft's run stops, which τ alone hides."""
    rows = {n: r.per_position_acceptance for n, r in results.items() if len(r.per_position_acceptance or []) > 1}
    if not rows:
        return []
    width = max(len(v) for v in rows.values())
    lines = ["", "acceptance by draft position (share of rounds; in brackets, given the positions before it accepted):", "",
             "| drafter | " + " | ".join(f"pos {i + 1}" for i in range(width)) + " |", "|---|" + "---:|" * width]
    for name, shares in rows.items():
        cells = [f"{a:.3f}" + (f" ({a / shares[i - 1]:.2f})" if i and shares[i - 1] else "") for i, a in enumerate(shares)]
        lines.append(f"| {name} | " + " | ".join(cells + ["–"] * (width - len(cells))) + " |")
    return lines


def first_position_by_slice(results: dict[str, BenchResult]) -> list[str]:
    """The drafts' first-position acceptance per slice of the held-out prompts, where there are several:
    one mean hides that a head drafts code well and chat badly."""
    names = [n for n, r in results.items() if len(r.slices) > 1 and all(s.first_position_acceptance is not None for s in r.slices)]
    if not names:
        return []
    slices = {s.name: s.requests for s in results[names[0]].slices}
    lines = ["", "first-position acceptance by slice:", "", f"| slice | prompts | {' | '.join(names)} |",
             "|---|---:|" + "---:|" * len(names)]
    for name, prompts in slices.items():
        cells = [next((f"{s.first_position_acceptance:.3f}" for s in results[n].slices if s.name == name), "–") for n in names]
        lines.append(f"| {name} | {prompts} | {' | '.join(cells)} |")
    return lines


def _serving_line(serving: ServingDecision) -> str:
    s = serving
    if s.mode == "off":
        return f"**serving: no speculation** (measured: {s.measured_on}): {s.reason}"
    tree = f" (tree {s.tree_width})" if s.tree_width > 1 else ""
    out = f"**serving: {s.mode} ({s.name}), γ={s.gamma}{tree}, {s.speedup:.2f}x measured ({s.measured_on})**: {s.reason}"
    if s.speedup_lower_bound is not None:
        out += (f"\n\nhow sure: the served mode's per-prompt speedups give a lower bound of "
                f"{s.speedup_lower_bound:.2f}x at {s.confidence:.0%} confidence (bootstrap over prompts)")
    if s.gamma_note:
        out += f"\n\nγ by measurement: {s.gamma_note}"
    if s.predicted_speedups:
        out += "; predicted by γ: " + ", ".join(f"{g}: {x:.2f}x" for g, x in sorted(s.predicted_speedups.items()))
    return out


def _draft_vs_serving(results: dict[str, BenchResult], verdict: GateVerdict | None, serving: ServingDecision) -> list[str]:
    """Say it plainly when the best draft is not what is served on this hardware."""
    best = Role.CHALLENGER if verdict and verdict.promote else (Role.CHAMPION if Role.CHAMPION in results else None)
    if best is None or serving.name == best:
        return []
    r = results[best]
    return ["", f"the {best} draft runs at {r.speedup:.2f}x here, so {serving.mode} is served instead; the "
                f"`champion` alias still names the best draft, for engines where verifying a draft is cheap (GPUs)."]


def write_report(text: str, window: Window, path: str | None = None) -> str:
    path = Path(path) if path else paths.ensure(run_root() / "reports") / f"{time.strftime('%Y%m%d-%H%M%S')}-{window.key}.md"
    paths.atomic_write_text(path, text + "\n", mode=paths.PUBLIC_FILE_MODE)
    return str(path)


# --------------------------------------------------------------------------------------------
# What a registration records in MLflow


def registration_metrics(results: dict[str, BenchResult], trained: Trained) -> dict[str, float]:
    challenger = results[Role.CHALLENGER]
    metrics = {"first_position_acceptance": first_position(challenger)[0] or 0.0,
               "acceptance_rate": challenger.acceptance_rate, "accepted_length": challenger.accepted_length,
               "speedup": challenger.speedup, "cost_ratio": challenger.cost_ratio or 0.0,
               "train_tokens": trained.tokens, "train_minutes": trained.train_minutes}
    for i, a in enumerate(challenger.per_position_acceptance):
        metrics[f"acceptance_pos_{i}"] = a
    for name, r in results.items():
        if name != Role.CHALLENGER:
            key = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
            metrics[f"baseline_{key}_acceptance_rate"] = r.acceptance_rate
            metrics[f"baseline_{key}_speedup"] = r.speedup
    return metrics


def train_losses(trained: Trained) -> list[float]:
    curve_file = Path(trained.draft_dir).parent / "train_log.jsonl"
    return [json.loads(line)["loss"] for line in curve_file.read_text().splitlines()] if curve_file.is_file() else []


def registration_artifacts(config: NightlyConfig, results: dict[str, BenchResult], verdict: GateVerdict, trained: Trained,
                           report_path: str | None, speeds: dict[str, BenchResult] | None = None) -> list[Path]:
    """benchmark.json, the run's config, gate.json, the challenger's acceptance plot, the report and the
    suffix corpus (when measured); with a serving engine's measurements, engine_benchmark.json and the
    challenger's GGUF as llama.cpp ran it."""
    artifacts_dir = paths.ensure(Path(trained.draft_dir).parent / "artifacts")
    for name, text in (("benchmark.json", json.dumps(to_dict(results), indent=2, default=str)),
                       ("nightly_config.json", mask_secrets(config.model_dump_json(indent=2))),  # no credential of log_db
                       ("gate.json", json.dumps(verdict.to_dict(), indent=2, default=str))):
        with paths.open_private(artifacts_dir / name, "w", encoding="utf-8") as f:
            f.write(text)
    artifacts = [artifacts_dir / "benchmark.json", artifacts_dir / "nightly_config.json", artifacts_dir / "gate.json"]
    plot = artifacts_dir / "acceptance.png"
    try:
        results[Role.CHALLENGER].plot(plot)
    except (ImportError, OSError) as exc:  # no matplotlib, or the file cannot be written: register without the plot
        log.warning("registering without the acceptance plot: %s: %s", type(exc).__name__, exc)
    else:
        artifacts.append(plot)
    if report_path:
        artifacts.append(Path(report_path))
    suffix = results["suffix"].spec if "suffix" in results else ""  # the record's text
    corpus = suffix and DrafterSpec.parse(suffix).corpus
    if corpus:  # the suffix drafter's corpus (and its SGLang export), beside the draft
        artifacts += [p for p in (Path(corpus), sglang_corpus_path(corpus)) if p.is_file()]
    if speeds:
        paths.atomic_write_json(artifacts_dir / "engine_benchmark.json", to_dict(speeds), default=str)
        artifacts.append(artifacts_dir / "engine_benchmark.json")
        args = speeds[Role.CHALLENGER].llamacpp_args if Role.CHALLENGER in speeds else []
        if "-md" in args:
            artifacts.append(Path(args[args.index("-md") + 1]))
    return artifacts


# --------------------------------------------------------------------------------------------
# The monitor's decision


def render_outcome(outcome: MonitorOutcome) -> str:
    change, sample = outcome.change, outcome.sample
    lines = [f"target {change.current.fingerprint}" + (
        f" (changed from {change.previous.fingerprint})" if change.changed and change.previous else "")]
    if sample is not None:
        if sample.ok:
            first = sample.first_position_acceptance
            width = getattr(sample, "tree_width", 1)
            shape = (f", at γ={sample.gamma}" + (f" (tree {width})" if width > 1 else "")
                     + (f" on {sample.prompt_split} prompts" if getattr(sample, "prompt_split", "") else "")
                     if sample.source == "replay" else "")
            lines.append((f"first-position acceptance {first:.3f}, " if first is not None else "") +
                         f"acceptance α {sample.acceptance_rate:.3f}, τ {sample.mean_accepted_length or 0:.2f} "
                         f"over {sample.counts.proposed:g} draft tokens ({sample.source}{shape})")
        else:
            lines.append(f"no acceptance sample: {sample.reason}")
        lines += _measured("replay", sample)
    why = outcome.decision_reason
    lines.append(f"decision: **{outcome.decision}**" + (f": {why}" if why else ""))
    fb = outcome.fallback
    if fb:
        lines.append(f"fallback: {fb.mode} — {fb.reason}")
        lines += _measured("fallback bench", fb)
    inc = outcome.incremental
    if inc:
        lines.append(f"incremental distillation: version {inc.registered.version}, gate {'PASS' if inc.verdict.passed else 'FAIL'}"
                     + (f", promoted; serving {inc.serving.mode}" if inc.promoted
                        else ", not promoted: " + ("fallback stays" if outcome.decision == Decision.FALLBACK else "champion stays")))
    if outcome.stage_seconds:
        lines.append(_monitor_stage_times(outcome))
    return "\n\n".join(lines)


def _measured(what: str, measured) -> list[str]:
    """How a replay or the fallback bench ended (settled at 95%, or its time ran out) and its threads."""
    stopped, threads = getattr(measured, "stopped", ""), getattr(measured, "threads", "")
    return [f"{what}: {stopped}" + (f"; threads: {threads}" if threads else "")] if stopped or threads else []


def _monitor_stage_times(outcome: MonitorOutcome) -> str:
    seconds = outcome.stage_seconds
    decided = sum(v for k, v in seconds.items() if k in ("start", "replay", "fallback"))
    budget = f" of a {outcome.deadline_minutes:g}-minute deadline" if outcome.deadline_minutes is not None else ""
    rows = " · ".join(f"{stage} {s / 60:.1f}" for stage, s in seconds.items())
    lines = [f"**stage times** (minutes, {sum(seconds.values()) / 60:.1f} in all; the decision in {decided / 60:.1f}{budget}): {rows}"]
    if outcome.measured_on:
        lines.append(f"measured on: {outcome.measured_on}")
    return "\n".join(lines)
