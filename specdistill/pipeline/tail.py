"""The nightly's tail: what a run reserves from its start so that a draft it trains is always measured and gated.

A second night beside a busy neighbour once spent its deadline on answers and training, then stopped at the
generic baseline with 3 s left: it had trained a head and threw it away unmeasured. So the run reserves its
tail first: the smallest benchmark the gate and the serving choice can decide on (the challenger, and the
champion where there is one, on the prompts a decision needs), sized from the decode speed measured at the
start, never under `MIN_TAIL_MINUTES`; the gate, registration and the serving config have `CLOSING_MINUTES`
inside `run_deadline` already. The stages before it (the train answers, the training, the generic baseline)
share only what that leaves (`TailReserve.cut`), and optional work is dropped first when time is short: the
generic baseline when the run cannot give it half its budget, the benchmark's extra drafters that no longer
fit (`fit_drafters`), the γ search (`stages.bench`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdistill.data.prompts import encode_chat
from specdistill.data.record import Record
from specdistill.modeling.models import shared_model
from specdistill.ops.policy import Role
from specdistill.pipeline.nightly_recipe import NightlyConfig, target_tokenizer
from specdistill.pipeline.outputs import Untrained, Window
from specdistill.pipeline.stage_budgets import stage_budgets, stage_deadline
from specdistill.speculative.decode import generate
from specdistill.speculative.specs import SELF_SPEC, DrafterSpec
from specdistill.speculative.threads import ThreadChoice, ThreadWatch

TAIL_STAGES = ("benchmark", "engine benchmark")  # what the reserve keeps time for; the stages before share the rest
MIN_TAIL_MINUTES = 0.5  # the reserve's floor: a measurement can be taken on a moment the neighbour was idle
# a drafter's run on a prompt against target-only's run of it: self-speculation measured 0.43x (2.3), the generic
# layer draft 0.67-0.88x (1.1-1.5), the head, suffix and n-gram 1.2-1.7x (under 1)
SPECULATIVE_RUN = 1.5
BENCH_OVERHEAD_S = 10.0  # loading the drafts, each mode's warm-up run, the lossless check's fp32 re-scoring
OPTIONAL_SHARE = 0.5  # optional training (the generic baseline) runs only when the run can give it this share of its budget
PROBE_TOKENS = 16  # decoded to time target-only when no thread probe times it
PROBE_PROMPT_TOKENS = 64  # the decode speed is timed after a short prompt: decoding, not a long prefill


@dataclass
class TailReserve(Record):
    """The seconds kept before the run's deadline for the minimal benchmark, and what they were sized from."""

    seconds: float = 0.0  # 0: no deadline, nothing reserved
    tokens_per_second: float | None = None  # target-only greedy decoding, measured at the run's start
    drafters: int = 1  # drafters the minimal benchmark measures: the challenger (and the champion)
    prompts: int = 0
    threads: str = ""  # the thread count the decode speed was measured at, and why
    cuts: list[str] = field(default_factory=list)  # the stages whose share the reserve cut, for the report

    def cut(self, config: NightlyConfig, stage: str, deadline_at: float | None, now: float | None = None) -> float | None:
        """The run's deadline as `stage` (one before the benchmark) is to share it: unchanged while the benchmark's
        own proportional share covers the reserve, else moved earlier so that the stages before the benchmark
        share, in proportion to their budgets, only what the reserve leaves."""
        if deadline_at is None or self.seconds <= 0:
            return deadline_at
        now = time.time() if now is None else now
        cut_at = now + max(0.0, front_seconds(config, stage, deadline_at - now, self.seconds))
        before, after = (stage_deadline(config, stage, at, now=now).minutes(now) for at in (deadline_at, cut_at))
        if before is not None and after is not None and after < before - 1 / 60:
            self.cuts.append(f"{stage}: {after:.1f} minutes, its share cut from {before:.1f} to keep the tail's "
                             f"{self.seconds / 60:.1f}")
        return cut_at

    def leaves_nothing(self, deadline_at: float | None, now: float | None = None) -> Untrained | None:
        """Why the night cannot train (None: it can): the reserve leaves no time before it for answers and training."""
        now = time.time() if now is None else now
        if deadline_at is None or deadline_at - self.seconds > now:
            return None
        return Untrained(f"the run's deadline leaves {max(0.0, deadline_at - now) / 60:.1f} minutes, no more than the "
                         f"{self.seconds / 60:.1f} its tail needs: no time to answer or train; the champion and "
                         "serving.json are unchanged")

    def describe(self) -> str:
        if self.seconds <= 0:
            return ""
        speed = (f"target-only at {self.tokens_per_second:.1f} tokens/s, {self.threads}" if self.tokens_per_second
                 else "no decode speed measured")
        what = "the challenger and the champion" if self.drafters > 1 else "the challenger"
        return (f"reserved for the tail: {self.seconds / 60:.1f} minutes before the closing stages for a benchmark of "
                f"{what} on {self.prompts} held-out prompts ({speed}; at least {MIN_TAIL_MINUTES:g})")


def front_seconds(config: NightlyConfig, stage: str, left: float, reserve: float) -> float:
    """The seconds of the `left` that the stages from `stage` to the benchmark may share, counted so that their
    proportional shares (`stage_budgets.stage_deadline`) are at most what they would be of `left` less the reserve
    among themselves alone."""
    budgets = stage_budgets(config)
    later = list(budgets)[list(budgets).index(stage):]
    front = sum(budgets[s] for s in later if s not in TAIL_STAGES and budgets[s] is not None)
    every = sum(budgets[s] for s in later if budgets[s] is not None)
    left = max(0.0, left)
    if budgets[stage] is None or front <= 0:
        return left - reserve
    return min(left, (left - reserve) * every / front)


def minimal_bench_seconds(config: NightlyConfig, tokens_per_second: float, drafters: int) -> float:
    """A benchmark's time for `drafters` beside target-only on the prompts a decision needs, each run
    `bench.max_new_tokens` long (prompts are measured whole, each mode warmed up on one)."""
    prompts = needed_prompts(config)
    runs = 1 + SPECULATIVE_RUN * drafters
    return BENCH_OVERHEAD_S + (prompts + 1) * runs * config.bench.max_new_tokens / max(tokens_per_second, 1e-3)


def needed_prompts(config: NightlyConfig) -> int:
    """The prompts the gate and the serving choice need, which the benchmark measures past its deadline."""
    return max(config.serving.min_prompts, config.gate.gate_config().min_prompts or 0)


def tail_reserve(config: NightlyConfig, tokens_per_second: float | None, *, champion: bool, threads: str = "") -> TailReserve:
    """The reserve of a run with a deadline: the minimal benchmark at the measured decode speed, at least
    `MIN_TAIL_MINUTES`; none without a deadline."""
    drafters = 2 if champion else 1
    if config.deadline_minutes is None:
        return TailReserve(drafters=drafters)
    sized = minimal_bench_seconds(config, tokens_per_second, drafters) if tokens_per_second else 0.0
    return TailReserve(max(60.0 * MIN_TAIL_MINUTES, sized), tokens_per_second, drafters, needed_prompts(config), threads)


def optional_priority(name: str, spec: DrafterSpec) -> int:
    """The order the benchmark's optional entries are kept in when time is short: the draft-free modes that are
    served most (suffix, n-gram), self-speculation, the gate's generic baseline, the hybrid (measured only)."""
    if name == Role.GENERIC:
        return 2
    if spec.kind in ("suffix", "ngram"):
        return 0
    return 1 if spec.kind == SELF_SPEC else 3


def fit_drafters(config: NightlyConfig, drafters: dict[str, DrafterSpec], seconds: float,
                 tokens_per_second: float) -> tuple[list[str], list[str]]:
    """The entries to benchmark in `seconds`, and those skipped: the challenger and the champion always (a night
    that trained a draft measures it, beside the champion the gate compares it with), then the optional ones in
    `optional_priority` while the minimal benchmark of all kept still fits."""
    required = [n for n in drafters if n in (Role.CHALLENGER, Role.CHAMPION)]
    optional = sorted((n for n in drafters if n not in required), key=lambda n: optional_priority(n, drafters[n]))
    kept, skipped = list(required), []
    for name in optional:
        fits = minimal_bench_seconds(config, tokens_per_second, len(kept) + 1) <= seconds
        (kept if fits else skipped).append(name)
    return [n for n in drafters if n in kept], skipped


def measure_decode(model: torch.nn.Module, prompt_ids: Sequence[int], threads: int | str | None) -> tuple[float, str]:
    """Target-only greedy tokens/s now, at the threads the benchmark runs at: `auto` probes them for the load
    found (`speculative.threads.ThreadWatch`, torch's count put back after) and takes the fastest; a number (or
    None: torch's own) is timed as it is."""
    ids = list(prompt_ids)[-PROBE_PROMPT_TOKENS:]
    if threads == "auto":
        with ThreadWatch(model, ids) as watch:
            choice = watch.choices[0]
            if choice.tokens_per_second:
                return max(choice.tokens_per_second.values()), choice.describe()
            return _timed(model, ids), choice.describe()
    before = torch.get_num_threads()
    try:
        if isinstance(threads, int):
            torch.set_num_threads(threads)
        return _timed(model, ids), ThreadChoice(torch.get_num_threads()).describe()
    finally:
        torch.set_num_threads(before)


def _timed(model: torch.nn.Module, ids: list[int]) -> float:
    generate(model, ids, max_new_tokens=2, stop_token_ids=())  # first-call allocations outside the timing
    started = time.perf_counter()
    generate(model, ids, max_new_tokens=PROBE_TOKENS, stop_token_ids=())  # never cut short by a stop token
    return PROBE_TOKENS / (time.perf_counter() - started)


def reserve_tail(config: NightlyConfig, window: Window, *, champion: bool) -> TailReserve:
    """The run's tail reserve (`tail_reserve`), its decode speed measured on the first held-out prompt; nothing is
    measured without a deadline."""
    if config.deadline_minutes is None or not window.eval:
        return tail_reserve(config, None, champion=champion)
    target = shared_model(config.target, dtype=config.dtype, device=config.device)
    ids = encode_chat(target_tokenizer(config), window.eval[0].messages)
    rate, threads = measure_decode(target.model, ids, config.bench.threads)
    return tail_reserve(config, rate, champion=champion, threads=threads)


def skipped_note(skipped: Sequence[str], seconds: float, tokens_per_second: float) -> str:
    return (f"not measured, the run's deadline leaving the benchmark {seconds / 60:.1f} minutes at "
            f"{tokens_per_second:.1f} target tokens/s: {', '.join(skipped)}")
