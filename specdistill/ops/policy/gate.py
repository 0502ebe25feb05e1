"""The gate: may a challenger replace the champion? Lossless, first-position acceptance at the red line,
no slowdown, τ no worse than the champion's, and promotion only on a real gain in τ."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from specdistill.data.results import BenchResult
from specdistill.ops.policy.common import MIN_SERVED_PROMPTS, RED_LINE, first_position


@dataclass(frozen=True)
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
    # held-out prompts the challenger was measured on: a verdict from fewer (a benchmark its time budget cut to
    # 4 prompts passed a head at 0.557 whose held-out curve read 0.476) is the mean of a few, not a proof
    min_prompts: int | None = MIN_SERVED_PROMPTS


# every gate default lives here: a profile is a (frozen, shared) GateConfig, and a config only overrides its fields
PROFILES: dict[str, GateConfig] = {
    "default": GateConfig(),
    # the nightly's draft gate: a draft slower than n-gram on a 2-core CPU can still be the best draft for
    # a GPU, so speed is left to the serving choice (`fastest_mode`), not the gate
    "draft": GateConfig(min_speedup=None),
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
    """`promote`: every check holds and τ beats the champion's by at least `min_accepted_length_gain` (no
    champion counts as beaten), so measurement noise never promotes: τ 1.34 against 1.33 keeps the champion."""

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


def _checked(result: Any, what: str) -> BenchResult:
    if not isinstance(result, BenchResult):
        raise ValueError(f"{what}: expected a BenchResult (its JSON read with BenchResult.from_dict), "
                         f"got {type(result).__name__}")
    return result


def _lossless_reason(r: BenchResult) -> str:
    """Why the lossless check holds or not, by the criterion the benchmark used (bench.py's docstring)."""
    lossless, mismatches = r.lossless, r.lossless_mismatches
    if r.lossless_criterion == "near-tie":  # reduced precision: judged against the fp32 target
        dtype, tol = r.dtype, r.lossless_tolerance
        if lossless is True:
            return (f"no real mismatch in {dtype} ({r.lossless_exact} identical to target-only, "
                    f"{r.lossless_near_ties} parting only at fp32 near-ties, max margin "
                    f"{float(r.lossless_max_margin):.3f} <= {tol})")
        if lossless is False:
            return (f"{mismatches} outputs with a token the fp32 target trails by more than {tol} logits "
                    f"(real mismatches, {dtype})")
    return {True: "greedy output identical to target-only",
            False: f"{mismatches} outputs differ from target-only",
            None: "no lossless check in this result (sampling run)"}.get(lossless, f"lossless={lossless!r}")


def evaluate(result: BenchResult, config: GateConfig | None = None, champion: BenchResult | None = None, *,
             baselines: Mapping[str, BenchResult] | None = None, must_beat: Sequence[str] = ()) -> GateVerdict:
    """`must_beat` names baselines (keys of `baselines`, results on the same prompts) whose first-position
    acceptance the challenger must exceed; a named baseline that was not run this time sets no bar."""
    config = config or GateConfig()
    if config.min_accepted_length_gain < 0:
        raise ValueError(f"min_accepted_length_gain must be >= 0, got {config.min_accepted_length_gain}")
    r = _checked(result, "challenger")
    checks: list[Check] = []

    if config.require_lossless:
        ok = r.lossless is True
        checks.append(Check("lossless", ok, r.lossless, True, f"lossless: {_lossless_reason(r)}"))

    def at_least(name: str, value: float, threshold: float | None, fmt: str, note: str = "") -> None:
        if threshold is not None:
            ok = value >= threshold
            checks.append(Check(name, ok, value, threshold,
                                f"{name} {value:{fmt}} {'>=' if ok else '<'} {threshold:{fmt}}{note}"))

    measured = len(r.prompt_speedups)  # 0: a result that does not record its prompts (no check)
    if config.min_prompts is not None and measured:
        ok = measured >= config.min_prompts
        checks.append(Check("held-out prompts", ok, measured, config.min_prompts,
                            f"measured on {measured} held-out prompts {'>=' if ok else '<'} {config.min_prompts}"
                            + ("" if ok else ": too few to judge (more held-out prompts, or a longer benchmark budget)")))

    first, source = first_position(r)
    alpha_note = f" (α {float(r.acceptance_rate):.3f} at γ={r.gamma})" if source == "first-position" else f" ({source})"
    at_least("first-position acceptance", first if first is not None else 0.0, config.min_first_position_acceptance,
             ".3f", alpha_note)
    at_least("acceptance rate", float(r.acceptance_rate), config.min_acceptance_rate, ".3f")
    at_least("accepted length", float(r.accepted_length), config.min_accepted_length, ".2f")
    at_least("speedup", float(r.speedup), config.min_speedup, ".2f")

    champion_tau = None
    if champion is not None:
        champion_tau = float(_checked(champion, "champion").accepted_length)
        floor = champion_tau - config.max_accepted_length_drop
        value = float(r.accepted_length)
        ok = value >= floor
        checks.append(Check("accepted length vs champion", ok, value, floor,
                            f"accepted length {value:.2f} vs champion {champion_tau:.2f} "
                            f"(tolerance {config.max_accepted_length_drop:.2f}): {'no worse' if ok else 'worse'}"))

    for name in must_beat:
        if name not in (baselines or {}):
            continue
        mine = first or 0.0
        theirs = first_position(_checked(baselines[name], f"baseline {name!r}"))[0] or 0.0
        ok = mine > theirs
        checks.append(Check(f"beats {name}", ok, mine, theirs,
                            f"first-position acceptance {mine:.3f} {'>' if ok else '<='} {name} {theirs:.3f}"))

    return GateVerdict(all(c.passed for c in checks), checks, champion_accepted_length=champion_tau,
                       accepted_length=float(r.accepted_length),
                       min_accepted_length_gain=config.min_accepted_length_gain)
