"""The nightly pipeline's stages as plain library calls: one function per Prefect task.

Each stage takes and returns small, JSON-friendly values (the records of `pipeline.outputs`), writes its
outputs under a content-addressed directory, and resumes from what is already there, so a rerun after a
failure recomputes nothing that finished.
"""

from __future__ import annotations

import itertools
import random
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from specdistill import paths
from specdistill.data.datasets import humaneval_path, sharegpt_path
from specdistill.data.ingest import IngestResult, ingest
from specdistill.data.logstore import LogStore
from specdistill.data.prompts import Prompt, usable_prompt
from specdistill.data.results import BenchResult
from specdistill.distill import train as distill_train
from specdistill.distill.config import DataConfig, TeacherConfig
from specdistill.distill.examples import read_done
from specdistill.hardware import describe_device
from specdistill.modeling import drafts, models
from specdistill.modeling.drafts import align_draft, load_draft_meta
from specdistill.modeling.eagle3 import Eagle3ShapeError
from specdistill.modeling.eagle3_io import align_head
from specdistill.modeling.models import dtype_name, resolve_model_dir, shared_model
from specdistill.modeling.vocab import DraftVocab
from specdistill.ops import registry
from specdistill.ops.policy import FIRST_POSITION_TAG, SHAPE_GAMMA_TAG, SHAPE_TREE_TAG, GateVerdict, Role, first_position
from specdistill.ops.registry import RegisteredDraft
from specdistill.ops.serving import serving_path, write_serving_config
from specdistill.pipeline.config import NightlyConfig, SourceConfig, config_hash, run_root, target_tokenizer
from specdistill.pipeline.outputs import (
    Champion,
    GeneratedData,
    Promoted,
    ServingDecision,
    TargetInfo,
    Trained,
    Untrained,
    WarmStart,
    Window,
    window_key,
)
from specdistill.pipeline.report import registration_artifacts, registration_metrics, train_losses
from specdistill.pipeline.stage_budgets import stage_budgets, stage_deadline
from specdistill.pipeline.stages.answers.stage import features_dir
from specdistill.pipeline.stages.choose_mode import serving_config
from specdistill.pipeline.tail import OPTIONAL_SHARE
from specdistill.speculative.specs import DrafterSpec
from specdistill.speculative.threads import chosen_threads


def describe_target(target_ref: str, dtype: str = "auto", device: str = "auto") -> TargetInfo:
    """Load the target once (this is where an unloadable target fails the run) and name its version
    and the dtype every stage runs it in (the fingerprint does not depend on the dtype). Its weights are
    hashed in full first, once per run (a load checks a sample), and the load refuses a target whose
    canary logits are non-finite or flat (`modeling.canary`)."""
    check = models.verify_model_files(target_ref)
    print(f"specdistill: target weights {check.outcome}: {check.bytes / 1e6:.0f} MB hashed in {check.seconds:.2f} s"
          + (f" ({check.detail})" if check.detail else ""), file=sys.stderr)
    loaded = shared_model(target_ref, dtype=dtype, device=device)  # the stages after it reuse this load
    return TargetInfo(ref=target_ref, path=str(loaded.path), fingerprint=loaded.fingerprint,
                      num_layers=loaded.config.num_hidden_layers, vocab_size=loaded.config.vocab_size,
                      dtype=dtype_name(loaded.model.dtype), hardware=describe_device(loaded.model.device))


def resolve_source_path(source: SourceConfig) -> Path:
    shipped = {"sharegpt": sharegpt_path, "humaneval": humaneval_path}
    return shipped[source.path]() if source.path in shipped else Path(source.path)


def ingest_source(source: SourceConfig, log_db: str | None) -> IngestResult:
    with LogStore(log_db) as store:
        return ingest(resolve_source_path(source), source.format, store, progress=True,
                      max_decompressed_bytes=source.max_decompressed_bytes)


def align_champion(config: NightlyConfig, champion: Champion | None) -> WarmStart | None:
    """The champion as a warm start for this target: as it is when the target reads its token ids
    as they are, else re-embedded over the target's vocabulary (`modeling.drafts.align_draft`)."""
    if champion is None:
        return None
    from transformers import AutoConfig

    target_tok = target_tokenizer(config)

    def warm(directory: str, transplanted: bool, report: dict, unfit: str = "") -> WarmStart:
        return WarmStart(champion.name, champion.version, directory, dict(champion.tags), transplanted, report, unfit)

    if DrafterSpec.for_draft(champion.dir).of.on_target:  # a head: its draft vocabulary carried over; embeddings the target's
        target = shared_model(config.target, dtype=config.dtype, device=config.device)
        out = run_root() / "aligned" / f"{champion.name}-{champion.version}-{target.fingerprint}"
        try:
            aligned_dir, head, report = align_head(champion.dir, target.model, target_tok, out)
        except Eagle3ShapeError as exc:  # another width or depth: tonight starts from the target, and says why
            return warm("", False, {}, unfit=str(exc))
        return warm(str(aligned_dir), head.transplanted, report)
    target_vocab_size = AutoConfig.from_pretrained(resolve_model_dir(config.target)).vocab_size
    draft = models.load_model(champion.dir, dtype=config.dtype, device=config.device)
    aligned = align_draft(draft.model, draft.tokenizer, target_tok, DraftVocab.load(champion.dir),
                          target_vocab_size=target_vocab_size, copy_model=False)
    report = aligned.report.to_dict()
    if not aligned.transplanted:
        return warm(champion.dir, False, report)
    out = run_root() / "aligned" / f"{champion.name}-{champion.version}-{config_hash(report)}"
    if not (out / "config.json").is_file():
        drafts.save_draft(aligned.model, target_tok, out, draft_vocab=aligned.draft_vocab,
                   meta={**load_draft_meta(champion.dir), "transplanted_from": champion.dir})
    return warm(str(out), True, report)


def interleave_slices(prompts: list[Prompt]) -> list[Prompt]:
    """One prompt of each slice in turn (each slice in its own order), so a benchmark its time budget cuts
    still measures every slice: cut to its first 5 prompts, slice by slice, it measured code alone, where the
    head drafts best (first-position 0.586 there; 0.478 teacher-forced over all 10)."""
    by_slice: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_slice.setdefault(p.slice, []).append(p)
    rows = itertools.zip_longest(*by_slice.values())
    return [p for row in rows for p in row if p is not None]


def select_window(config: NightlyConfig, now: datetime | None = None) -> Window:
    """Train prompts from the recent window plus a replay share from before it; eval prompts from the
    eval split (never trained on). Deterministic for a given store content and seed. A prompt is what
    `data.prompts.usable_prompt` keeps (the monitor replays by the same definition)."""
    w = config.window
    tokenizer = target_tokenizer(config)
    now = now or datetime.now(timezone.utc)
    since = w.since if w.since is not None else (now - timedelta(days=w.days) if w.days is not None else None)
    if since is not None and since.tzinfo is None:
        since = since.replace(tzinfo=timezone.utc)
    slice_of = {str(resolve_source_path(s)): s.slice for s in config.sources}

    def usable(rows, n: int) -> list[Prompt]:
        out = []
        for row in rows:
            prompt = usable_prompt(row.messages, tokenizer, w.max_prompt_tokens)
            if prompt is None:
                continue
            out.append(Prompt(id=str(row.id), messages=prompt[0], slice=slice_of.get(row.source, row.source)))
            if len(out) >= n:
                break
        return out

    def per_source(store: LogStore, n: int, **filters) -> list[Prompt]:
        """An even share of prompts from every source, so code and chat are both represented; smallest
        source first, so what a small one lacks (HumanEval has 157 train prompts) goes to the larger ones."""
        picked: list[Prompt] = []
        counts = {s: store.count(source=s, **filters) for s in slice_of}
        sources = sorted((s for s in slice_of if counts[s]), key=counts.get)
        for i, source in enumerate(sources):
            share = (n - len(picked)) // (len(sources) - i)
            rows = store.sample(max(4 * share, share + 16), seed=w.seed, source=source, **filters)
            picked += usable(rows, share)
        return picked

    with LogStore(config.log_db) as store:
        n_replay = int(round(w.train_prompts * w.replay_share)) if since is not None else 0
        recent = per_source(store, w.train_prompts - n_replay, split="train", since=since)
        replay = per_source(store, n_replay, split="train", until=since) if n_replay else []
        evals = interleave_slices(per_source(store, w.eval_prompts, split="eval"))
    if not recent:
        raise ValueError(f"empty data window: no usable train prompts since {since or 'the beginning'} "
                         f"in the log store ({', '.join(slice_of) or 'no sources'})")
    if not evals:
        raise ValueError("empty eval split: no held-out prompts to benchmark on")
    train = recent + replay
    random.Random(w.seed).shuffle(train)
    return Window(train, evals, window_key(train, evals, config.target), since.isoformat() if since else None, len(replay))


MIN_TRAIN_MINUTES = 0.25  # a shorter training budget is no useful work


def distill_draft(config: NightlyConfig, train_data: GeneratedData | None, heldout_data: GeneratedData,
                  warm_start: str | None = None, *, generic: bool = False, window: Window | None = None,
                  deadline_at: float | None = None) -> Trained | Untrained:
    """Distill a draft on the target's own answers (KL on the cached teacher), fresh or warm-started
    from the champion; `generic=True` trains the off-the-shelf baseline instead: plain CE on the
    human-written answers of the same prompts, same size, for `bench.generic_minutes`.

    The output directory is keyed by the train config, the data and the warm start (the generic
    baseline: by the window and the train config), so a finished run is found again and reused.
    Training stops at `train.optim.max_minutes` or at the stage's share of the run's deadline `deadline_at`,
    whichever comes first. A share too small to train in returns `Untrained` (the draft: the night stops
    there; the generic baseline, optional: skipped, and already when its share is under half its budget)."""
    tc = config.train
    kind = "layers" if generic else tc.kind
    if warm_start and DrafterSpec.for_draft(warm_start).of.draft_kind != kind:
        warm_start = None  # the champion is of the other kind: this kind starts from the target
    feature_dir = None
    if generic:
        out_dir = run_root() / "generic" / f"{window.key}-{config_hash(tc)}"
        conv_path = paths.ensure_private(out_dir.parent) / f"{window.key}-conversations.jsonl"
        if not conv_path.is_file():  # the train conversations with their human-written answers
            with LogStore(config.log_db) as store:
                if not store.export_answered((int(p.id) for p in window.train), conv_path):
                    # HumanEval-style traffic logs prompts only: there is nothing human-written to imitate
                    raise ValueError("the window's train conversations have no human-written answers for the generic "
                                     "baseline")
        data = DataConfig(path=str(conv_path), kind="conversations", heldout_path=heldout_data.path)
        teacher = TeacherConfig(mode="none")
    else:
        key = config_hash({"train": tc.model_dump(), "data": train_data.path, "warm": warm_start})
        out_dir = run_root() / "distill" / key
        data = DataConfig(path=train_data.path, kind="generated", heldout_path=heldout_data.path)
        teacher = TeacherConfig(mode="cache", cache_dir=train_data.teacher_cache)
        if tc.on_features:  # features beside the teacher cache: every run on this data reuses them
            # a warm start's own layers, when other than the answer pass's: their own directory
            head_layers = DrafterSpec.for_draft(warm_start).of.feature_layers(warm_start) if warm_start else None
            feature_dir = str(features_dir(train_data.teacher_cache, head_layers))
    result_file = out_dir / "result.json"
    if result_file.is_file():  # finished before: a rerun reuses it
        return Trained.from_dict(paths.read_json(result_file, "distillation result"))
    stage, now = "generic" if generic else "distill", time.time()
    deadline = stage_deadline(config, stage, deadline_at, now=now)
    left = deadline.minutes(now)
    minutes = stage_budgets(config)[stage]
    if left is not None and (minutes is None or left < minutes):
        # optional work (the generic baseline, a reference point) gives way once the run cannot give it half its budget
        least = max(MIN_TRAIN_MINUTES, OPTIONAL_SHARE * minutes) if generic and minutes is not None else MIN_TRAIN_MINUTES
        if left < least:
            what = "the generic baseline" if generic else "the draft"
            unchanged = "skipped" if generic else "nothing was trained; the champion and serving.json are unchanged"
            return Untrained(f"the run's deadline (deadline_minutes={config.deadline_minutes}) leaves {left * 60:.0f} s "
                             f"to train {what}, under the {least * 60:.0f} s it needs: {unchanged}")
        minutes = left
    # a warm start trained for this target version trains depth; one from before a target update its first position
    warm_meta = load_draft_meta(warm_start) if warm_start else {}
    trained_for = warm_meta.get("target_fingerprint")
    deepen = trained_for is None or trained_for == shared_model(config.target, dtype=config.dtype, device=config.device).fingerprint
    dcfg = tc.for_run(config, data=data, out_dir=out_dir, teacher=teacher, warm_start=warm_start, max_minutes=minutes,
                      generic=generic, feature_dir=feature_dir, deepen=deepen, warm_depth=warm_meta.get("unroll_steps"))
    # `bench.threads: auto`: the thread count the target decodes fastest at under the load found (a training step is
    # the same chains of small matmuls and OpenMP barriers), probed again between steps when the load moves
    ids = _probe_ids(heldout_data.path) if config.bench.threads == "auto" else None
    model = shared_model(config.target, dtype=config.dtype, device=config.device).model if ids else None
    with chosen_threads(config.bench.threads, model, ids) as watch:
        trained = distill_train.distill(dcfg, deadline, **({"between_steps": watch.check} if watch else {}))
    if watch is not None:
        print(f"{'generic baseline' if generic else 'distill'}: threads {watch.describe()}", file=sys.stderr)
    return trained


def _probe_ids(answers_path: str) -> list[int] | None:
    """The first answer's prompt ids: what the thread probe decodes after (None: no answer to read)."""
    first = next(iter(read_done(Path(answers_path)).values()), None)
    return list(first["prompt_ids"])[-64:] if first else None


def flat_params(section: dict, prefix: str = "") -> dict:
    """A nested config as MLflow params: one dotted key per setting (`optim.lr`), as the YAML names it."""
    flat = {}
    for key, value in section.items():
        if isinstance(value, dict):
            flat.update(flat_params(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def champion_of(config: NightlyConfig) -> Champion | None:
    name = registry.model_name_for(config.target_name)
    return _registered(name, registry.version_by_alias(name, registry.CHAMPION))


def training_start(config: NightlyConfig, target_fingerprint: str, champion: Champion | None) -> Champion | None:
    """Where tonight's training starts: the champion when it is a draft of the kind being trained (or a
    newer draft benched beside it that measured no worse, `NO_WORSE_TAG`), else the newest draft of that
    kind registered for this very target version, gate passed or not. Without the second, every failed
    gate sent the next night back to the target's weights, so nights did not compound (before e987904, a
    second `specdistill demo window.seed=1` trained on two nights' answers from scratch and read 0.450
    against the first night's 0.445), and so did a champion of the other kind.
    Without the first, a night that trained depth but read under the red line on harder prompts (0.489
    there, the champion 0.445 on the same ones) was thrown away, and the next night trained the same
    step again. It is a starting point only, never measured as a champion."""
    name = registry.model_name_for(config.target_name)
    if champion is not None and draft_kind(champion) == config.train.kind:
        newer = registry.newest_version(name, target_fingerprint=target_fingerprint, draft_kind=config.train.kind,
                                        parent=champion.version, **{NO_WORSE_TAG: "true"})
        return _registered(name, newer) if newer is not None and int(newer.version) > int(champion.version) else champion
    return _registered(name, registry.newest_version(name, target_fingerprint=target_fingerprint,
                                                     draft_kind=config.train.kind))


def draft_kind(draft: Champion) -> str:
    """`layers` or `eagle3`: the version's tag, or its files for a version registered without one."""
    return draft.tags.get("draft_kind") or registry.draft_kind_tags(draft.dir)["draft_kind"]


def _registered(name: str, mv) -> Champion | None:
    if mv is None:
        return None
    return Champion(name=name, version=str(mv.version), dir=str(registry.download_draft(f"models:/{name}/{mv.version}")),
                    tags=dict(mv.tags))


def started_from(warm_start: WarmStart | None, champion: Champion | None, target_fingerprint: str | None = None) -> str:
    if warm_start is not None and not warm_start.usable:
        return (f"training started from the target's weights: version {warm_start.version} does not fit this target "
                f"({warm_start.unfit})")
    trained_for = warm_start.tags.get("target_fingerprint") if warm_start is not None else None
    across = (f" (trained for target {trained_for}, before the update to {target_fingerprint})"
              if trained_for and target_fingerprint and trained_for != target_fingerprint else "")
    if warm_start is not None and champion is not None and warm_start.version == champion.version:
        return f"training started from the champion, version {warm_start.version}{across}"
    if warm_start is not None and champion is not None and warm_start.tags.get(NO_WORSE_TAG) == "true":
        return (f"training started from version {warm_start.version}, newer than the champion (version "
                f"{champion.version}) and no worse than it on the prompts both were measured on (gate "
                f"{warm_start.tags.get('gate_verdict', 'unknown')})")
    why = (f"the champion, version {champion.version}, is a {draft_kind(champion)} draft" if champion is not None
           else "there is no champion")
    if warm_start is None:
        return f"training started from the target's weights (no draft of this kind registered for this target; {why})"
    verdict = warm_start.tags.get("gate_verdict", "unknown")
    return (f"training started from version {warm_start.version}, the newest draft of this kind registered for "
            f"this target (gate {verdict}; {why})")


def register(config: NightlyConfig, target: TargetInfo, window: Window, trained: Trained,
             results: dict[str, BenchResult], verdict: GateVerdict, parent: str | None, report_path: str | None,
             speeds: dict[str, BenchResult] | None = None, warm_start: WarmStart | None = None) -> RegisteredDraft:
    """The challenger into the registry with its numbers, curves and artifacts (see `pipeline.report`), and
    its lineage: the champion it was warm-started from and the target version that one was trained for."""
    return registry.register_draft(
        trained.draft_dir, target_name=config.target_name,
        params={"layers": trained.layers, "draft_vocab": trained.draft_vocab, "dtype": target.dtype,
                **flat_params(config.train.model_dump(exclude_none=True))},
        metrics=registration_metrics(results, trained), curves={"train_loss": train_losses(trained)},
        artifacts=registration_artifacts(config, results, verdict, trained, report_path, speeds),
        tags={"target_fingerprint": target.fingerprint, "data_window": window.key,
              "gate_verdict": "pass" if verdict.passed else "fail", "parent": parent or "",
              FIRST_POSITION_TAG: f"{first_position(results[Role.CHALLENGER])[0] or 0.0:.4f}",  # the monitor's drift baseline
              SHAPE_GAMMA_TAG: str(results[Role.CHALLENGER].gamma), SHAPE_TREE_TAG: str(results[Role.CHALLENGER].tree_width),
              NO_WORSE_TAG: no_worse_than_champion(results, verdict),
              **(warm_start.lineage_tags() if warm_start else {})},
        run_name=f"nightly-{window.key}",
    )


NO_WORSE_TAG = "no_worse_than_champion"  # "true": benched beside the champion (its `parent`), no worse on the same prompts


def no_worse_than_champion(results: dict[str, BenchResult], verdict: GateVerdict) -> str:
    """"true" when the champion was measured beside the challenger on the same held-out prompts and the
    challenger's first-position acceptance is at least the champion's and its τ within the gate's tolerance;
    "" with no champion measured. A gate that fails only the absolute red line can still be "true"."""
    champion = results.get(Role.CHAMPION)
    if champion is None:
        return ""
    tau_held = all(c.passed for c in verdict.checks if c.name == "accepted length vs champion")
    mine, theirs = first_position(results[Role.CHALLENGER])[0] or 0.0, first_position(champion)[0] or 0.0
    return "true" if tau_held and mine >= theirs else "false"


def promote(config: NightlyConfig, registered: RegisteredDraft, target: TargetInfo, expected_champion: str | None,
            serving: ServingDecision) -> Promoted:
    """Alias `champion` and the serving config, together or not at all (see registry.promote). The
    serving config names the mode `serve.choose_serving` picked, which need not be the new draft."""
    draft_dir = registry.download_draft(registered.model_uri)
    cfg = serving_config(serving, target, registered.version, str(draft_dir))
    registry.promote(registered.name, registered.version, cfg, expected_champion=expected_champion,
                     serving_path=config.serving_path)
    return Promoted(version=registered.version, serving_config=str(config.serving_path or serving_path()))


def write_serving(config: NightlyConfig, target: TargetInfo, serving: ServingDecision, champion: Champion | None) -> str:
    """Without a promotion: the serving config for the fastest mode measured this run, written under
    the promotion lock (a concurrent promotion is never half overwritten)."""
    cfg = serving_config(serving, target, champion=champion)
    with registry.promotion_lock():
        return str(write_serving_config(cfg, config.serving_path))
