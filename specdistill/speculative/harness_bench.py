"""Benchmark a drafting method against target-only decoding on a prompt set.

Everything the gate and the reports need comes from one run: acceptance rate α, mean accepted
length τ, per-position acceptance, the spread of per-request acceptance (p10/p50/p90: the long
tail), tokens/s with and without speculation (runs interleaved, median of repeats, on the same
prompts and `max_new_tokens`), the speedup, the measured cost ratio c and the ideal speedup that
α and c predict, overall and per slice (chat, code, ...). The target runs in whatever dtype it was
loaded in (the result names it), and the drafts in the same dtype.

Greedy runs double as the lossless check (`speculative.lossless`: exact in fp32, near-ties within
`near_tie_tolerance` fp32 logits in bf16); a prompt counts once, by the worst of its output pairs.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdistill.acceptance import ideal_speedup
from specdistill.budget import Deadline
from specdistill.data.prompt_files import PromptFileError, PromptRecord, read_prompt_file
from specdistill.data.prompts import Prompt, encode_chat
from specdistill.data.results import BenchResult, BenchSettings, SliceResult, percentile, prompt_speedups, speed_summary
from specdistill.modeling.attention import decode_attention_for
from specdistill.modeling.drafts import measure_cost_ratio
from specdistill.modeling.kv_cache import preallocated_cache
from specdistill.modeling.lean import decode_forward
from specdistill.modeling.models import dtype_name
from specdistill.speculative import (
    Drafter,
    GenerationResult,
    SamplingConfig,
    SpecStats,
    generate,
)
from specdistill.speculative.lossless import LosslessReport, judge_lossless, model_dtype

__all__ = ["BenchConfig", "BenchResult", "Prompt", "PromptFileError", "SliceResult", "encode_prompt", "load_prompts",
           "measure_drafter_cost", "percentile", "prompts_from_records", "run_bench", "run_bench_many", "speed_summary"]


MIN_MEASURED_PROMPTS = 2  # a benchmark cut by its time budget still measures this many prompts (`min_prompts`)


class BenchConfig(BenchSettings):
    temperature: float = 0.0  # greedy by default: the lossless check needs it
    top_p: float = 1.0
    chat_template: bool = True  # wrap each prompt as one user turn when the tokenizer has a template
    measure_cost: bool = True


def load_prompts(path: str | Path) -> list[Prompt]:
    """The first turn of every prompt in a prompt file (`data.prompt_files.read_prompt_file`: plain
    text, `{"prompt", "slice"}` JSONL or Spec-Bench's question.jsonl); errors name the file and line."""
    return [Prompt(record.turns[0], record.slice) for record in read_prompt_file(path, "first")]


def prompts_from_records(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, records: list[PromptRecord],
                         max_new_tokens: int) -> list[Prompt]:
    """One measured prompt per user turn (MT-Bench style replay). Turn i+1 is asked after the target's
    own greedy answer (target-only, up to `max_new_tokens`, in the target's dtype) to turns 1..i, so
    later turns carry the conversation the target itself would have had; the slice is the record's."""
    prompts = []
    for record in records:
        messages: list[dict] = []
        for i, turn in enumerate(record.turns):
            messages.append({"role": "user", "content": turn})
            ids = encode_chat(tokenizer, messages)
            prompts.append(Prompt(turn, record.slice, ids))
            if i + 1 < len(record.turns):
                answer = generate(target, ids, max_new_tokens=max_new_tokens).output_ids
                messages.append({"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)})
    return prompts


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, chat_template: bool = True) -> list[int]:
    if chat_template:
        return encode_chat(tokenizer, [{"role": "user", "content": text}])
    return list(tokenizer(text)["input_ids"])


@torch.inference_mode()
def measure_drafter_cost(target: PreTrainedModel, drafter: Drafter, context: int = 64, repeats: int = 9) -> float:
    """c for any drafter: a model drafter's decode step (via measure_cost_ratio), or an n-gram or
    suffix lookup's proposal time, each over a target decode step; a hybrid's is its model's plus its
    lookup's (an upper bound: in a round the suffix drafter covers, the model drafts nothing)."""
    if (parts := drafter.parts()) != [drafter]:
        return sum(measure_drafter_cost(target, part, context, repeats) for part in parts)
    if (step := drafter.step_module()) is not None:  # a head's proposals need the decoding loop's features: time its step
        module, vocab = step
        return measure_cost_ratio(target, module, draft_vocab=vocab, context=context, repeats=repeats)

    tokens = torch.randint(0, target.config.vocab_size, (context,))
    cache = preallocated_cache(target, 1, context)
    with decode_attention_for(target):
        decode_forward(target, tokens[None, :-1], cache)
        greedy = SamplingConfig()
        ratios = []
        for _ in range(repeats):
            start = time.perf_counter()
            decode_forward(target, tokens[None, -1:], cache, sync=True)
            t = time.perf_counter() - start
            cache.crop(-1)
            start = time.perf_counter()
            drafter.propose(tokens, 1, greedy, None)
            ratios.append((time.perf_counter() - start) / t)
    return statistics.median(ratios)


def run_bench(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    drafter: Drafter,
    prompts: list[Prompt],
    config: BenchConfig | None = None,
    *,
    progress: bool = True,
) -> BenchResult:
    """Run every prompt target-only and speculatively, alternating which goes first, `repeats` times."""
    return run_bench_many(target, tokenizer, {"drafter": drafter}, prompts, config, progress=progress)["drafter"]


def run_bench_many(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    drafters: dict[str, Drafter],
    prompts: list[Prompt],
    config: BenchConfig | None = None,
    *,
    progress: bool = True,
    gammas: dict[str, int] | None = None,
    deadline: Deadline | None = None,
    min_prompts: int = MIN_MEASURED_PROMPTS,
    settled: Callable[[dict[str, list[float]]], bool] | None = None,
    between_rounds: Callable[[], object] | None = None,
    drop: Callable[[dict[str, list[float]]], Collection[str]] | None = None,
) -> dict[str, BenchResult]:
    """Several drafters against one shared target-only run per prompt and repeat; each at its own γ
    where `gammas` names one (else `config.gamma`). No prompt round (nor repeat) starts that the longest
    so far says would end past `deadline`: the results cover the prompts (at least `min_prompts`: what a
    decision on them needs) and whole repeats measured by then. `settled`, asked after each prompt of the
    first repeat from `min_prompts` on with each drafter's per-prompt speedups so far, ends the benchmark
    on those prompts (one repeat) when it answers True: prompts are added only until the decision they
    feed is settled. `between_rounds` runs before each prompt round (a thread count chosen again for the
    load: a round is timed at one setting, so its speedups compare like with like). `drop`, asked just
    before `settled` with one repeat, names drafters that can no longer win: they run on no further
    prompts, and their results cover the prompts they ran on (`settled` then sees the others only).

    For each prompt, target-only and every drafter run back to back, in an order that rotates from
    prompt to prompt and repeat to repeat, so no method always runs first (or right after another).
    Each drafter's speedup is its tokens/s over the target-only tokens/s of the same rounds; sharing
    the baseline saves one target-only run per extra drafter without changing what is compared.
    """
    config = config or BenchConfig()
    if not prompts:
        raise ValueError("no prompts to benchmark")
    if not drafters:
        raise ValueError("no drafters to benchmark")
    sampling = SamplingConfig(config.temperature, config.top_p, config.seed)
    encoded = [list(p.ids) if p.ids is not None else encode_prompt(tokenizer, p.text, config.chat_template) for p in prompts]
    gamma_of = {name: (gammas or {}).get(name, config.gamma) for name in drafters}
    rounds = _Rounds(target, drafters, gamma_of, sampling, config, len(prompts))
    rounds.warm_up(encoded[0][:8])
    bar = tqdm(total=config.repeats * len(prompts), desc="bench", unit="prompt", file=sys.stderr, disable=not progress)
    measured, repeats, done = rounds.measure(encoded, bar, deadline, min_prompts, settled, between_rounds, drop)
    bar.close()
    note = ""
    if measured < len(prompts) or repeats < config.repeats:
        if not done:  # settled early is no budget cut
            note = f"time budget reached: {measured} of {len(prompts)} prompts, {repeats} of {config.repeats} repeats measured"
            bar.write(f"bench: {note}", file=sys.stderr)
        prompts, encoded = prompts[:measured], encoded[:measured]
        rounds.cut(measured, repeats)
        config = config.model_copy(update={"repeats": repeats})
    ran = {name: rounds.dropped_at.get(name, measured) for name in drafters}  # each drafter's prompts: a prefix of them all
    reports = (judge_lossless(target, encoded, {name: seen[:ran[name]] for name, seen in rounds.pairs.items()},
                              config.near_tie_tolerance) if sampling.greedy else {})
    times, first_stats = rounds.times, rounds.first_stats
    return {name: replace(_summarize(target, drafter, prompts[:ran[name]], config.model_copy(update={"gamma": gamma_of[name]}),
                                     sampling, [row[:ran[name]] for row in times[None]], [row[:ran[name]] for row in times[name]],
                                     first_stats[name][:ran[name]], reports.get(name)), budget_note=note)
            for name, drafter in drafters.items()}


class _Rounds:
    """The prompt rounds of one benchmark and what they measured, as `run_bench_many` schedules them.

    `times[mode][repeat][prompt]` = (generated tokens, seconds), mode None being target-only;
    `first_stats[name]`: each drafter's stats in the first repeat; `pairs[name][prompt]`: the distinct
    (target-only, speculative) greedy outputs over the repeats; `active`: the drafters still run;
    `dropped_at[name]`: the prompts a drafter ran on before `drop` named it; `seconds`: each prompt
    round's, from which the deadline is judged."""

    def __init__(self, target: PreTrainedModel, drafters: dict[str, Drafter], gamma_of: dict[str, int],
                 sampling: SamplingConfig, config: BenchConfig, prompts: int):
        self.target, self.drafters, self.gamma_of, self.sampling, self.config = target, drafters, gamma_of, sampling, config
        self.modes: list[str | None] = [None, *drafters]  # None: target-only
        self.times = {m: [[None] * prompts for _ in range(config.repeats)] for m in self.modes}
        self.first_stats = {name: [SpecStats() for _ in range(prompts)] for name in drafters}
        self.pairs: dict[str, list[dict]] = {name: [{} for _ in range(prompts)] for name in drafters}
        self.active, self.dropped_at = list(drafters), {}
        self.seconds: list[float] = []  # per prompt round: none starts that would end past the deadline

    def run(self, ids: list[int], mode: str | None) -> GenerationResult:
        config = self.config
        return generate(self.target, ids, max_new_tokens=config.max_new_tokens,
                        drafter=self.drafters[mode] if mode is not None else None,
                        gamma=self.gamma_of[mode] if mode is not None else config.gamma, sampling=self.sampling)

    def warm_up(self, ids: list[int]) -> None:
        """Every method once on a short prompt: first-call allocations are not timed."""
        for mode in self.modes:
            self.run(ids, mode)

    def measure(self, encoded: list[list[int]], bar: tqdm, deadline: Deadline | None, min_prompts: int,
                settled: Callable[[dict[str, list[float]]], bool] | None, between_rounds: Callable[[], object] | None,
                drop: Callable[[dict[str, list[float]]], Collection[str]] | None) -> tuple[int, int, bool]:
        """The schedule: every repeat over every prompt, until the deadline or `settled` ends it. Returns the
        prompts and repeats measured, and whether `settled` ended it."""
        config, seconds = self.config, self.seconds
        measured, repeats, done = len(encoded), config.repeats, False
        for r in range(config.repeats):
            if r > 0 and deadline is not None and deadline.remaining() <= sum(seconds[-len(encoded):]):
                repeats = r
                break
            for i, ids in enumerate(encoded):
                if r == 0 and i >= min_prompts and deadline is not None and deadline.remaining() <= max(seconds, default=0.0):
                    measured = i
                    break
                if between_rounds is not None:
                    between_rounds()
                self.prompt_round(r, i, ids)
                bar.update(1)
                if (r == 0 and (settled or drop) and i + 1 >= min_prompts and i + 1 < len(encoded)
                        and self.drop_and_settle(i + 1, settled, drop)):
                    measured, done = i + 1, True
                    break
            if measured < len(encoded):  # cut in the first repeat: `measured` prompts, one repeat
                repeats = 1
                break
        return measured, repeats, done

    def prompt_round(self, r: int, i: int, ids: list[int]) -> None:
        """Target-only and every active drafter on prompt `i` of repeat `r`, back to back, in an order that
        rotates from prompt to prompt and repeat to repeat."""
        started = time.perf_counter()
        running = [None, *self.active]
        shift = (r + i) % len(running)
        outputs = {}
        for mode in running[shift:] + running[:shift]:
            result = self.run(ids, mode)
            outputs[mode] = result.output_ids
            self.times[mode][r][i] = (result.stats.generated_tokens, result.stats.seconds)
            if mode is not None and r == 0:
                self.first_stats[mode][i] = result.stats
        if self.sampling.greedy:
            for name in self.active:
                self.pairs[name][i][(tuple(outputs[None]), tuple(outputs[name]))] = None
        self.seconds.append(time.perf_counter() - started)

    def drop_and_settle(self, prompts: int, settled: Callable[[dict[str, list[float]]], bool] | None,
                        drop: Callable[[dict[str, list[float]]], Collection[str]] | None) -> bool:
        """After the first `prompts` of the first repeat: stop running the drafters `drop` names (one at least
        stays), then whether `settled` says the decision on the others is made."""
        times = self.times
        so_far = {name: prompt_speedups([times[None][0][:prompts]], [times[name][0][:prompts]]) for name in self.active}
        gone = set(drop(so_far)) & set(self.active) if drop is not None and self.config.repeats == 1 else set()
        if gone and len(gone) < len(self.active):  # one drafter at least stays measured
            self.dropped_at.update((name, prompts) for name in gone)
            self.active = [name for name in self.active if name not in gone]
            so_far = {name: so_far[name] for name in self.active}
        return settled is not None and settled(so_far)

    def cut(self, measured: int, repeats: int) -> None:
        """Keep the first `measured` prompts of the first `repeats` repeats: what a budget cut or `settled` left."""
        self.times = {m: [row[:measured] for row in rows[:repeats]] for m, rows in self.times.items()}
        self.first_stats = {name: stats[:measured] for name, stats in self.first_stats.items()}
        self.pairs = {name: seen[:measured] for name, seen in self.pairs.items()}


def _summarize(target, drafter: Drafter, prompts: list[Prompt], config: BenchConfig, sampling: SamplingConfig,
               base_times: list, spec_times: list, first_stats: list[SpecStats], report: LosslessReport | None) -> BenchResult:
    summed = SpecStats.total(first_stats)
    total = summed.counts
    base_tps, spec_tps, speedup = speed_summary(base_times, spec_times, list(range(len(prompts))))
    slices = []
    for name in dict.fromkeys(p.slice for p in prompts):
        idx = [i for i, p in enumerate(prompts) if p.slice == name]
        st = SpecStats.total(first_stats[i] for i in idx).counts
        b, s, x = speed_summary(base_times, spec_times, idx)
        slices.append(SliceResult(name, len(idx), st.acceptance_rate or 0.0, st.accepted_length or 1.0, b, s, x,
                                  st.first_position_acceptance))
    per_request = [s.counts.acceptance_rate for s in first_stats if s.counts.proposed]
    alpha = total.acceptance_rate or 0.0  # a drafter that proposed nothing: α 0.0, τ 1.0 (as target-only)
    cost = measure_drafter_cost(target, drafter) if config.measure_cost else None
    ideal = ideal_speedup(alpha, config.gamma, cost) if cost is not None else None
    return BenchResult(
        drafter=drafter.name,
        gamma=config.gamma,
        max_new_tokens=config.max_new_tokens,
        repeats=config.repeats,
        greedy=sampling.greedy,
        lossless=report.passed if report is not None else None,
        lossless_mismatches=report.mismatches if report is not None else 0,
        acceptance_rate=alpha,
        accepted_length=total.accepted_length or 1.0,
        per_position_acceptance=total.per_position_acceptance,
        request_acceptance_p10=percentile(per_request, 0.1),
        request_acceptance_p50=percentile(per_request, 0.5),
        request_acceptance_p90=percentile(per_request, 0.9),
        tokens_per_second_target_only=base_tps,
        tokens_per_second_speculative=spec_tps,
        speedup=speedup,
        cost_ratio=cost,
        ideal_speedup=ideal,
        slices=slices,
        stats=summed.to_dict(),
        threads=torch.get_num_threads(),
        dtype=dtype_name(model_dtype(target)),
        lossless_criterion=report.criterion if report is not None else None,
        lossless_exact=report.exact if report is not None else 0,
        lossless_near_ties=report.near_ties if report is not None else 0,
        lossless_max_margin=report.max_near_tie_margin if report is not None else 0.0,
        lossless_tolerance=report.tolerance if report is not None else 0.0,
        tree_width=drafter.tree_width if sampling.greedy else 1,
        prompt_speedups=prompt_speedups(base_times, spec_times),
    )
