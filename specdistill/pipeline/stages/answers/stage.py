"""Stage: the target answers the window's prompts (greedy) and records its top-k teacher on the way,
in this PyTorch harness or in a serving engine (`generation.backend`).

Both backends write the same JSONL records and teacher-cache rows, resumably, under a directory keyed
by the window, the target, the generation settings and what answered (the harness's dtype, or the
engine and its weights: `llamacpp-Q4_1`, `openai-MODEL`): answers from another engine are other data.
"""

from __future__ import annotations

import os
import re
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from specdistill import paths
from specdistill.budget import Deadline
from specdistill.data.logstore import LogStore
from specdistill.data.prompts import Prompt, encode_chat
from specdistill.distill.distill_recipe import Eagle3Config
from specdistill.distill.examples import read_done
from specdistill.distill.features import FEATURE_META, FeatureCache
from specdistill.distill.teacher import TeacherCache
from specdistill.engines.llamacpp import engine as llamacpp
from specdistill.engines.vllm import bench as vllm_bench
from specdistill.modeling.eagle3 import default_aux_layers
from specdistill.modeling.models import LoadedModel, dtype_name, shared_model
from specdistill.pipeline.layout import features_dir
from specdistill.pipeline.nightly_recipe import NightlyConfig, config_hash, run_root
from specdistill.pipeline.outputs import GeneratedData, LoggedData, Window
from specdistill.pipeline.stage_budgets import stage_deadline
from specdistill.pipeline.stages.answers.choose_engine import HARNESS, LLAMACPP, AnswerEngine, choose_answer_engine, supersede
from specdistill.pipeline.stages.answers.engine_client import ServedTarget, connect, generate_answers_openai
from specdistill.pipeline.stages.answers.harness import answer_batch, answer_threads, generate_answers
from specdistill.pipeline.stages.answers.logged import label_logged
from specdistill.pipeline.stages.answers.rate_watch import EngineSwitch, RateWatch, read_switch, write_switch

LATEST_ANSWERS = "latest"  # under run_root()/data: the newest night's answers (`link_latest`)
ENGINE_ONLY = {"backend", "url", "engine", "parallel"}  # settings the harness's answers do not depend on
HOW_ONLY = {"threads"}  # how fast, not what: settings no answers depend on
# records by id, what answered, answers file, teacher cache, what the logged responses gave, an engine switch
Answered = tuple[dict[str, dict], str, Path, str | None, LoggedData | None, EngineSwitch | None]


def generate_responses(config: NightlyConfig, window: Window, split: str, *, record_teacher: bool,
                       deadline_at: float | None = None) -> GeneratedData:
    """The target answers the window's `split` prompts, resumably; train answers also record the
    target's top-k log-probs into the teacher cache in the same pass. The train answers stop at their
    time budget (`generation.max_minutes`, their share of the run's deadline `deadline_at`), keeping
    what was written; none at all stops the run before it trains on nothing."""
    target = shared_model(config.target, dtype=config.dtype, device=config.device)  # the harness answers in bf16 where the hardware has it
    prompts = [Prompt(id=p.id, messages=p.messages) for p in window.split(split)]
    deadline = stage_deadline(config, "answers", deadline_at) if split == "train" else None  # the probe's time included
    engine = None
    if config.generation.backend == "auto":  # measured on the train prompts, again when the machine's load moved
        engine = choose_answer_engine(config, target, [Prompt(id=p.id, messages=p.messages) for p in window.train],
                                      recheck=split == "train")
        config = engine.apply(config)
    g = config.generation
    records, source, out_path, cache_dir, logged, switch = _answer(config, target, window, split, prompts, record_teacher,
                                                                   deadline, engine)
    if split == "train" and not any(p.id in records for p in window.split(split)):
        raise ValueError(f"the time budget left no time to answer any of the {len(prompts)} train prompts "
                         f"(generation.max_minutes={g.max_minutes}, deadline_minutes={config.deadline_minutes}): "
                         "the run stops before training on nothing; the champion and serving.json are unchanged")
    with LogStore(config.log_db) as store:
        for p in window.split(split):
            rec = records.get(p.id)
            if rec is None or rec.get("source"):  # cut by the time budget; a logged answer is in the store already
                continue
            store.add_response(int(p.id), target.fingerprint, rec["response"], prompt_messages=len(p.messages),
                               params={"temperature": 0.0, "max_new_tokens": g.max_new_tokens, "dtype": source},
                               token_ids=rec["response_ids"])
    if all((out_path.parent / f"{s}_generated.jsonl").is_file() for s in ("train", "eval")):  # whichever came second
        link_latest(out_path.parent)
    answered = sum(1 for p in window.split(split) if p.id in records)  # decoded, or a logged answer of this target
    choice = engine.summary() if engine is not None else None
    if switch is not None and split == "train":
        choice = "\n".join(x for x in (choice, switch.describe()) if x)
    return GeneratedData(path=str(out_path), teacher_cache=cache_dir, answers=answered,
                         tokens=sum(len(r["response_ids"]) for r in records.values()), answered_by=source,
                         engine_choice=choice, logged=logged)


def link_latest(out_dir: Path) -> Path:
    """`data/latest`: a link to the directory of the newest night's answers (train and held-out answers and the
    train answers' teacher cache), a path that holds still for what is otherwise keyed by content, so
    `deploy/distill/demo.yaml` distills from what `make demo` answered. Relative (the state directory can
    move) and replaced atomically; a night's directory stays where it is."""
    link = out_dir.parent / LATEST_ANSWERS
    tmp = link.with_name(f".{link.name}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(out_dir.name, target_is_directory=True)
    os.replace(tmp, link)
    return link


def _outputs(config: NightlyConfig, window: Window, fingerprint: str, split: str, source: str, k: int,
             record_teacher: bool) -> tuple[Path, TeacherCache | None]:
    """The split's answers file and, for train answers, the teacher cache, keyed by what answered
    (the EAGLE-3 feature cache, when there is one, lies beside the teacher cache: `features_dir`)."""
    g = config.generation
    # which engine was started is in `source` (the key's tag), so keys of earlier llama.cpp answers hold
    settings = g.model_dump(mode="json", exclude=(ENGINE_ONLY if g.backend == "harness" else {"engine"}) | HOW_ONLY)
    tag = re.sub(r"[^A-Za-z0-9._-]+", "-", source)[:64]
    out_dir = paths.ensure_private(run_root() / "data" / f"{window.key}-{fingerprint}-{config_hash(settings)}-{tag}")
    cache = None
    if record_teacher:
        cache = TeacherCache.create(out_dir / "teacher_cache", fingerprint=fingerprint, k=k, temperature=1.0,
                                    vocab="full", data=f"{window.key}-{source}")
    return out_dir / f"{split}_generated.jsonl", cache


def _feature_cache(config: NightlyConfig, target: LoadedModel, out_path: Path, teacher: TeacherCache | None):
    """The feature cache the answer pass fills for an EAGLE-3 head (at the layers and prompt context the
    trainer reads), so training needs no second target pass over the answers. None for a layer draft,
    and for answers already written without one (a resume of an older run: the trainer's pass fills it)."""
    if teacher is None or not config.train.on_features:
        return None
    directory = features_dir(teacher.dir)
    if out_path.is_file() and not (directory / FEATURE_META).is_file():
        return None
    return FeatureCache.create(directory, fingerprint=target.fingerprint,
                               layers=default_aux_layers(target.model.config.num_hidden_layers),
                               data=teacher.meta["data"], prompt_context=Eagle3Config().prompt_context)


def _answer(config: NightlyConfig, target: LoadedModel, window: Window, split: str, prompts: list[Prompt],
            record_teacher: bool, deadline: Deadline | None, engine: AnswerEngine | None = None) -> Answered:
    """In the harness, or through `generation.url` or a server started here (stopped after): llama-server on
    the target's GGUF, or vLLM on its HF directory (`generation.engine`). The teacher cache's `data` names
    what answered; through an engine its k is what the server gives. Between the two engines `auto` measured
    (`engine`), the train answers switch for the rest of their prompts when the live rate collapses
    (`rate_watch`), into the same answers file and teacher cache; a run that finds such a switch beside the
    answers starts with the engine switched to."""
    g = config.generation
    records = None
    with ExitStack() as first:
        served = None
        if g.backend == "harness":
            source, k = dtype_name(target.model.dtype), g.teacher_top_k
        else:
            served, source = _serve(first, config, target, prompts, engine)
            k = served.top_k
        out_path, cache = _outputs(config, window, target.fingerprint, split, source, k, record_teacher)
        features = _feature_cache(config, target, out_path, cache) if served is None else None
        logged = _label_logged(config, target, prompts, out_path, cache, features, deadline)
        common = dict(batch_size=answer_batch(config, target), max_new_tokens=g.max_new_tokens, teacher_cache=cache,
                      deadline=deadline)
        switch = read_switch(out_path.parent)
        watch = _rate_watch(config, engine, served is None) if split == "train" and switch is None else None
        if switch is None:
            records = _answer_with(config, target, served, prompts, out_path, features, common, watch)
            if watch is not None and watch.tripped and len(records) < len(prompts):
                switch = _switch(config, target, engine, served is None, watch, len(records), out_path.parent)
    if switch is not None and len(read_done(out_path)) < len(prompts):  # the first engine stopped: the other answers
        with ExitStack() as second:
            other = None
            if switch.to != HARNESS:
                other, _ = _serve(second, config, target, prompts, engine, force_llamacpp=True)
            records = _answer_with(config, target, other, prompts, out_path, None, common, None)
    if records is None:  # a resumed run found every answer written
        records = read_done(out_path)
    return records, source, out_path, str(cache.dir) if cache else None, logged, switch


def _serve(stack: ExitStack, config: NightlyConfig, target: LoadedModel, prompts: list[Prompt],
           engine: AnswerEngine | None, *, force_llamacpp: bool = False) -> tuple[ServedTarget, str]:
    """The serving engine that answers (entered on `stack`), and the answers' source tag."""
    g = config.generation
    ctx_per_slot = config.window.max_prompt_tokens + g.max_new_tokens + 1
    if g.url and not force_llamacpp:
        url, source = g.url, ""
    elif g.engine == "vllm" and not force_llamacpp:
        server = stack.enter_context(vllm_bench.target_server(
            config.target, parallel=g.parallel, ctx_per_slot=ctx_per_slot, top_k=g.teacher_top_k,
            threads=config.serving.threads, dtype=config.dtype))
        url, source = server.url, f"vllm:{server.config.dtype}"
    else:  # at the threads and polling the answer-engine probe chose under the load it found
        threads = engine.llamacpp_threads if engine is not None and engine.llamacpp_threads else config.serving.threads
        server = stack.enter_context(llamacpp.target_server(
            config.target, parallel=g.parallel, ctx_per_slot=ctx_per_slot, threads=threads,
            poll=engine.llamacpp_poll if engine is not None else None))
        url, source = server.url, f"llamacpp:{llamacpp.gguf_dtype(server.config.model)}"
    probe = prompts[0].messages if prompts else [{"role": "user", "content": "Hi."}]
    served = connect(url, encode_chat(target.tokenizer, probe), g.teacher_top_k)
    return served, source or f"openai:{served.model.rstrip('/').rsplit('/', 1)[-1]}"


def _answer_with(config: NightlyConfig, target: LoadedModel, served: ServedTarget | None, prompts: list[Prompt],
                 out_path: Path, features: FeatureCache | None, common: dict, watch: RateWatch | None) -> dict[str, dict]:
    """One engine answers what is left: the harness at the threads chosen for the load (checked between
    batches), or the served engine."""
    g = config.generation
    if served is not None:
        return generate_answers_openai(served, target.tokenizer, prompts, out_path, parallel=g.parallel,
                                       after_answer=watch.observe if watch else None, **common)
    with answer_threads(config, target, prompts, common["batch_size"]) as threads:
        def after_batch(tokens: int) -> bool:
            if threads is not None and (again := threads.check()) is not None:
                print(f"target answers: the load moved, threads chosen again: {again.describe()}", file=sys.stderr)
            return watch is not None and watch.observe(tokens)

        return generate_answers(target.model, target.tokenizer, prompts, out_path, feature_cache=features,
                                after_batch=after_batch, **common)


def _rate_watch(config: NightlyConfig, engine: AnswerEngine | None, harness: bool) -> RateWatch | None:
    """A watch on the live rate against the other engine's probe (None: no other engine was measured)."""
    if engine is None or config.remeasure.switch_below <= 0:
        return None
    other = engine.speed_of(LLAMACPP if harness else HARNESS)
    if not other:
        return None
    return RateWatch(config.remeasure.switch_below * other, config.remeasure.window_s)


def _switch(config: NightlyConfig, target: LoadedModel, engine: AnswerEngine, harness: bool, watch: RateWatch,
            answers: int, directory: Path) -> EngineSwitch:
    """Record the switch beside the answers, print it, and mark the kept choice for measuring again."""
    was, to = (HARNESS, LLAMACPP) if harness else (LLAMACPP, HARNESS)
    switch = EngineSwitch(was, to, answers, round(watch.rate or 0.0, 2), watch.window_s,
                          round(engine.speed_of(to) or 0.0, 2), config.remeasure.switch_below, time.time())
    write_switch(directory, switch)
    print(switch.describe().replace("**", ""), file=sys.stderr)
    supersede(config, target, f"the stage dropped it: {was} at {switch.live_tokens_per_s:.1f} answer tokens/s live")
    return switch


def _label_logged(config: NightlyConfig, target: LoadedModel, prompts: list[Prompt], out_path: Path,
                  teacher: TeacherCache | None, features: FeatureCache | None, deadline: Deadline | None) -> LoggedData | None:
    """Train answers only: the prompts' logged responses, labelled by prefill first, within
    `generation.logged.max_share` of the answers' time left; the decoding gets the rest."""
    if teacher is None:
        return None
    now = time.time()
    share = config.generation.logged.max_share
    remaining = None if deadline is None or deadline.at is None else deadline.remaining(now)
    labelling = Deadline(None if remaining is None else now + share * remaining)
    return label_logged(config, target, prompts, out_path, teacher, features, labelling, read_done(out_path))
