"""The benchmark in a real serving engine: target-only and speculative modes, each behind its own
OpenAI-compatible endpoint, interleaved per prompt as the harness's `run_bench_many` does.

Speeds are wall-clock per request (prompt processing included, as the harness times `generate`);
acceptance is Δaccepted / Δdraft tokens of the endpoint's Prometheus counters over the run (vLLM's or
llama.cpp's names), per slice over the counters' deltas around the slice's requests (so τ = 1 +
Δaccepted / Δdrafts per slice too), per-request α from llama.cpp's `timings` where given.

Output equality with target-only is judged on text (greedy). A divergence is a near-tie when, at the
first token where the outputs part, the speculative side's token is within `near_tie_tolerance` (in
logprob = logit difference) of the target-only endpoint's top token, asked of that endpoint with top-k
logprobs; otherwise a real mismatch. Only the first divergence is judged (the harness re-scores every
later token in fp32; an engine's quantized weights have no fp32 to re-score with).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

from pydantic import Field
from tqdm import tqdm

from specdistill.acceptance import DraftCounts
from specdistill.budget import Deadline
from specdistill.data.prompts import Prompt
from specdistill.data.results import BenchResult, BenchSettings, SliceResult, percentile, prompt_speedups, speed_summary
from specdistill.engines.client import (
    Completion,
    EngineRequestError,
    Scrape,
    chat,
    delta,
    metrics_url,
    scrape,
)

TARGET_ONLY = "target-only"
STARTED_SERVER_TIMEOUT_S = 300.0


class EngineBenchConfig(BenchSettings):
    """A serving engine's benchmark: the shared settings (γ: what the endpoints were started with, recorded,
    not set, here), and how the engine is asked."""

    top_logprobs: int = 5  # alternatives asked for when judging a divergence
    # seconds a request may go unanswered: a server started here may compile on its first requests
    timeout_s: float = Field(STARTED_SERVER_TIMEOUT_S, gt=0, le=24 * 3600)


def _messages(prompt: Prompt) -> list[dict]:
    """What an engine is sent: the prompt's chat turns, or its text as one user turn (the engine applies
    the chat template, as the harness does with `encode_chat`)."""
    if prompt.messages:
        return prompt.messages
    if not prompt.text:
        raise ValueError("an engine is sent text: prompts given only as raw token ids cannot be benchmarked there")
    return [{"role": "user", "content": prompt.text}]


@contextlib.contextmanager
def waiting(bar, what: str, timeout_s: float) -> Iterator[None]:
    """While a request is out, the bar says what it waits for and for how long (a stuck server used to
    hold the bench silent for minutes); a request unanswered for `timeout_s` is one sentence saying so."""
    stop = threading.Event()
    began = time.monotonic()

    def tick() -> None:
        while not stop.wait(1.0):
            bar.set_postfix_str(f"waiting for {what}: {time.monotonic() - began:.0f} s of {timeout_s:g} s")

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    except EngineRequestError as exc:
        raise EngineRequestError(f"the bench stopped waiting for {what}: {exc} (--timeout sets the wait)") from None
    finally:
        stop.set()
        ticker.join()
        bar.set_postfix_str("")


def divergence_margin(base_text: str, spec_text: str, reference: Completion) -> float:
    """Logprob gap between the target-only top token and the speculative side's token at the first
    token where the texts part; inf when that token is not among the reference's top-k."""
    common = 0
    while common < min(len(base_text), len(spec_text)) and base_text[common] == spec_text[common]:
        common += 1
    start = 0
    for item in reference.logprobs or []:
        if start + len(item.token) > common:  # the token in which the texts part
            rest = spec_text[start:]
            matches = [lp for tok, lp in item.top.items() if tok and rest.startswith(tok)]
            if not matches:
                return float("inf")
            top = max([item.logprob, *item.top.values()])
            return top - max(matches)
        start += len(item.token)
    return float("inf")  # one output is a prefix of the other: a stop handled differently


def judge(endpoint: str, prompt: Prompt, pairs: set[tuple[str, str]], config: EngineBenchConfig) -> tuple[str, float]:
    """'exact', 'near-tie' or 'mismatch' for one prompt over its distinct (target-only, speculative) outputs."""
    verdict, worst = "exact", 0.0
    reference = None
    for base, spec in pairs:
        if base == spec:
            continue
        if reference is None:
            reference = chat(endpoint, _messages(prompt), max_tokens=config.max_new_tokens, seed=config.seed,
                             top_logprobs=config.top_logprobs, timeout_s=config.timeout_s)
        if reference.text != base:  # the engine is not deterministic on this prompt: nothing to judge by
            return "mismatch", float("inf")
        margin = divergence_margin(base, spec, reference)
        if margin > config.near_tie_tolerance:
            return "mismatch", margin
        verdict, worst = "near-tie", max(worst, margin)
    return verdict, worst


def run_engine_bench(endpoints: dict[str, str], prompts: list[Prompt], config: EngineBenchConfig | None = None, *,
                     engine: str, dtype: str, threads: int = 0, progress: bool = True,
                     deadline: Deadline | None = None) -> dict[str, BenchResult]:
    """`endpoints[TARGET_ONLY]` is the target-only base URL, every other entry a speculative mode's.
    Each mode runs every prompt once per repeat, in an order that rotates from prompt to prompt.

    At `deadline` the bench stops after the prompt in hand (every mode has run it, so the comparison stays
    paired): a first repeat cut short keeps the prompts it finished, a later one is dropped whole; the
    results' `budget_note` says what was cut."""
    config = config or EngineBenchConfig()
    if TARGET_ONLY not in endpoints:
        raise ValueError(f"a speedup needs a target-only endpoint ({TARGET_ONLY!r})")
    if not prompts:
        raise ValueError("no prompts to benchmark")
    bar = tqdm(total=config.repeats * len(prompts), desc=f"bench ({engine})", unit="prompt", file=sys.stderr,
               disable=not progress)
    with contextlib.closing(bar):  # an error leaves no half-drawn bar before its sentence
        return _measure(endpoints, prompts, config, bar, engine=engine, dtype=dtype, threads=threads, deadline=deadline)


def _measure(endpoints: dict[str, str], prompts: list[Prompt], config: EngineBenchConfig, bar, *, engine: str, dtype: str,
             threads: int, deadline: Deadline | None) -> dict[str, BenchResult]:
    modes = list(endpoints)
    spec_modes = [m for m in modes if m != TARGET_ONLY]
    for mode in modes:  # warm-up: first-request allocations
        with waiting(bar, f"the {mode} endpoint's first answer", config.timeout_s):
            chat(endpoints[mode], _messages(prompts[0]), max_tokens=4, seed=config.seed, timeout_s=config.timeout_s)
    with waiting(bar, "the metrics pages", config.timeout_s):
        before = {m: scrape(metrics_url(endpoints[m]), config.timeout_s) for m in spec_modes}
    times = {m: [[None] * len(prompts) for _ in range(config.repeats)] for m in modes}
    per_request: dict[str, list[Completion]] = {m: [None] * len(prompts) for m in spec_modes}
    per_prompt_counts: dict[str, list[Scrape]] = {m: [None] * len(prompts) for m in spec_modes}  # first repeat
    pairs: dict[str, list[set]] = {m: [set() for _ in prompts] for m in spec_modes}
    kept, repeats, note = len(prompts), config.repeats, ""  # what the deadline left measured
    for r in range(config.repeats):
        for i, prompt in enumerate(prompts):
            if (r or i) and deadline is not None and deadline.expired():
                if r == 0:
                    kept, repeats, note = i, 1, f"time budget reached: {i} of {len(prompts)} prompts"
                else:
                    repeats, note = r, f"time budget reached: {r} of {config.repeats} repeats"
                break
            shift = (r + i) % len(modes)
            texts = {}
            for mode in modes[shift:] + modes[:shift]:
                counted = mode != TARGET_ONLY and r == 0
                with waiting(bar, f"the {mode} endpoint (prompt {i + 1})", config.timeout_s):
                    pre = scrape(metrics_url(endpoints[mode]), config.timeout_s) if counted else None  # outside the timing
                    done = chat(endpoints[mode], _messages(prompt), max_tokens=config.max_new_tokens, seed=config.seed,
                                timeout_s=config.timeout_s)
                    texts[mode] = done.text
                    times[mode][r][i] = (done.generated_tokens, done.seconds)
                    if counted:
                        per_request[mode][i] = done
                        per_prompt_counts[mode][i] = delta(pre, scrape(metrics_url(endpoints[mode]), config.timeout_s))
            for mode in spec_modes:
                pairs[mode][i].add((texts[TARGET_ONLY], texts[mode]))
            bar.update(1)
        if note:
            break
    with waiting(bar, "the metrics pages", config.timeout_s):
        counts = {m: delta(before[m], scrape(metrics_url(endpoints[m]), config.timeout_s)) for m in spec_modes}
    bar.close()
    prompts = prompts[:kept]
    times = {m: [row[:kept] for row in rows[:repeats]] for m, rows in times.items()}
    measured = config.model_copy(update={"repeats": repeats})
    results = {}
    for mode in spec_modes:
        verdicts = [judge(endpoints[TARGET_ONLY], p, pairs[mode][i], config) for i, p in enumerate(prompts)]
        results[mode] = replace(_result(mode, prompts, measured, times[TARGET_ONLY], times[mode], per_request[mode][:kept],
                                        counts[mode], per_prompt_counts[mode][:kept], verdicts, engine=engine, dtype=dtype,
                                        threads=threads), budget_note=note)
    return results


def _result(mode: str, prompts: list[Prompt], config: EngineBenchConfig, base_times, spec_times,
            requests: list[Completion], counts: Scrape, per_prompt: list[Scrape], verdicts: list[tuple[str, float]], *,
            engine: str, dtype: str, threads: int) -> BenchResult:
    run = counts.counts
    per_position = run.per_position_acceptance if run.rounds else []
    per_request = [r.accepted / r.draft_tokens for r in requests if r is not None and r.draft_tokens]
    base_tps, spec_tps, speedup = speed_summary(base_times, spec_times, list(range(len(prompts))))
    slices = []
    for name in dict.fromkeys(p.slice for p in prompts):
        idx = [i for i, p in enumerate(prompts) if p.slice == name]
        # the counters' deltas around each of the slice's requests (first repeat): drafts are rounds, so τ too
        st = sum((per_prompt[i].counts for i in idx), DraftCounts())
        b, s, x = speed_summary(base_times, spec_times, idx)
        slices.append(SliceResult(name, len(idx), st.acceptance_rate or 0.0, st.accepted_length or 1.0, b, s, x))
    tags = [v for v, _ in verdicts]
    near_margins = [m for v, m in verdicts if v == "near-tie"]
    return BenchResult(
        drafter=mode, gamma=config.gamma, max_new_tokens=config.max_new_tokens, repeats=config.repeats, greedy=True,
        lossless=tags.count("mismatch") == 0, lossless_mismatches=tags.count("mismatch"),
        acceptance_rate=run.acceptance_rate or 0.0, accepted_length=run.accepted_length or 1.0,
        per_position_acceptance=per_position,
        request_acceptance_p10=percentile(per_request, 0.1), request_acceptance_p50=percentile(per_request, 0.5),
        request_acceptance_p90=percentile(per_request, 0.9),
        tokens_per_second_target_only=base_tps, tokens_per_second_speculative=spec_tps, speedup=speedup,
        cost_ratio=None, ideal_speedup=None, slices=slices,
        stats={"drafts": run.rounds, "draft_tokens": run.proposed, "accepted": run.accepted,
               "metrics_prefix": counts.prefix,
               "timings_draft_tokens": sum(r.draft_tokens or 0 for r in requests if r is not None),
               "timings_accepted": sum(r.accepted or 0 for r in requests if r is not None),
               "engine_tokens_per_second_median": statistics.median(
                   [r.engine_tokens_per_second for r in requests if r is not None and r.engine_tokens_per_second]
                   or [0.0])},
        threads=threads, dtype=dtype, lossless_criterion="near-tie", lossless_exact=tags.count("exact"),
        lossless_near_ties=tags.count("near-tie"), lossless_max_margin=max(near_margins, default=0.0),
        lossless_tolerance=config.near_tie_tolerance, engine=engine, prompt_speedups=prompt_speedups(base_times, spec_times),
    )
