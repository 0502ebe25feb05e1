"""Stage: which engine answers the night's prompts (`generation.backend: auto`), measured on this machine.

Which engine answers fastest is a fact about the machine, not a setting: on the 2-core AVX-512 BF16 CPU the
harness answered 257.7 tokens/s in bf16 and 85.7 in fp32, llama.cpp's Q4_1 147.9 (`benchmarks/experiments/answer_generation.py`),
so a CPU without native bf16 may answer faster through llama.cpp. The probe answers the same first train
prompts (one batch, `generation.max_new_tokens` new tokens each, as the stage asks) in every engine at hand, recording the teacher as the
stage does; for an EAGLE-3 head an engine's answers also cost the harness's teacher-forced feature pass over
them (the trainer runs it; the harness records features while it answers), so that pass is timed and counted.
It reads each prompt again, so its share falls as answers grow: the probe answers at the stage's length
(at 32 tokens instead of 96 the pass took longer than llama.cpp's answers on AVX2 kernels).
The fastest wins. The measurement is kept per target, machine and candidates with the conditions it was taken
under (`hardware.MeasuredUnder`: other work on the cores, date, candidates), so a resumed run, the held-out answers
and the next nights answer with the same engine without measuring again, until the load moves by
`remeasure.load_shift` cores, `remeasure.max_runs` runs or `remeasure.max_days` days pass, or the stage
dropped it for a rate that collapsed (`rate_watch`): then it is measured again.

Each engine is probed at the shape and threads the stage runs it with, under the load found: the harness
on one batch of the stage's batch size (`answer_batch`) at the thread count `speculative.threads` finds
fastest now; llama-server on the same prompts over its slots, at the fastest of its thread counts and
`--poll` settings on a short round (beside a busy core two spinning threads wait for each other). On the
AVX2 EPYC beside a nice-10 neighbour a 2-thread harness probe read 9.8 tokens/s (88.6 quiet) and lost to
llama.cpp's 37.9, which then collapsed in the stage: a choice that collapses beside a neighbour is not the
faster engine.

Candidates: the harness in the run's dtype (bf16 where the hardware has it: the dtype is the run's, not the
engine's); llama.cpp's llama-server on the target's GGUF when it is built (`make llama-server`: minutes,
never started from here) and the target is one it serves. vLLM's CPU build answered slower than both
(104.5 tokens/s) and takes ~90 s to start, so it is named, not probed.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdistill import hardware, paths
from specdistill.data.prompts import Prompt, encode_chat
from specdistill.data.record import Record
from specdistill.distill.distill_recipe import Eagle3Config
from specdistill.distill.examples import encode_generated
from specdistill.distill.features import FeatureCache, build_feature_cache
from specdistill.distill.teacher import TeacherCache
from specdistill.engines.llamacpp import build
from specdistill.engines.llamacpp.engine import gguf_dtype, target_server
from specdistill.modeling.eagle3 import default_aux_layers
from specdistill.modeling.models import LoadedModel, dtype_name
from specdistill.pipeline.nightly_recipe import NightlyConfig, config_hash, run_root
from specdistill.pipeline.stages.answers.engine_client import complete_ids, connect, generate_answers_openai
from specdistill.pipeline.stages.answers.harness import answer_batch, answer_threads, generate_answers
from specdistill.speculative.threads import thread_candidates, usable_cores

HARNESS, LLAMACPP = "harness", "llamacpp"
LLAMACPP_POLL = (50, 0)  # llama.cpp's default polling, and none: its threads sleep while they wait
THREAD_ROUND_TOKENS = 16  # per request of the short round that picks llama-server's threads and polling


@dataclass
class EngineSpeed(Record):
    engine: str  # "harness bfloat16", "llamacpp Q4_1"
    tokens: int  # answer tokens the probe got
    answer_s: float
    features_s: float = 0.0  # an engine's answers: the harness's feature pass over them (EAGLE-3)
    threads: str = ""  # what it ran at, chosen under the load found ("1 thread", "2 threads, poll 0")
    thread_count: int | None = None  # llama-server's -t and --poll as chosen (None: the harness, or the default)
    poll: int | None = None

    @property
    def tokens_per_s(self) -> float:
        seconds = self.answer_s + self.features_s
        return self.tokens / seconds if seconds > 0 else 0.0

    def extra(self) -> dict:
        return {"tokens_per_s": round(self.tokens_per_s, 2)}


@dataclass
class AnswerEngine(Record):
    """What answers (`backend`: harness or openai with `engine`), the speeds it was chosen by, and why."""

    backend: str
    engine: str | None
    speeds: list[EngineSpeed] = field(default_factory=list)
    not_probed: list[str] = field(default_factory=list)  # engines not at hand, and why
    measured_at: float = 0.0
    measured_under: hardware.MeasuredUnder | None = None  # None: kept by a version that did not record it
    remeasured: str = ""  # why this run measured again instead of reusing the kept choice
    superseded: str = ""  # a running stage dropped it (its live rate collapsed): the next run measures again
    llamacpp_threads: int | None = None  # llama-server's threads and --poll, as its probe chose them
    llamacpp_poll: int | None = None

    def speed_of(self, engine: str) -> float | None:
        """The probe's answer tokens/s of `engine` (harness, llamacpp); None when it was not probed."""
        return next((s.tokens_per_s for s in self.speeds if s.engine.split()[0] == engine), None)

    def summary(self) -> str:
        """One line for the report: each engine's answer tokens/s with the teacher, the choice, what was not probed."""
        chosen = HARNESS if self.backend == HARNESS else self.engine
        notes = "".join(f"; {note}" for note in self.not_probed)
        if not self.speeds:
            return f"**answer engine:** {chosen}, the only one at hand{notes}"
        speeds = ", ".join(f"{s.engine} {s.tokens_per_s:.1f}" + "".join(f" ({x})" for x in (
            s.threads, f"features {s.features_s:.1f} s" if s.features_s else "") if x) for s in self.speeds)
        under = f"; {self.measured_under.describe()}" if self.measured_under else ""
        again = f"; measured again: {self.remeasured}" if self.remeasured else ""
        return f"**answer engine:** {chosen} (answer tokens/s with the teacher, one probe batch: {speeds}){notes}{under}{again}"

    def apply(self, config: NightlyConfig) -> NightlyConfig:
        g = {"backend": self.backend, **({"engine": self.engine} if self.engine else {})}
        return config.model_copy(update={"generation": config.generation.model_copy(update=g)})


def candidates(config: NightlyConfig) -> tuple[list[str], list[str]]:
    """The engines at hand for this target, and a note for each that is not."""
    found, missing = [HARNESS], []
    if not (config.target == "demo" or config.target.endswith(".gguf")):
        missing.append("llama.cpp not probed: the target is no GGUF (a server at generation.url is set by hand)")
    elif config.device.startswith("cuda"):
        missing.append("llama.cpp not probed: the run's device is a GPU")
    elif build.cached() is None:
        missing.append("llama.cpp not built (`make llama-server`, ~15 minutes on 2 cores)")
    else:
        found.append(LLAMACPP)
    return found, missing


def choice_path(config: NightlyConfig, target: LoadedModel, found: list[str]):
    key = config_hash([config.target, target.fingerprint, hardware.describe_device(config.device), config.dtype, config.device,
                       found, config.train.kind, config.generation.teacher_top_k, config.serving.threads])
    return run_root() / "answer-engine" / f"{key}.json"


def choose_answer_engine(config: NightlyConfig, target: LoadedModel, prompts: list[Prompt], *, recheck: bool = True,
                         others_busy: float | None = None) -> AnswerEngine:
    """The engine the night's answers come from: the kept measurement for this target, machine and candidates
    while its conditions hold (`recheck=False`, the held-out answers: as kept), else a probe of each candidate
    on the first `answer_batch` prompts. `others_busy`: the other work on the cores now (None: read here)."""
    found, missing = candidates(config)
    path = choice_path(config, target, found)
    kept = AnswerEngine.from_dict(paths.read_json(path, "answer-engine measurement")) if path.is_file() else None
    if kept is not None and not recheck:
        return kept
    r = config.remeasure
    busy = hardware.others_busy() if others_busy is None else others_busy
    why = ""
    if kept is not None:
        under = kept.measured_under
        why = kept.superseded or ("kept without the conditions it was measured under" if under is None else
                                  under.stale(busy, found, load_shift=r.load_shift, max_uses=r.max_runs, max_days=r.max_days))
        if not why:
            under.uses += 1
            kept.remeasured = ""
            paths.atomic_write_json(path, kept.to_dict())
            return kept
    under = hardware.MeasuredUnder(busy, time.time(), list(found))
    if len(found) == 1 or not prompts:
        choice = AnswerEngine(HARNESS, None, [], missing, time.time(), under, why or "")
    else:
        batch = prompts[:answer_batch(config, target)]
        speeds = [probe_harness(config, target, batch)]
        threads = poll = None
        try:
            llama = probe_llamacpp(config, target, batch)
            speeds.append(llama)
            threads, poll = llama.thread_count, llama.poll
        except Exception as exc:  # noqa: BLE001 (the harness answers; the report says why llama.cpp did not)
            missing.append(f"llama.cpp probe failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
        best = max(speeds, key=lambda s: s.tokens_per_s)
        choice = AnswerEngine(HARNESS if best is speeds[0] else "openai", None if best is speeds[0] else LLAMACPP,
                              speeds, missing, time.time(), under, why, "", threads, poll)
    paths.atomic_write_json(path, choice.to_dict())
    return choice


def supersede(config: NightlyConfig, target: LoadedModel, reason: str) -> None:
    """Mark the kept choice as dropped by a running stage, so the next run measures again."""
    path = choice_path(config, target, candidates(config)[0])
    if path.is_file():
        kept = AnswerEngine.from_dict(paths.read_json(path, "answer-engine measurement"))
        kept.superseded = reason
        paths.atomic_write_json(path, kept.to_dict())


def llama_threads_text(threads: int, poll: int | None) -> str:
    return f"{threads} thread{'s' * (threads != 1)}" + (f", poll {poll}" if poll is not None else "")


def _teacher(target: LoadedModel, directory: Path, k: int):
    return TeacherCache.create(directory, fingerprint=target.fingerprint, k=k, temperature=1.0, vocab="full", data="probe")


def _head_features(config: NightlyConfig, target: LoadedModel) -> tuple[list[int], int | None] | None:
    """The layers and prompt context an EAGLE-3 head's features are read at (as the answer stage records
    them); None for a layer draft, which reads none."""
    if not config.train.on_features:
        return None
    return default_aux_layers(target.model.config.num_hidden_layers), Eagle3Config().prompt_context


def probe_harness(config: NightlyConfig, target: LoadedModel, prompts: list[Prompt]) -> EngineSpeed:
    """The harness answering one batch as the stage does (teacher, and features for a head), after a warm-up,
    at the thread count the stage would pick under the load found now."""
    g, head = config.generation, _head_features(config, target)
    with tempfile.TemporaryDirectory(prefix="answer-probe-") as tmp, \
            answer_threads(config, target, prompts, len(prompts)) as watch:
        generate_answers(target.model, target.tokenizer, prompts[:2], Path(tmp) / "warm.jsonl", batch_size=2,
                         max_new_tokens=2, progress=False)
        teacher = _teacher(target, Path(tmp) / "teacher", g.teacher_top_k)
        features = None if head is None else FeatureCache.create(
            Path(tmp) / "features", fingerprint=target.fingerprint, layers=head[0], data="probe", prompt_context=head[1])
        t0 = time.perf_counter()
        records = generate_answers(target.model, target.tokenizer, prompts, Path(tmp) / "answers.jsonl",
                                   batch_size=len(prompts), max_new_tokens=g.max_new_tokens, teacher_cache=teacher,
                                   feature_cache=features, progress=False)
        seconds = time.perf_counter() - t0
        threads = watch.choices[-1].describe() if watch else ""
    return EngineSpeed(f"harness {dtype_name(target.model.dtype)}", sum(len(r["response_ids"]) for r in records.values()),
                       seconds, threads=threads)


def llama_variants(cores: int, others_busy: float | None) -> list[tuple[int, int | None]]:
    """llama-server's (threads, --poll) worth a round here: each thread count a shared machine's free cores
    fall near; several threads also without polling. A quiet machine keeps llama.cpp's own default."""
    variants: list[tuple[int, int | None]] = []
    for threads in thread_candidates(cores):
        polls = LLAMACPP_POLL if threads > 1 and others_busy is not None and others_busy >= 0.25 else (None,)
        variants += [(threads, poll) for poll in polls]
    return variants


def fastest_llama_setting(config: NightlyConfig, target: LoadedModel, prompts: list[Prompt],
                          others_busy: float | None = None) -> tuple[int, int | None, dict[tuple[int, int | None], float]]:
    """The (threads, poll) llama-server answers fastest with now: a short round (`THREAD_ROUND_TOKENS` per
    request, its slots full) at each of `llama_variants`; with one variant, that one unmeasured."""
    g = config.generation
    busy = hardware.others_busy(0.5) if others_busy is None else others_busy
    variants = llama_variants(usable_cores(), busy)
    if len(variants) == 1:
        return variants[0][0], variants[0][1], {}
    rates: dict[tuple[int, int | None], float] = {}
    round_prompts = (prompts * g.parallel)[: g.parallel]
    for threads, poll in variants:
        with target_server(config.target, parallel=g.parallel, ctx_per_slot=config.window.max_prompt_tokens + THREAD_ROUND_TOKENS + 1,
                           threads=threads, poll=poll, engine=build.cached()) as server, \
                tempfile.TemporaryDirectory(prefix="answer-probe-") as tmp:
            served = connect(server.url, encode_chat(target.tokenizer, prompts[0].messages), 1)
            t0 = time.perf_counter()
            records = generate_answers_openai(served, target.tokenizer, [Prompt(id=f"r{i}", messages=p.messages)
                                                                        for i, p in enumerate(round_prompts)],
                                              Path(tmp) / "answers.jsonl", parallel=g.parallel, batch_size=len(round_prompts),
                                              max_new_tokens=THREAD_ROUND_TOKENS, progress=False)
            rates[threads, poll] = sum(len(r["response_ids"]) for r in records.values()) / (time.perf_counter() - t0)
    best = max(rates, key=rates.get)
    return best[0], best[1], rates


def probe_llamacpp(config: NightlyConfig, target: LoadedModel, prompts: list[Prompt]) -> EngineSpeed:
    """llama-server answering the same prompts over its slots (started here, not timed: once per night) at the
    threads and polling `fastest_llama_setting` finds, then, for a head, the harness's feature pass over its
    answers, batched as the trainer runs it."""
    g, head = config.generation, _head_features(config, target)
    threads, poll, rates = fastest_llama_setting(config, target, prompts)
    ctx_per_slot = config.window.max_prompt_tokens + g.max_new_tokens + 1
    with target_server(config.target, parallel=g.parallel, ctx_per_slot=ctx_per_slot, threads=threads, poll=poll,
                       engine=build.cached()) as server, tempfile.TemporaryDirectory(prefix="answer-probe-") as tmp:
        served = connect(server.url, encode_chat(target.tokenizer, prompts[0].messages), g.teacher_top_k)
        complete_ids(served.url, encode_chat(target.tokenizer, prompts[0].messages), model=served.model,
                     max_tokens=2, top_logprobs=served.top_k)  # warm-up
        teacher = _teacher(target, Path(tmp) / "teacher", served.top_k)
        t0 = time.perf_counter()
        records = generate_answers_openai(served, target.tokenizer, prompts, Path(tmp) / "answers.jsonl",
                                          parallel=g.parallel, batch_size=len(prompts), max_new_tokens=g.max_new_tokens,
                                          teacher_cache=teacher, progress=False)
        answer_s = time.perf_counter() - t0
        features_s = 0.0
        if head is not None:
            examples = [encode_generated(target.tokenizer, r) for r in records.values()]
            t0 = time.perf_counter()
            build_feature_cache(target.model, examples, Path(tmp) / "features", fingerprint=target.fingerprint,
                                layers=head[0], prompt_context=head[1], progress=False)
            features_s = time.perf_counter() - t0
        name = f"llamacpp {gguf_dtype(server.config.model)}"
    chosen = llama_threads_text(threads, poll)
    if len(rates) > 1:
        chosen += ", the fastest of " + ", ".join(f"{llama_threads_text(*k)}: {v:.1f}" for k, v in rates.items())
    return EngineSpeed(name, sum(len(r["response_ids"]) for r in records.values()), answer_s, features_s, threads=chosen,
                       thread_count=threads, poll=poll)
