"""The nightly distillation flow: yesterday's traffic in, a proven better draft out (or nothing changed).

    production logs -> ingest -> log store -> window -> vocab alignment -> target responses
    (+ teacher cache) -> answer pool (every night's answers for this target) -> distill (+ suffix corpus of
    the answers) -> benchmark vs champion and baselines -> gate -> MLflow register
    -> promote (the best draft) + serving config (the fastest lossless mode, never a slowdown)

A failure at any step leaves the champion and the serving config as they were: they change only
in the last task. Under `deadline_minutes` the tail is kept from the start (`pipeline.tail`): the held-out
answers come first, the benchmark of the draft is reserved, and the stages before it share what is left, so a
night that trained a draft always measures and gates it; one that had no time to train says why in its report
and fails with that one sentence.
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.states import Failed, State

from specdistill.pipeline.nightly_recipe import NightlyConfig, load_nightly_config
from specdistill.pipeline.outputs import NightlyRun, Untrained, Window
from specdistill.pipeline.report import report_table, write_report
from specdistill.pipeline.stage_budgets import StageClock, run_deadline
from specdistill.pipeline.stages.bench import Role, measured_drafters
from specdistill.pipeline.stages.champion import started_from
from specdistill.pipeline.stages.pool import pool_report
from specdistill.pipeline.tail import TailReserve
from specdistill.state_lock import state_lock
from tasks import nightly as t


@flow(name="nightly-distill", log_prints=True)
def nightly(config_path: str | None = None, overrides: list[str] | None = None,
            window_days: float | None = None, budget_minutes: float | None = None) -> NightlyRun:
    with state_lock("nightly-distill"):  # one run per state directory (a deployment's as much as a command's)
        return _nightly(config_path, overrides, window_days, budget_minutes)


def _nightly(config_path: str | None, overrides: list[str] | None, window_days: float | None,
             budget_minutes: float | None) -> NightlyRun:
    overrides = list(overrides or [])
    if window_days is not None:
        overrides.append(f"window.days={window_days}")
    if budget_minutes is not None:
        overrides.append(f"train.optim.max_minutes={budget_minutes}")
    config = load_nightly_config(config_path, overrides)  # a config error fails before any work
    log = get_run_logger()
    deadline_at, clock = run_deadline(config), StageClock()  # deadline_minutes, shared by the budgeted stages

    target = t.load_target(config)
    for source in config.sources:
        t.ingest_logs(source, config)
    window = t.select_window(config)

    fp = target.fingerprint
    champion = t.current_champion(config)
    # training goes on from the champion (or a newer draft that measured no worse beside it), or from the
    # newest draft of the kind being trained registered for this target version when there is none or it
    # is of the other kind
    start = t.training_start(config, fp, champion)
    warm_start = t.align_vocab(config, start)  # after a target update: the champion carried over to it
    same = start is not None and champion is not None and start.version == champion.version
    champion_draft = warm_start if same else t.align_vocab(config, champion) if champion else None  # measured beside
    if champion_draft is not None and not champion_draft.usable:
        champion_draft = None  # its shapes do not fit this target: nothing to measure it on

    clock.lap("ingest, window, target")
    # the tail is kept first: from the start the run reserves the time a benchmark of the draft it trains needs (the
    # gate, registration and the serving config have theirs in `deadline_at`), and answers the held-out prompts it is
    # measured on; the answers, the training and the generic baseline share what that leaves (`pipeline.tail`)
    reserve = t.reserve_tail(config, window, champion_draft is not None)
    heldout_data = t.generate_responses(config, window, "eval", fp, record_teacher=False)
    clock.lap("held-out answers, tail reserve")
    if (untrained := reserve.leaves_nothing(deadline_at)) is not None:
        return _untrained(config, window, clock, reserve, untrained)
    train_data = t.generate_responses(config, window, "train", fp, record_teacher=True,
                                      deadline_at=reserve.cut(config, "answers", deadline_at))
    if train_data.answers < len(window.train):
        clock.cuts.append(f"target answers: {train_data.answers} of {len(window.train)} train prompts answered")
    if train_data.engine_choice:
        clock.notes.append(train_data.engine_choice)
    clock.lap("answers")
    pooled = t.pool_answers(config, window, train_data, heldout_data, fp)  # tonight's answers join the pool
    trained = t.distill(config, pooled, heldout_data, warm_start.dir if warm_start and warm_start.usable else None,
                        fp, reserve.cut(config, "distill", deadline_at))
    if isinstance(trained, Untrained):  # no time was left to train: the night says why and fails, serving as it was
        return _untrained(config, window, clock, reserve, trained)
    clock.lap("pool, distill")

    generic = None
    if config.bench.generic_draft:  # optional: skipped when the run cannot give it half its budget
        generic = t.generic_baseline(config, window, heldout_data, fp, reserve.cut(config, "generic", deadline_at))
        if isinstance(generic, Untrained):
            clock.skipped.append(f"the generic baseline ({generic.reason})")
            generic = None
    # the target's own train answers as a draft, alone and beside the challenger
    suffix_corpus = t.suffix_corpus(config, train_data, fp) if config.bench.suffix else None
    drafters = measured_drafters(config, trained, champion_draft, generic, suffix_corpus)
    clock.lap("generic baseline, suffix corpus")
    # the challenger (and the champion) always, the other entries while they fit the time left
    results = t.benchmark(config, window, drafters, fp, deadline_at)
    clock.cuts += sorted({f"benchmark: {r.budget_note}" for r in results.values() if r.budget_note})
    measured = {name: spec for name, spec in drafters.items() if name in results}
    speeds = t.engine_benchmark(config, window, measured, fp, deadline_at) if config.serving.engine != "harness" else None
    clock.cuts += sorted({f"engine benchmark: {r.budget_note}" for r in (speeds or {}).values() if r.budget_note})

    clock.lap("benchmark")
    verdict = t.gate(config, results[Role.CHALLENGER], results.get(Role.CHAMPION), results, speeds)
    serving = t.choose_serving(config, window, results, verdict, speeds)
    trained_on = pool_report(pooled, trained.stale_dropped, train_data) + "\n\n" + started_from(warm_start, champion, fp)
    report = report_table(results, verdict, serving=serving, target=target, speeds=speeds) + "\n\n" + trained_on
    report_path = write_report(report, window)
    registered = t.register(config, target, window, trained, results, verdict,
                            champion.version if champion else None, report_path, speeds, warm_start)
    promoted = None
    if verdict.promote:
        promoted = t.promote(config, registered, target, champion.version if champion else None, serving)
    else:
        t.write_serving(config, target, serving, champion)

    clock.lap("gate, register, serving config")
    report = (report_table(results, verdict, registered, promoted, serving, target, speeds) + "\n\n" + trained_on
              + "\n\n" + stage_times(config, clock, reserve))
    write_report(report, window, report_path)
    create_markdown_artifact(report, key="nightly-benchmark", description="draft vs champion and baselines")
    log.info("\n%s", report)
    t.mark_success(config, "nightly", fp)  # only a run that got here counts as a success
    if config.retention_days is not None:  # then what is older than the operator keeps goes (a draft's window stays)
        log.info("%s", t.prune(config))
    return NightlyRun(target, window.key, pooled.pool, warm_start, results, verdict, registered, promoted, serving, report)


def stage_times(config: NightlyConfig, clock: StageClock, reserve: TailReserve) -> str:
    """The report's last lines: each stage's minutes, what the tail's reserve kept and cut, what was skipped."""
    clock.cuts += reserve.cuts
    return clock.report(config) + (f"\n{reserve.describe()}" if reserve.describe() else "")


def _untrained(config: NightlyConfig, window: Window, clock: StageClock, reserve: TailReserve,
               untrained: Untrained) -> State:
    """A night that could not train: its report says why, the champion and serving.json stay as they were, and the
    run fails with that one sentence (a deadline's doing, not a bug: no traceback)."""
    clock.lap("until it stopped")
    report = f"**no draft trained tonight**: {untrained.reason}\n\n" + stage_times(config, clock, reserve)
    write_report(report, window)
    create_markdown_artifact(report, key="nightly-benchmark", description="why no draft was trained tonight")
    get_run_logger().info("\n%s", report)
    return Failed(message=untrained.reason)


if __name__ == "__main__":
    nightly()
