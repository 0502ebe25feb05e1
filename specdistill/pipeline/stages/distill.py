"""Stage: the draft distilled on the target's answers (and the off-the-shelf generic baseline), under
a directory keyed by what it was trained from, within the stage's share of the run's deadline."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from specdistill import paths
from specdistill.data.logstore import LogStore
from specdistill.distill import train as distill_train
from specdistill.distill.distill_recipe import DataConfig, TeacherConfig
from specdistill.distill.examples import read_done
from specdistill.modeling.drafts import load_draft_meta
from specdistill.modeling.eagle3_files import DRAFT_MODEL
from specdistill.modeling.models import shared_model
from specdistill.pipeline.layout import features_dir
from specdistill.pipeline.nightly_recipe import NightlyConfig, config_hash, run_root
from specdistill.pipeline.outputs import GeneratedData, Trained, Untrained, Window
from specdistill.pipeline.stage_budgets import stage_budgets, stage_deadline
from specdistill.pipeline.tail import OPTIONAL_SHARE
from specdistill.speculative.specs import DrafterSpec
from specdistill.speculative.threads import chosen_threads

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
    kind = DRAFT_MODEL if generic else tc.kind
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
