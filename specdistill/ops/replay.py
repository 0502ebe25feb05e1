"""The monitor's replays of logged traffic: the champion's acceptance on recent prompts (`replay_acceptance`,
judged by `policy.decide`), and the fallback mode that measures fastest (`choose_fallback`).

Replayed prompts are what the nightly evaluates on (`data.prompts.usable_prompt`: the turns before the
first answer, ending with a user turn, within `max_prompt_tokens`), taken newest first.

A draft whose vocabulary no longer matches the target (a target update added tokens) is measured through
a transplanted copy (`modeling.drafts.align_draft`, as the pipeline aligns before a warm start): what the
champion really achieves on the new target, with `vocab_mismatch: true`. `on_vocab_mismatch="zero"` gives the
strict reading (acceptance 0.0, reason "vocabulary mismatch": the draft cannot be served as it is).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm
from transformers import PreTrainedModel

from specdistill.acceptance import DEFAULT_GAMMA, NGRAM_WINDOW, DraftCounts
from specdistill.budget import Deadline
from specdistill.data.prompts import MAX_PROMPT_TOKENS, Prompt, usable_prompt
from specdistill.data.record import FLAT, Record
from specdistill.data.results import BenchResult
from specdistill.modeling.models import LoadedModel, resolve_model_dir, shared_model
from specdistill.ops.policy import DEFAULT_MARGIN, MIN_SERVED_PROMPTS, Candidate, fastest_mode
from specdistill.ops.policy.sequential import MIN_REPLAY_PROMPTS, Settled, acceptance_interval, acceptance_settled, beaten, leader_settled
from specdistill.speculative import Drafter, SpecStats, drafter_from_spec, generate
from specdistill.speculative.harness_bench import BenchConfig, run_bench_many
from specdistill.speculative.specs import OFF, SELF_SPEC, DrafterSpec
from specdistill.speculative.suffix_corpus import corpus_is_current


def _loaded(ref: str | os.PathLike | LoadedModel, dtype: str | torch.dtype = "auto",
            device: str | torch.device = "cpu") -> LoadedModel:
    return ref if isinstance(ref, LoadedModel) else shared_model(ref, dtype=dtype, device=device)


def prompts_from_store(store, tokenizer, n: int, *, max_prompt_tokens: int = MAX_PROMPT_TOKENS,
                       split: str | None = None) -> list[Prompt]:
    """The newest `n` logged prompts that fit, as token ids (chat template applied), as the nightly window
    defines them: one over `max_prompt_tokens` is skipped, not truncated (a cut prompt is not what production
    saw). `split`: only that split's ("eval": the held-out prompts no training window draws from).
    Each Prompt's `slice` is "conversation:<id>"."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    out: list[Prompt] = []
    for conv in store.window(limit=max(4 * n, 50), split=split):
        prompt = usable_prompt(conv.messages, tokenizer, max_prompt_tokens)
        if prompt is None:
            continue
        messages, ids = prompt
        out.append(Prompt(messages[-1]["content"], f"conversation:{conv.id}", ids))
        if len(out) == n:
            break
    return out


def held_out_prompts(store, tokenizer, n: int, *, max_prompt_tokens: int = MAX_PROMPT_TOKENS) -> tuple[list[Prompt], str]:
    """(prompts, which): the newest `n` of the eval split, which no nightly window trains on, so a replay reads
    the champion as its gate did (held out) and a suffix corpus of train answers cannot flatter a fallback;
    the newest of all traffic where the store has no usable eval prompt (traffic logged without a split)."""
    prompts = prompts_from_store(store, tokenizer, n, max_prompt_tokens=max_prompt_tokens, split="eval")
    if prompts:
        return prompts, "eval split"
    return prompts_from_store(store, tokenizer, n, max_prompt_tokens=max_prompt_tokens), "newest traffic (no eval split)"


@dataclass
class AcceptanceSample(Record):
    """The champion's acceptance on replayed traffic, or `ok=False` with the reason there is none."""

    ok: bool
    reason: str = ""
    source: str = "replay"
    target_fingerprint: str = ""
    draft_version: str = ""
    gamma: int = DEFAULT_GAMMA
    tree_width: int = 1  # first-position candidates per round (a head measured and served as a tree)
    prompt_split: str = ""  # which logged prompts were replayed (`held_out_prompts`)
    requests: int = 0
    generated_tokens: int = 0
    # the replay's draft counts, per position over its γ; written as their own keys beside the sample's
    counts: DraftCounts = field(default_factory=DraftCounts, metadata=FLAT)
    acceptance_rate: float | None = None  # α at `gamma`, reported beside the red line's quantity
    first_position_acceptance: float | None = None  # accepted at position 1 / rounds: what the red line reads
    mean_accepted_length: float | None = None
    vocab_mismatch: bool = False
    vocab_transplanted: bool = False
    conversation_ids: list[int] = field(default_factory=list)
    sample_ids: list[int] = field(default_factory=list)  # rows in the log store's acceptance_samples
    seconds: float = 0.0
    prompts_available: int = 0  # usable logged prompts it could have read (`requests` of them were)
    stopped: str = ""  # why it read no more: settled at 95%, its time budget, or every prompt read
    threads: str = ""  # the thread count it ran at and why (`speculative.threads.ThreadWatch.describe`)
    interval: list[float] | None = None  # first-position acceptance's 95% interval over the prompts read (prompts resampled)

    @property
    def per_position_acceptance(self) -> list[float]:
        """Accepted at draft position i / rounds, over the replay's γ positions (its JSON keeps the key)."""
        return self.counts.per_position_acceptance

    def extra(self) -> dict:
        return {"per_position_acceptance": self.per_position_acceptance}


def first_accepted(stats: SpecStats) -> int:
    """Rounds whose first draft was accepted: a request's share of first-position acceptance's numerator."""
    return (stats.counts.accepted_per_position or [0])[0]


def replay_acceptance(target_ref: str | os.PathLike | LoadedModel, draft_ref: str | os.PathLike, store, *, n_prompts: int = 16,
                      gamma: int = DEFAULT_GAMMA, max_new_tokens: int = 48, target_version: str | None = None,
                      draft_version: str | None = None, min_draft_tokens: int = 100, max_prompt_tokens: int = MAX_PROMPT_TOKENS,
                      on_vocab_mismatch: str = "transplant", dtype: str = "auto", device: str = "cpu", progress: bool = True,
                      settle_lines: Sequence[float] = (), min_prompts: int = MIN_REPLAY_PROMPTS, deadline: Deadline | None = None,
                      between_prompts: Callable[[], object] | None = None, tree_width: int = 1) -> AcceptanceSample:
    """Replay the newest logged prompts (greedy) with the target and the draft. Every request's counts go to
    the log store under (target fingerprint, draft version); fewer than `min_draft_tokens` proposed tokens is
    "no sample" (ok=False), never an acceptance.

    Up to `n_prompts` are read, newest first. With `settle_lines` (the acceptances the decision turns on)
    it stops once the 95% interval of first-position acceptance lies on one side of each
    (`policy.sequential.acceptance_settled`, from `min_prompts` on); no prompt starts that the longest
    so far says would end past `deadline` once `min_prompts` and `min_draft_tokens` are read. `stopped`
    says which ended it. `between_prompts` runs before each prompt (a thread count chosen again).
    A draft of a kind served as a tree (an EAGLE-3 head) replays at the shape it was measured at: γ drafts a
    round, `tree_width` > 1 a draft tree (greedy), whose first position counts the head's top-1 draft as a
    chain-verifying engine would; any other draft as a chain."""
    if on_vocab_mismatch not in ("transplant", "zero"):
        raise ValueError(f"on_vocab_mismatch must be 'transplant' or 'zero', not {on_vocab_mismatch!r}")
    start = time.perf_counter()
    target = _loaded(target_ref, dtype, device)
    spec = DrafterSpec.for_draft(resolve_model_dir(draft_ref))  # a head loads beside its target, as its kind says
    spec = spec.with_(tree_width=tree_width if spec.of.tree else 1)
    version = draft_version or str(draft_ref)
    sample = AcceptanceSample(False, target_fingerprint=target_version or target.fingerprint, draft_version=version,
                              gamma=gamma, tree_width=spec.tree_width)
    if on_vocab_mismatch == "zero" and (why := spec.of.mismatch(target.model, spec, target.tokenizer)):
        sample.ok, sample.reason, sample.vocab_mismatch = True, f"vocabulary mismatch: {why}", True
        sample.acceptance_rate, sample.mean_accepted_length = 0.0, 1.0
        sample.first_position_acceptance = 0.0
        return sample
    # the target's fingerprint is not enforced: replaying on a new target version is the point
    drafter, why = spec.of.carry(target.model, spec, target.tokenizer)
    drafter.name = f"{version} (transplanted)" if why else version
    sample.vocab_mismatch = sample.vocab_transplanted = bool(why)

    prompts, sample.prompt_split = held_out_prompts(store, target.tokenizer, n_prompts, max_prompt_tokens=max_prompt_tokens)
    if not prompts:
        sample.reason = "no usable prompts in the log store"
        sample.seconds = time.perf_counter() - start
        return sample
    stop = _StopRule(min_prompts, min_draft_tokens, settle_lines, deadline)
    per_request = _replay_prompts(target.model, drafter, prompts, store, sample, stop, max_new_tokens=max_new_tokens,
                                 n_prompts=n_prompts, between_prompts=between_prompts, progress=progress)
    return _acceptance_from(sample, per_request, stop, transplanted=why, start=start)


@dataclass(frozen=True)
class _StopRule:
    """When a replay reads no more prompts: the 95% interval settled against `settle_lines` (none: never), or
    the next prompt would end past `deadline`; neither before `min_prompts` and `min_draft_tokens` are read."""

    min_prompts: int
    min_draft_tokens: int
    settle_lines: Sequence[float] = ()
    deadline: Deadline | None = None

    def out_of_time(self, per_request: list[SpecStats], longest: float) -> bool:
        """Enough is read, and the longest prompt so far says the next would end past the deadline."""
        enough = len(per_request) >= self.min_prompts and sum(s.counts.proposed for s in per_request) >= self.min_draft_tokens
        return enough and self.deadline is not None and self.deadline.remaining() <= longest

    def settled(self, per_request: list[SpecStats]) -> Settled:
        return acceptance_settled([s.counts.rounds for s in per_request], [first_accepted(s) for s in per_request],
                                  self.settle_lines, min_prompts=self.min_prompts)


def _replay_prompts(target: PreTrainedModel, drafter: Drafter, prompts: list[Prompt], store, sample: AcceptanceSample,
                   stop: _StopRule, *, max_new_tokens: int, n_prompts: int, between_prompts: Callable[[], object] | None,
                   progress: bool) -> list[SpecStats]:
    """Each prompt's stats, newest first, until `stop` says no more or every prompt is read: each request
    recorded as it ends (`_replay_one`); `sample.stopped` says why it read no more."""
    per_request: list[SpecStats] = []
    sample.prompts_available, longest, unsettled = len(prompts), 0.0, ""
    for prompt in tqdm(prompts, desc="replay", unit="prompt", file=sys.stderr, disable=not progress):
        if stop.out_of_time(per_request, longest):
            sample.stopped = f"time budget reached after {len(per_request)} of {len(prompts)} prompts{unsettled}"
            break
        if between_prompts is not None:
            between_prompts()
        stats, seconds = _replay_one(target, drafter, prompt, store, sample, max_new_tokens)
        longest = max(longest, seconds)
        per_request.append(stats)
        if stop.settle_lines:
            settled = stop.settled(per_request)
            if settled.settled and sum(s.counts.proposed for s in per_request) >= stop.min_draft_tokens:
                sample.stopped = f"settled after {len(per_request)} of {len(prompts)} prompts: {settled.why}"
                break
            unsettled = f": {settled.why}, not settled" if not settled.settled else ""
    else:
        sample.stopped = f"every usable prompt read ({len(prompts)} of at most {n_prompts}){unsettled}"
    return per_request


def _replay_one(target: PreTrainedModel, drafter: Drafter, prompt: Prompt, store, sample: AcceptanceSample,
                max_new_tokens: int) -> tuple[SpecStats, float]:
    """One prompt decoded (greedy) with the drafter, and the seconds that took; its counts go to the log store under
    the sample's target fingerprint and draft version (and the prompt's conversation), their row kept on the sample."""
    started = time.perf_counter()
    stats = generate(target, prompt.ids, max_new_tokens=max_new_tokens, drafter=drafter, gamma=sample.gamma).stats
    seconds = time.perf_counter() - started
    cid = int(prompt.slice.split(":", 1)[1]) if prompt.slice.startswith("conversation:") else None
    sample.sample_ids.append(store.add_acceptance_sample(sample.target_fingerprint, sample.draft_version, sample.gamma,
                                                         stats.counts.served(sample.gamma), conversation_id=cid))
    if cid is not None:
        sample.conversation_ids.append(cid)
    return stats, seconds


def _acceptance_from(sample: AcceptanceSample, per_request: list[SpecStats], stop: _StopRule, *, transplanted: str,
                     start: float) -> AcceptanceSample:
    """The sample over the requests read: their counts at its γ, first-position acceptance's 95% interval, and the
    acceptance, unless fewer than `min_draft_tokens` were proposed (no sample); `transplanted`: why the draft was."""
    total = SpecStats.total(per_request)
    sample.requests, sample.generated_tokens = total.requests, total.generated_tokens
    sample.counts = total.counts.over(sample.gamma)
    if len(per_request) >= stop.min_prompts:
        bounds = acceptance_interval([s.counts.rounds for s in per_request], [first_accepted(s) for s in per_request])
        sample.interval = list(bounds) if bounds else None
    sample.seconds = time.perf_counter() - start
    if sample.counts.proposed < stop.min_draft_tokens:
        sample.reason = f"only {sample.counts.proposed} draft tokens proposed (minimum {stop.min_draft_tokens})"
        return sample
    sample.ok = True
    sample.acceptance_rate = sample.counts.acceptance_rate
    sample.first_position_acceptance = sample.counts.first_position_acceptance
    sample.mean_accepted_length = sample.counts.accepted_length
    sample.reason = f"vocabulary mismatch, measured through a transplanted copy: {transplanted}" if transplanted else ""
    return sample


@dataclass
class FallbackCandidate(Record):
    mode: str  # self-spec | ngram | suffix
    exit_layer: int | None
    speedup: float
    acceptance_rate: float
    accepted_length: float
    tokens_per_second: float
    tokens_per_second_target_only: float
    generated_tokens: int
    lossless: bool | None
    prompt_speedups: list[float] = field(default_factory=list)  # per sampled prompt (the guard's confidence bound)


@dataclass
class FallbackDecision(Record):
    decided: bool  # False: "no decision" (too few tokens measured); serve as before
    mode: str | None  # self-spec | ngram | suffix | off (None when not decided)
    exit_layer: int | None
    speedup: float | None
    reason: str
    candidates: list[FallbackCandidate] = field(default_factory=list)
    margin: float = DEFAULT_MARGIN
    generated_tokens: int = 0
    suffix_corpus: str | None = None  # the corpus the suffix candidate drafted from (None: not measured)
    prompts: int = 0  # measured (of `prompts_available`)
    prompts_available: int = 0
    stopped: str = ""  # why it measured no more prompts: settled at 95%, its time budget, or every prompt measured
    threads: str = ""  # the thread count it ran at and why (`speculative.threads.ThreadWatch.describe`)

    @property
    def spec(self) -> DrafterSpec | None:
        """The chosen fallback's drafter, one of those `choose_fallback` measures (None: off, or no decision)."""
        if not self.decided or self.mode in (None, OFF):
            return None
        if self.exit_layer is not None:
            return DrafterSpec(SELF_SPEC, str(self.exit_layer))
        return DrafterSpec("suffix", self.suffix_corpus) if self.mode == "suffix" else DrafterSpec("ngram")


def choose_fallback(target_ref: str | os.PathLike | LoadedModel, prompts: Sequence[Prompt], *, exit_layers: Sequence[int] = (4, 8, 12),
                    gamma: int = DEFAULT_GAMMA, max_new_tokens: int = 32, min_tokens: int = 64, repeats: int = 3,
                    margin: float = DEFAULT_MARGIN, suffix_corpus: str | os.PathLike | None = None,
                    min_prompts: int = MIN_SERVED_PROMPTS, progress: bool = True, settle: bool = False,
                    deadline: Deadline | None = None, between_rounds: Callable[[], object] | None = None) -> FallbackDecision:
    """Measure each fallback against target-only decoding on the sampled prompts (interleaved,
    median of repeats, one shared target-only run per prompt) and pick the fastest through the
    no-slowdown guard the nightly uses too (`ops.policy.fastest_mode`): speculation is kept only when
    it beats target-only by more than `margin`; otherwise the mode is "off". `suffix_corpus` adds the suffix
    drafter while the corpus is of this target version (after a target update it is stale, as a draft).

    Prompts are measured in order; with `settle`, only until the 95% bounds settle the choice
    (`policy.sequential.leader_settled`), a mode that can no longer win measured no further (`beaten`), and
    none starts that would end past `deadline` once `min_prompts` are measured
    (`speculative.harness_bench.run_bench_many`). `stopped` says which ended it."""
    if not prompts:
        return FallbackDecision(False, None, None, None, "no decision: no prompts to measure on", margin=margin)
    target = _loaded(target_ref)
    specs, stale = _fallback_specs(target, exit_layers, suffix_corpus)
    drafters = {name: drafter_from_spec(target.model, spec, target_fingerprint=target.fingerprint,
                                        target_tokenizer=target.tokenizer_digest)
                for name, spec in specs.items()}
    config = BenchConfig(gamma=gamma, max_new_tokens=max_new_tokens, repeats=repeats, measure_cost=False)
    results, measured, stopped = _measure_fallbacks(target, drafters, list(prompts), config, margin=margin,
                                                    min_prompts=min_prompts, settle=settle, deadline=deadline,
                                                    between_rounds=between_rounds, progress=progress)
    measured_on = {"prompts": measured, "prompts_available": len(prompts), "stopped": stopped}
    return _fastest_fallback(specs, results, measured_on, gamma=gamma, margin=margin, min_tokens=min_tokens,
                             min_prompts=min_prompts, stale=stale)


def _fallback_specs(target: LoadedModel, exit_layers: Sequence[int],
                    suffix_corpus: str | os.PathLike | None) -> tuple[dict[str, DrafterSpec], str]:
    """The fallbacks measured, by name: self-speculation at each exit layer, prompt lookup, and the suffix drafter
    while its corpus is of this target version; and why the suffix drafter is not measured ("": it is, or no corpus)."""
    n_layers = target.config.num_hidden_layers
    bad = [k for k in exit_layers if not 1 <= k < n_layers]
    if bad:
        raise ValueError(f"exit layers {bad} outside 1..{n_layers - 1}")
    specs = {f"{SELF_SPEC}:{k}": DrafterSpec(SELF_SPEC, str(k)) for k in dict.fromkeys(exit_layers)}
    specs["ngram"] = DrafterSpec("ngram", f"{NGRAM_WINDOW[0]},{NGRAM_WINDOW[1]}")
    current, stale = corpus_is_current(suffix_corpus, target.fingerprint, target.tokenizer_digest) if suffix_corpus else (False, "")
    if current:
        specs["suffix"] = DrafterSpec("suffix", str(suffix_corpus))
    return specs, stale


def _measure_fallbacks(target: LoadedModel, drafters: dict[str, Drafter], prompts: list[Prompt], config: BenchConfig, *,
                       margin: float, min_prompts: int, settle: bool, deadline: Deadline | None,
                       between_rounds: Callable[[], object] | None, progress: bool) -> tuple[dict[str, BenchResult], int, str]:
    """Each fallback against target-only decoding (`run_bench_many`); with `settle`, only until the 95% bounds
    settle the choice (`leader_settled`), a fallback that can no longer win measured no further (`beaten`).
    Returns the results, the prompts measured and why no more were."""
    verdicts, dropped = [], {}

    def settled(speedups: dict[str, list[float]]) -> bool:
        verdicts.append(leader_settled(speedups, margin=margin, min_prompts=min_prompts))
        return verdicts[-1].settled

    def drop(speedups: dict[str, list[float]]) -> set[str]:
        gone = beaten(speedups, margin=margin, min_prompts=min_prompts)
        dropped.update((name, f"{name} measured no further: {why}") for name, why in gone.items())
        return set(gone)

    results = run_bench_many(target.model, target.tokenizer, drafters, prompts, config, progress=progress,
                             deadline=deadline, min_prompts=min_prompts, settled=settled if settle else None,
                             drop=drop if settle else None, between_rounds=between_rounds)
    measured = max(len(r.prompt_speedups) for r in results.values())
    still = {name: r.prompt_speedups for name, r in results.items() if len(r.prompt_speedups) == measured}
    last = verdicts[-1] if verdicts else None
    if settle and (last is None or not last.settled):  # the last prompt measured is not asked about: read it all
        last = leader_settled(still, margin=margin, min_prompts=min_prompts)
    stopped = _why_stopped(last, measured, len(prompts))
    stopped += "".join(f"; {why}" for name, why in dropped.items() if name in drafters and len(results[name].prompt_speedups) < measured)
    return results, measured, stopped


def _why_stopped(last: Settled | None, measured: int, available: int) -> str:
    """Why the fallbacks were measured on `measured` of the `available` prompts: settled, the time budget, or all."""
    if last is not None and last.settled:
        return f"settled after {measured} of {available} prompts: {last.why}"
    why = f": {last.why}, not settled" if last is not None else ""
    return (f"time budget reached after {measured} of {available} prompts{why}" if measured < available
            else f"every prompt measured ({measured}){why}")


def _fastest_fallback(specs: dict[str, DrafterSpec], results: dict[str, BenchResult], measured_on: dict[str, object], *,
                      gamma: int, margin: float, min_tokens: int, min_prompts: int, stale: str) -> FallbackDecision:
    """The fastest fallback through the no-slowdown guard (`ops.policy.fastest_mode`), "off" when none beats
    target-only by more than `margin`; no decision on fewer than `min_tokens` generated."""
    candidates = [FallbackCandidate(spec.mode, spec.exit_layer, result.speedup, result.acceptance_rate, result.accepted_length,
                                    result.tokens_per_second_speculative, result.tokens_per_second_target_only,
                                    int(result.stats["generated_tokens"]), result.lossless, list(result.prompt_speedups))
                  for spec, result in zip(specs.values(), results.values())]
    generated = min(c.generated_tokens for c in candidates)
    if generated < min_tokens:
        return FallbackDecision(False, None, None, None,
                                f"no decision: only {generated} tokens generated (minimum {min_tokens})",
                                candidates, margin, generated, **measured_on)
    choice = fastest_mode([Candidate(name, c.mode, c.speedup, c.lossless, gamma, exit_layer=c.exit_layer,
                                     prompt_speedups=c.prompt_speedups, accepted_length=c.accepted_length)
                           for name, c in zip(specs, candidates)], margin, min_prompts=min_prompts)
    reason, corpus = choice.reason + (f"; suffix drafter not measured: {stale}" if stale else ""), specs.get("suffix")
    corpus = corpus and corpus.corpus
    if choice.candidate is None:
        return FallbackDecision(True, "off", None, 1.0, reason, candidates, margin, generated, corpus, **measured_on)
    best = choice.candidate
    return FallbackDecision(True, best.mode, best.exit_layer, best.speedup, reason, candidates, margin, generated, corpus,
                            **measured_on)
