"""What a benchmark run measured (`BenchResult`, per slice `SliceResult`), how its speeds are summed,
and how it is shown (a text table, a plot), whichever engine measured it (the PyTorch harness or a serving engine).

Speeds: `times[repeat][prompt] = (generated tokens, seconds)` for target-only and for a mode, from
the same interleaved rounds. A speedup is the ratio of summed tokens over summed seconds per repeat,
median over repeats; a prompt's own speedup (`prompt_speedups`, what the serving policy's confidence
bound resamples) is the median over repeats of its speculative over its target-only tokens/s.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import Field

from specdistill import paths
from specdistill.acceptance import DEFAULT_GAMMA
from specdistill.data.record import Record
from specdistill.recipe import Gamma, NewTokens, Repeats, Seed, Strict

# The lossless criterion's near-tie tolerance (fp32 logit margin) that results count divergences by: bf16
# near-ties measured on the demo target were at most 0.29 fp32 logits apart; a token the target does not
# support sits several logits below its top choice.
DEFAULT_TOLERANCE = 0.5


class BenchSettings(Strict):
    """What every benchmark measures, whichever engine runs it. 40 new tokens once per prompt keeps the
    demo's benchmark inside its budget on a 2-core CPU (the `bench` command asks for more repeats)."""

    gamma: Gamma = DEFAULT_GAMMA  # draft tokens per round (an engine's: recorded, it was started with it)
    max_new_tokens: NewTokens = 40
    repeats: Repeats = 1  # interleaved repeats; tokens/s is their median
    seed: Seed = 0
    near_tie_tolerance: float = Field(DEFAULT_TOLERANCE, ge=0.0)  # fp32 logits; reduced-precision greedy runs only


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class SliceResult(Record):
    name: str
    requests: int
    acceptance_rate: float
    accepted_length: float
    tokens_per_second_target_only: float
    tokens_per_second_speculative: float
    speedup: float
    first_position_acceptance: float | None = None  # None: the drafter counts no per-position acceptance


@dataclass
class GammaSearch(Record):
    """How a drafter's γ was chosen (`speculative.gamma.bench_at_best_gamma`): the predicted curve over γ,
    its argmax, the target's verification costs v(k) it was predicted with, and the speedup measured at
    each γ that ran (the benchmark's, and the predicted best's confirmation run when it differs)."""

    predicted_speedups: dict[int, float]
    predicted_best: int | None  # None: no drafting round measured, no γ is better than another
    verify_costs: dict[int, float]
    measured: dict[int, float]


@dataclass
class BenchResult(Record):
    drafter: str
    gamma: int
    max_new_tokens: int
    repeats: int
    greedy: bool
    lossless: bool | None  # no real mismatch; None for sampling runs, where outputs are not the criterion
    lossless_mismatches: int  # prompts with a real mismatch (near-tie divergences are not counted here)
    acceptance_rate: float
    accepted_length: float
    per_position_acceptance: list[float]
    request_acceptance_p10: float
    request_acceptance_p50: float
    request_acceptance_p90: float
    tokens_per_second_target_only: float
    tokens_per_second_speculative: float
    speedup: float
    cost_ratio: float | None
    ideal_speedup: float | None
    slices: list[SliceResult] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    threads: int = 0
    dtype: str = "float32"  # the target's (and the drafts') dtype in this run
    lossless_criterion: str | None = None  # "exact" (fp32 or wider), "near-tie" (reduced precision), None (sampling)
    lossless_exact: int = 0  # prompts whose speculative output equals target-only output
    lossless_near_ties: int = 0  # prompts that part only at near-ties of the fp32 target
    lossless_max_margin: float = 0.0  # the largest fp32 logit margin among the near-tie divergences
    lossless_tolerance: float = 0.0  # the near-tie bound (fp32 logits); 0 for the exact criterion
    engine: str = "harness"  # what measured the speeds: harness (this PyTorch engine), llamacpp, openai
    gamma_search: GammaSearch | None = None  # None: measured at the benchmark's γ only
    tree_width: int = 1  # first-position candidates verified as a tree (EAGLE-3 heads, greedy); 1: a chain
    prompt_speedups: list[float] = field(default_factory=list)  # per prompt, in prompt order (see module docstring)
    budget_note: str = ""  # what a time budget cut from this measurement (empty: nothing)
    spec: str = ""  # the drafter spec a pipeline stage ran (draft_model:DIR, self-spec:K, ngram, ...; `speculative.specs`)

    @property
    def first_position_acceptance(self) -> float:
        """Accepted at draft position 1 / drafting rounds: the red line's quantity (`ops.policy`)."""
        return self.per_position_acceptance[0] if self.per_position_acceptance else 0.0

    # What a serving engine recorded in `stats` (the JSON keeps it there), as the serving choice reads it:
    @property
    def llamacpp_args(self) -> list[str]:
        """The llama-server command line this mode was measured with (engine llamacpp; empty elsewhere)."""
        return list(self.stats.get("llamacpp_args", []))

    @property
    def refused(self) -> str | None:
        """Why the engine would not start this mode (vLLM's own error), or None."""
        return self.stats.get("vllm_refused") or None

    @property
    def engine_version(self) -> str | None:
        return self.stats.get("vllm_version")

    def extra(self) -> dict:
        """benchmark.json carries the red line's quantity beside the per-position list it comes from."""
        return {"first_position_acceptance": self.first_position_acceptance}

    def render(self) -> str:
        c = "n/a" if self.cost_ratio is None else f"{self.cost_ratio:.3f}"
        ideal = "n/a" if self.ideal_speedup is None else f"{self.ideal_speedup:.2f}x"
        lines = [
            f"drafter {self.drafter}   engine {self.engine}   dtype {self.dtype}   gamma {self.gamma}   "
            + (f"tree width {self.tree_width}   " if self.tree_width > 1 else "") +
            f"max_new_tokens {self.max_new_tokens}   "
            f"repeats {self.repeats}   threads {self.threads}",
            f"lossless                          {self.render_lossless()}",
            f"first-position acceptance         {self.first_position_acceptance:.3f}",
            f"acceptance rate α                 {self.acceptance_rate:.3f}",
            f"mean accepted length τ            {self.accepted_length:.3f}",
            "per-position acceptance           " + " ".join(f"{a:.2f}" for a in self.per_position_acceptance),
            f"per-request α p10 / p50 / p90     {self.request_acceptance_p10:.2f} / "
            f"{self.request_acceptance_p50:.2f} / {self.request_acceptance_p90:.2f}",
            f"tokens/s target-only              {self.tokens_per_second_target_only:.2f}",
            f"tokens/s speculative              {self.tokens_per_second_speculative:.2f}",
            f"speedup (median of repeats)       {self.speedup:.2f}x",
            f"cost ratio c                      {c}",
            f"ideal speedup at measured α, c    {ideal}",
        ]
        if len(self.slices) > 1 or (self.slices and self.slices[0].name != "default"):
            w = max(12, *(len(s.name) for s in self.slices))
            lines.append("")
            lines.append(f"{'slice':<{w}} {'n':>4} {'α':>6} {'τ':>6} {'tok/s base':>11} {'tok/s spec':>11} {'speedup':>8}")
            for s in self.slices:
                lines.append(
                    f"{s.name:<{w}} {s.requests:>4} {s.acceptance_rate:>6.3f} {s.accepted_length:>6.2f} "
                    f"{s.tokens_per_second_target_only:>11.2f} {s.tokens_per_second_speculative:>11.2f} {s.speedup:>7.2f}x"
                )
        return "\n".join(lines)

    def render_lossless(self) -> str:
        if self.lossless is None:
            return "n/a (sampling)"
        verdict = "PASS" if self.lossless else "FAIL"
        if self.lossless_criterion is None:  # a result saved before the criterion was recorded
            return verdict if self.lossless else f"{verdict} ({self.lossless_mismatches} outputs differ)"
        if self.lossless_criterion == "near-tie":
            return (f"{verdict} — {self.lossless_exact} exact, {self.lossless_near_ties} near-tie (max margin "
                    f"{self.lossless_max_margin:.3f} ≤ {self.lossless_tolerance:g}), {self.lossless_mismatches} real mismatches")
        return (f"{verdict} — {self.lossless_exact} exact, {self.lossless_mismatches} differ from target-only "
                f"({self.dtype}: exact equality)")

    def plot(self, path: str | Path) -> Path:
        import matplotlib  # lazy: slow to import; only a plot needs it, and every bench record reads this module

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: after the backend is chosen

        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        positions = list(range(1, len(self.per_position_acceptance) + 1))
        left.bar(positions, self.per_position_acceptance, color="tab:blue")
        left.set(xlabel="draft position", ylabel="acceptance", ylim=(0, 1), title=f"acceptance per position (α={self.acceptance_rate:.2f})")
        names = [s.name for s in self.slices] or ["all"]
        speedups = [s.speedup for s in self.slices] or [self.speedup]
        right.bar(names, speedups, color="tab:green")
        right.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        right.set(ylabel="speedup over target-only", title=f"speedup per slice (all: {self.speedup:.2f}x)")
        fig.suptitle(f"{self.drafter}, γ={self.gamma}")
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
        os.close(fd)
        try:  # marked as ours (`check_plot_path`), and renamed into place whole
            fig.savefig(tmp, dpi=100, metadata={"Title": PLOT_MARK})
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        finally:
            plt.close(fig)
            Path(tmp).unlink(missing_ok=True)
        return path


PLOT_MARK = "specdistill bench plot"  # the title every plot bench writes carries, in the file's own metadata
PLOT_FORMATS = (".png", ".pdf", ".svg")  # the formats whose metadata carries it (matplotlib's Title)


def check_plot_path(path: str | Path, *, force: bool = False) -> Path:
    """Where a plot may be written, checked before any work: a new file, or one a bench plot wrote
    (its mark in the file), or anything with `force`; never a directory, never another format."""
    path = Path(path)
    if path.suffix.lower() not in PLOT_FORMATS:
        raise ValueError(f"--plot {path}: write a {', '.join(PLOT_FORMATS)} file (its metadata marks it as a bench plot)")
    if path.is_dir():
        raise ValueError(f"--plot {path} is a directory: name a file")
    if path.exists() and not force and not _is_our_plot(path):
        raise ValueError(f"--plot {path} exists and is not a plot bench wrote: nothing was changed; choose a new file "
                         "(or pass --force to replace it)")
    return path


def _is_our_plot(path: Path, limit: int = 64 << 20) -> bool:
    try:
        return PLOT_MARK.encode() in paths.read_whole(path, "plot", limit)
    except (OSError, ValueError):  # missing, not a regular file (never opened to block), too large: not ours
        return False


def _tps(records: list[tuple[int, float]]) -> float:
    tokens = sum(n for n, _ in records)
    seconds = sum(s for _, s in records)
    return tokens / seconds if seconds > 0 else 0.0


def speed_summary(base_times: list, spec_times: list, indices: list[int]) -> tuple[float, float, float]:
    """Target-only tokens/s, speculative tokens/s and speedup over `indices` (prompts), as the module
    docstring defines them."""
    repeats = range(len(base_times))
    base = [_tps([base_times[r][i] for i in indices]) for r in repeats]
    spec = [_tps([spec_times[r][i] for i in indices]) for r in repeats]
    ratios = [s / b for s, b in zip(spec, base) if b > 0]
    return statistics.median(base), statistics.median(spec), statistics.median(ratios) if ratios else 0.0


def prompt_speedups(base_times: list, spec_times: list) -> list[float]:
    """Each prompt's speedup: the median over repeats of its speculative over its target-only tokens/s."""
    out = []
    for i in range(len(base_times[0]) if base_times else 0):
        ratios = [_tps([s[i]]) / _tps([b[i]]) for b, s in zip(base_times, spec_times) if _tps([b[i]]) > 0]
        out.append(statistics.median(ratios) if ratios else 0.0)
    return out
