"""Policy: every decision taken on measured numbers, in one place (docs/metrics.md has the definitions).

- **the red line**: first-position acceptance (accepted at draft position 1 / drafting rounds) below
  `RED_LINE`. Unlike α = accepted / proposed, which falls as γ grows (a good head at γ=5 shows α ≈ 0.25
  while it gives 1.6x), it does not depend on γ, every engine exposes it (vLLM's
  `..._per_pos{position="0"}` / `num_drafts`) and for a one-token draft it is the seeds' per-token
  acceptance. α at the served γ is reported beside it.
- **the gate**: may a challenger replace the champion (`evaluate`)?
- **the serving choice and its no-slowdown guard** (`fastest_mode`): the fastest lossless mode, written
  only when a lower confidence bound of its per-prompt speedups (a seeded bootstrap over prompts)
  beats target-only by the margin, so a mean carried by a few prompts is not served.
- **the monitor's decision** (`judge_acceptance`): keep, fall back (under the red line), or retrain
  (a relative drop from the champion's own first-position acceptance at registration).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any

from specdistill.data.results import BenchResult

RED_LINE = 0.5  # first-position acceptance below this: the draft is not worth serving
MAX_RELATIVE_DROP = 0.2  # first-position acceptance this far (relatively) under the champion's own at registration: drift
DEFAULT_MARGIN = 0.05  # a mode must beat target-only by more than this to be served
CONFIDENCE = 0.95  # one-sided level of the speedup's lower bound
RESAMPLES = 2000
FIRST_POSITION_TAG = "first_position_acceptance"  # a registered draft version's own, at registration


class Role(StrEnum):
    """What a draft is to a nightly run; its benchmark entry is keyed by its role (draft-free modes by
    their own names: `self-spec@8`, `ngram`)."""

    CHALLENGER = "challenger"  # distilled this run
    CHAMPION = "champion"  # the registry's current best draft (its `champion` alias)
    GENERIC = "generic"  # the off-the-shelf baseline: measured to set a bar (`must_beat`), never served

    @classmethod
    def served(cls, name: str) -> bool:
        """May the entry named `name` be served at all (before the gate has its say)?"""
        return name != cls.GENERIC


def _get(obj: Any, key: str, default: Any = None) -> Any:
    return obj.get(key, default) if isinstance(obj, Mapping) else getattr(obj, key, default)


def first_position(result: Any) -> tuple[float | None, str]:
    """(first-position acceptance, where it came from) of a bench result, sample or their dicts.

    An explicit `first_position_acceptance` wins, then `per_position_acceptance[0]`; a source that
    recorded no per-position counts (an engine without them) gives α in its place, said so."""
    value = _get(result, "first_position_acceptance")
    if value is not None:
        return float(value), "first-position"
    per_position = _get(result, "per_position_acceptance") or []
    if per_position:
        return float(per_position[0]), "first-position"
    alpha = _get(result, "acceptance_rate")
    return (None, "none") if alpha is None else (float(alpha), "α (no per-position counts)")


# --------------------------------------------------------------------------------------------
# The gate


@dataclass
class GateConfig:
    """Defaults are the bar for "worth serving on this hardware": lossless, first-position acceptance
    at the red line, speedup ≥ 1.0, τ no worse than the champion's beyond a tolerance. The production
    profile adds the usual bar for going live: τ ≥ 3 and speedup ≥ 1.5. `min_acceptance_rate` (α at
    the measured γ) is off by default: α falls as γ grows, so it would refuse good long drafts."""

    require_lossless: bool = True
    min_first_position_acceptance: float | None = RED_LINE
    min_acceptance_rate: float | None = None
    min_speedup: float | None = 1.0
    min_accepted_length: float | None = None
    max_accepted_length_drop: float = 0.05  # challenger τ may trail the champion's by at most this (absolute)
    min_accepted_length_gain: float = 0.02  # promotion: challenger τ must exceed the champion's by at least this


PROFILES: dict[str, GateConfig] = {
    "default": GateConfig(),
    "production": GateConfig(min_accepted_length=3.0, min_speedup=1.5),
}


def gate_config(profile: str = "default", **overrides: Any) -> GateConfig:
    if profile not in PROFILES:
        raise ValueError(f"unknown gate profile {profile!r}; choose one of {sorted(PROFILES)}")
    unknown = set(overrides) - set(GateConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown gate setting(s) {sorted(unknown)}; known: {sorted(GateConfig.__dataclass_fields__)}")
    return replace(PROFILES[profile], **overrides)


@dataclass
class Check:
    name: str
    passed: bool
    value: Any
    threshold: Any
    reason: str


@dataclass
class GateVerdict:
    """`passed`: every check holds. `promote`: passed and better than the champion (τ above its τ by at
    least `min_accepted_length_gain`, and strictly above; no champion counts as beaten). A pass that does
    not beat the champion keeps it. It is promoted only on a real improvement, not measurement noise:
    τ 1.34 against 1.33 keeps the champion."""

    passed: bool
    checks: list[Check] = field(default_factory=list)
    champion_accepted_length: float | None = None
    accepted_length: float | None = None
    min_accepted_length_gain: float = 0.0

    @property
    def accepted_length_gain(self) -> float | None:
        if self.champion_accepted_length is None:
            return None
        return self.accepted_length - self.champion_accepted_length

    @property
    def beats_champion(self) -> bool:
        gain = self.accepted_length_gain
        # the tolerance keeps a gain of exactly the margin (τ 1.35 against 1.33, margin 0.02) a promotion
        return gain is None or (gain > 0 and gain >= self.min_accepted_length_gain - 1e-9)

    @property
    def promote(self) -> bool:
        return self.passed and self.beats_champion

    @property
    def reasons(self) -> list[str]:
        reasons = [c.reason for c in self.checks]
        if self.passed and self.champion_accepted_length is not None:
            margin = (f"gain {self.accepted_length_gain:+.3f}, promotion margin "
                      f"min_accepted_length_gain {self.min_accepted_length_gain:.3f}")
            verb, end = ("beats", "the challenger replaces it") if self.beats_champion else ("does not beat", "the champion stays")
            reasons.append(f"accepted length {self.accepted_length:.2f} {verb} the champion's "
                           f"{self.champion_accepted_length:.2f} ({margin}): {end}")
        return reasons

    @property
    def failures(self) -> list[str]:
        return [c.reason for c in self.checks if not c.passed]

    def to_dict(self) -> dict:
        return {"passed": self.passed, "reasons": self.reasons, "failures": self.failures,
                "checks": [asdict(c) for c in self.checks],
                "beats_champion": self.beats_champion, "promote": self.promote}

    def render(self) -> str:
        lines = [f"gate: {'PASS' if self.passed else 'FAIL'}"]
        lines += [f"  [{'ok' if c.passed else 'FAIL'}] {c.reason}" for c in self.checks]
        return "\n".join(lines)


REQUIRED_KEYS = ("lossless", "acceptance_rate", "accepted_length", "speedup")


def _as_mapping(result: Any, what: str) -> Mapping:
    data = result.to_dict() if hasattr(result, "to_dict") else result
    if not isinstance(data, Mapping):
        raise ValueError(f"{what}: expected a benchmark result or its JSON object, got {type(result).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in data]
    if missing:
        raise ValueError(f"{what}: benchmark result lacks {missing}")
    return data


def _lossless_reason(r: Mapping) -> str:
    """Why the lossless check holds or not, by the criterion the benchmark used (bench.py's docstring)."""
    lossless, mismatches = r["lossless"], r.get("lossless_mismatches", "?")
    if r.get("lossless_criterion") == "near-tie":  # reduced precision: judged against the fp32 target
        dtype, tol = r.get("dtype", "reduced precision"), r.get("lossless_tolerance", "?")
        if lossless is True:
            return (f"no real mismatch in {dtype} ({r.get('lossless_exact', '?')} identical to target-only, "
                    f"{r.get('lossless_near_ties', '?')} parting only at fp32 near-ties, max margin "
                    f"{float(r.get('lossless_max_margin', 0.0)):.3f} <= {tol})")
        if lossless is False:
            return (f"{mismatches} outputs with a token the fp32 target trails by more than {tol} logits "
                    f"(real mismatches, {dtype})")
    return {True: "greedy output identical to target-only",
            False: f"{mismatches} outputs differ from target-only",
            None: "no lossless check in this result (sampling run)"}.get(lossless, f"lossless={lossless!r}")


def evaluate(result: Any, config: GateConfig | None = None, champion: Any = None, *,
             baselines: Mapping[str, Any] | None = None, must_beat: Sequence[str] = ()) -> GateVerdict:
    """Judge a benchmark result (BenchResult or its dict); `champion` is the current champion's result.

    `must_beat` names baselines (keys of `baselines`, results on the same prompts) whose first-position
    acceptance the challenger must exceed; a named baseline that was not run this time sets no bar.
    """
    config = config or GateConfig()
    if config.min_accepted_length_gain < 0:
        raise ValueError(f"min_accepted_length_gain must be >= 0, got {config.min_accepted_length_gain}")
    r = _as_mapping(result, "challenger")
    checks: list[Check] = []

    if config.require_lossless:
        ok = r["lossless"] is True
        checks.append(Check("lossless", ok, r["lossless"], True, f"lossless: {_lossless_reason(r)}"))

    def at_least(name: str, value: float, threshold: float | None, fmt: str, note: str = "") -> None:
        if threshold is not None:
            ok = value >= threshold
            checks.append(Check(name, ok, value, threshold,
                                f"{name} {value:{fmt}} {'>=' if ok else '<'} {threshold:{fmt}}{note}"))

    first, source = first_position(r)
    alpha_note = f" (α {float(r['acceptance_rate']):.3f} at γ={r.get('gamma', '?')})"
    if source != "first-position":
        alpha_note = f" ({source})"
    at_least("first-position acceptance", first if first is not None else 0.0, config.min_first_position_acceptance,
             ".3f", alpha_note)
    at_least("acceptance rate", float(r["acceptance_rate"]), config.min_acceptance_rate, ".3f")
    at_least("accepted length", float(r["accepted_length"]), config.min_accepted_length, ".2f")
    at_least("speedup", float(r["speedup"]), config.min_speedup, ".2f")

    champion_tau = None
    if champion is not None:
        c = _as_mapping(champion, "champion")
        champion_tau = float(c["accepted_length"])
        floor = champion_tau - config.max_accepted_length_drop
        value = float(r["accepted_length"])
        ok = value >= floor
        checks.append(Check("accepted length vs champion", ok, value, floor,
                            f"accepted length {value:.2f} vs champion {champion_tau:.2f} "
                            f"(tolerance {config.max_accepted_length_drop:.2f}): {'no worse' if ok else 'worse'}"))

    for name in must_beat:
        if name not in (baselines or {}):
            continue
        mine = first or 0.0
        theirs = first_position(_as_mapping(baselines[name], f"baseline {name!r}"))[0] or 0.0
        ok = mine > theirs
        checks.append(Check(f"beats {name}", ok, mine, theirs,
                            f"first-position acceptance {mine:.3f} {'>' if ok else '<='} {name} {theirs:.3f}"))

    return GateVerdict(all(c.passed for c in checks), checks, champion_accepted_length=champion_tau,
                       accepted_length=float(r["accepted_length"]),
                       min_accepted_length_gain=config.min_accepted_length_gain)


# --------------------------------------------------------------------------------------------
# The serving choice: one no-slowdown guard for the nightly flow and the monitor's fallback


@dataclass
class Candidate:
    """One speculation mode measured against target-only decoding on the same prompts."""
    name: str
    mode: str  # draft | self_speculation | ngram | suffix
    speedup: float
    lossless: bool | None  # None: sampling run, not decidable from outputs
    gamma: int
    draft_dir: str | None = None
    exit_layer: int | None = None
    prompt_speedups: list[float] = field(default_factory=list)  # per held-out prompt, median over repeats


@dataclass
class ServingChoice:
    mode: str  # a serving mode; "off" when nothing beats target-only by the margin with confidence
    candidate: Candidate | None
    reason: str
    margin: float
    speedups: dict[str, float] = field(default_factory=dict)
    lower_bounds: dict[str, float | None] = field(default_factory=dict)  # per candidate, at `confidence`
    confidence: float = CONFIDENCE

    @property
    def lower_bound(self) -> float | None:
        return self.lower_bounds.get(self.candidate.name) if self.candidate else None


def speedup_lower_bound(prompt_speedups: Sequence[float], confidence: float = CONFIDENCE, *,
                        resamples: int = RESAMPLES, seed: int = 0) -> float | None:
    """A one-sided lower bound of the prompts' speedup taken together: the (1 − confidence) quantile of
    their harmonic mean over seeded bootstrap resamples. The harmonic mean is the speedup's own statistic
    (summed tokens over summed seconds) for alike prompts, so one prompt that ran 10x slower pulls the
    bound down as it pulls the speedup. None without per-prompt speeds; one prompt bounds only itself."""
    xs = [float(x) for x in prompt_speedups]
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    rng = random.Random(seed)
    n = len(xs)
    means = sorted(statistics.harmonic_mean([max(x, 0.0) for x in rng.choices(xs, k=n)]) for _ in range(resamples))
    return means[int((1.0 - confidence) * (resamples - 1))]


def fastest_mode(candidates: Sequence[Candidate], margin: float = DEFAULT_MARGIN, *,
                 confidence: float = CONFIDENCE, seed: int = 0) -> ServingChoice:
    """The fastest lossless candidate whose gain holds over the prompts: its measured speedup and the
    lower bound of its per-prompt speedups both above 1 + margin (a candidate measured without per-prompt
    speeds is judged on its speedup alone, and the reason says so). Otherwise speculation is off: serving
    never gets slower than no speculation on the measured prompts."""
    speedups = {c.name: c.speedup for c in candidates}
    bounds = {c.name: speedup_lower_bound(c.prompt_speedups, confidence, seed=seed) for c in candidates}

    def cell(c: Candidate) -> str:
        bound = "" if bounds[c.name] is None else f" (≥{bounds[c.name]:.2f}x at {confidence:.0%})"
        return f"{c.name} {c.speedup:.2f}x{bound}" + (" (lossy)" if c.lossless is False else "")

    table = ", ".join(cell(c) for c in sorted(candidates, key=lambda c: -c.speedup)) or "nothing measured"
    bar = 1.0 + margin
    usable = [c for c in candidates if c.lossless is not False]
    holds = [c for c in usable if c.speedup > bar and (bounds[c.name] is None or bounds[c.name] > bar)]
    best = max(holds, key=lambda c: c.speedup, default=None)
    if best is None:
        fastest = max(usable, key=lambda c: c.speedup, default=None)
        if fastest is None:
            why = "no lossless speculation mode was measured"
        elif fastest.speedup <= bar:
            why = f"the fastest mode, {fastest.name} at {fastest.speedup:.2f}x, does not beat target-only by more than {margin:.0%}"
        else:
            why = (f"no mode's gain holds over the prompts: {fastest.name} measured {fastest.speedup:.2f}x but its "
                   f"{confidence:.0%} lower bound over {len(fastest.prompt_speedups)} prompts is "
                   f"{bounds[fastest.name]:.2f}x, not above {bar:.2f}x")
        return ServingChoice("off", None, f"{why} ({table})", margin, speedups, bounds, confidence)
    bound = bounds[best.name]
    held = ("" if bound is None else
            f", at least {bound:.2f}x with {confidence:.0%} confidence over {len(best.prompt_speedups)} prompts")
    if bound is None:
        held = ", no per-prompt speeds: judged on the measured speedup alone"
    return ServingChoice(best.mode, best, f"{best.name} measured fastest at {best.speedup:.2f}x{held} ({table})",
                         margin, speedups, bounds, confidence)


NOT_SERVED_MODES = ("hybrid",)  # measured, never served: no serving engine runs our draft beside the suffix drafter


def servable(results: Mapping[str, BenchResult], promote: bool) -> dict[str, BenchResult]:
    """The measured entries that may be served: the challenger only when the gate promotes it (then the
    old champion is superseded), the champion otherwise, and every draft-free mode; never a baseline,
    never a mode no serving engine runs (`NOT_SERVED_MODES`)."""
    from specdistill.speculative.specs import DrafterSpec
    superseded = Role.CHAMPION if promote else Role.CHALLENGER
    return {name: r for name, r in results.items() if Role.served(name) and name != superseded
            and not (r.spec and DrafterSpec.parse(r.spec).mode in NOT_SERVED_MODES)}


def unserved_faster_challenger(results: Mapping[str, BenchResult], verdict: GateVerdict, served_speedup: float) -> str:
    """Why a challenger that measured faster than what is served is not served (empty: there is none).

    Only a draft that passed the gate is served: its acceptance bar is the red line the monitor holds in
    production, so a draft below it would be taken back at the monitor's next run."""
    r = results.get(Role.CHALLENGER)
    if r is None or verdict.promote or not r.lossless or r.speedup <= served_speedup:
        return ""
    why = "; ".join(verdict.failures) or "it does not beat the champion"
    return f"the challenger measured faster ({r.speedup:.2f}x) but is not served: it did not pass the gate ({why})"


# --------------------------------------------------------------------------------------------
# The monitor's decision


def judge_acceptance(sample: Any, red_line: float = RED_LINE, *, registered: float | None = None,
                     max_relative_drop: float = MAX_RELATIVE_DROP) -> tuple[str, str]:
    """(decision, why) for a sample of the champion's acceptance (a replay AcceptanceSample, a live
    LiveSample, or their dicts):

    - no-sample: nothing to decide on;
    - fallback: first-position acceptance under the red line: serve the fastest fallback and retrain;
    - retrain: above the line but more than `max_relative_drop` (relatively) under the champion's own
      first-position acceptance at registration (`registered`): the target drifted; keep serving the
      champion and start an incremental run;
    - keep."""
    if not _get(sample, "ok", False):
        return "no-sample", _get(sample, "reason", "") or "no sample"
    first, source = first_position(sample)
    if first is None:
        return "no-sample", "the sample carries no acceptance"
    alpha, gamma = _get(sample, "acceptance_rate"), _get(sample, "gamma")
    at = f"γ={gamma}" if gamma else "the served γ"
    seen = f"{source} acceptance {first:.3f}" + (f" (α {alpha:.3f} at {at})" if alpha is not None and source == "first-position" else "")
    if first < red_line:
        return "fallback", f"{seen} < red line {red_line:.2f}"
    if registered and first < registered * (1.0 - max_relative_drop):
        return "retrain", (f"{seen} is {1 - first / registered:.0%} under the champion's {registered:.3f} at registration "
                           f"(more than {max_relative_drop:.0%}): drift")
    return "keep", f"{seen} >= red line {red_line:.2f}" + (f", champion's at registration {registered:.3f}" if registered else "")


def decide(sample: Any, red_line: float | None = None, **kwargs: Any) -> str:
    """keep | fallback | retrain | no-sample (see `judge_acceptance`)."""
    return judge_acceptance(sample, RED_LINE if red_line is None else red_line, **kwargs)[0]
