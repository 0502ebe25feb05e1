"""`specdistill target register|history`, `monitor run|sample|serve` and `serving show`: the target
being served, the draft's acceptance on it, and what the serving engine is told to run."""

from __future__ import annotations

import argparse
import contextlib
import sys
from datetime import datetime, timezone

from specdistill import bounds
from specdistill.acceptance import DEFAULT_GAMMA
from specdistill.cli.common import (
    Subcommands,
    add_db,
    add_threads,
    command,
    count_in,
    emit,
    fail,
    group,
    log_store,
    number_in,
    port_number,
    printable,
    set_threads,
)


def cmd_target_register(args: argparse.Namespace) -> int:
    from specdistill.ops.targets import name_holder, register_target  # lazy: CLI start-up

    now = datetime.now(timezone.utc)
    holders = {name: name_holder(name, now) for name in dict.fromkeys(args.served_name or ())}
    version = register_target(args.path, served_names=args.served_name or ())
    for name, holder in holders.items():
        if holder is not None and holder != version.fingerprint:
            print(printable(f"specdistill: served name {name!r} moves from target {holder} to {version.fingerprint} from now on; "
                  "responses logged under it before now stay the other version's (not this version's own answers)"),
                  file=sys.stderr)
    emitted = False
    if not args.no_event:
        from flows.events import emit_target_updated  # lazy: Prefect, only when an event is sent

        emitted = emit_target_updated(version.to_dict())
    payload = {**version.to_dict(), "event_emitted": emitted}
    emit(args, payload, f"target {version.fingerprint} ({version.path}) is the current version"
         + ("; emitted specdistill.target.updated" if emitted else ""))
    return 0


def cmd_target_history(args: argparse.Namespace) -> int:
    from specdistill.ops.targets import target_history  # lazy: CLI start-up

    versions = [v.to_dict() for v in target_history()]
    lines = [f"{v['registered_at']}  {v['fingerprint']}  {v['path']}"
             + (f"  served as {', '.join(v['served_names'])}" if v["served_names"] else "") for v in versions] or ["no target registered"]
    emit(args, {"versions": versions}, "\n".join(lines))
    return 0


def cmd_monitor_run(args: argparse.Namespace) -> int:
    from specdistill.pipeline.monitor_recipe import load_monitor_config  # lazy: CLI start-up

    load_monitor_config(args.config, args.overrides)  # a bad file or key fails here, before Prefect starts
    from flows.monitor import monitor  # lazy: Prefect, only when a flow runs
    from flows.runner import FlowStopped, run_flow, stopped_message  # lazy: the CLI imports flows/ only to run one

    try:
        outcome = run_flow(monitor, config_path=args.config, overrides=args.overrides)
    except FlowStopped as stop:  # SIGTERM/SIGINT: the runs are marked, a rerun resumes
        message = stopped_message(stop, "the monitor flow")
        return fail(getattr(args, "json", False), message, stop.exit_code, line=message)
    emit(args, outcome, outcome.report or f"decision: {outcome.decision}")
    return 0


def cmd_monitor_sample(args: argparse.Namespace) -> int:
    from specdistill.ops.policy import judge_acceptance  # lazy: CLI start-up
    from specdistill.ops.replay import replay_acceptance  # lazy: CLI start-up

    set_threads(args)
    with log_store(args) as store:
        sample = replay_acceptance(args.target, args.draft, store, n_prompts=args.n, gamma=args.gamma,
                                   max_new_tokens=args.max_new_tokens, draft_version=args.draft_version,
                                   min_draft_tokens=args.min_draft_tokens)
    decision, why = judge_acceptance(sample, *([] if args.threshold is None else [args.threshold]))
    payload = {**sample.to_dict(), "decision": decision, "decision_reason": why}
    if sample.ok:
        text = (f"first-position acceptance {sample.first_position_acceptance:.3f}   acceptance rate α {sample.acceptance_rate:.3f}"
                f" at γ={sample.gamma}   mean accepted length τ {sample.mean_accepted_length:.3f}"
                f"   ({sample.counts.accepted}/{sample.counts.proposed} draft tokens, {sample.requests} requests)"
                f"\ndecision: {decision}: {why}" + (f"\n{sample.reason}" if sample.reason else ""))
    else:
        text = f"no sample: {sample.reason}"
    emit(args, payload, text)
    return 0


def cmd_monitor_serve(args: argparse.Namespace) -> int:
    from specdistill.ops.metrics import check_listen_address, listens_everywhere, serve_metrics  # lazy: CLI start-up

    check_listen_address(args.port, args.host)  # before the log store opens

    def listening(url: str) -> None:  # only once the port is bound: a bind error is the one line printed
        print(f"serving metrics on {url} (refresh every {args.interval:g} s)", file=sys.stderr)
        if listens_everywhere(args.host):
            print(f"specdistill: warning: --host {args.host} listens on every interface: the metrics (target and draft "
                  "versions, acceptance, serving mode) are public to every network that reaches this machine; "
                  "--host 127.0.0.1 keeps them local", file=sys.stderr)

    with log_store(args) as store:
        with contextlib.suppress(KeyboardInterrupt):
            serve_metrics(store, args.port, args.host, args.interval, args.serving, on_listening=listening)
    return 0


def cmd_serving_show(args: argparse.Namespace) -> int:
    from specdistill.ops.serving import read_serving_config, serving_path  # lazy: CLI start-up

    config = read_serving_config(args.path)
    where = args.path or serving_path()
    if config is None:
        emit(args, {"path": str(where), "config": None}, f"no serving config at {where}")
        return 1
    emit(args, {"path": str(where), "config": config.to_dict()}, f"{where}\n{config.render()}")
    return 0


MIN_REFRESH_S = 0.1  # as ops.metrics.MIN_REFRESH_S (not imported here: the parser loads no library module)


def register(sub: Subcommands) -> None:
    target = group(sub, "target", "target versions")
    p = command(target, "register", cmd_target_register, "record a target (its fingerprint and location) as the current version",
                example="target register models/target-v2 --no-event")
    p.add_argument("--no-event", action="store_true", help="do not emit the specdistill.target.updated Prefect event")
    p.add_argument("--served-name", action="append", metavar="NAME",
                   help="a model name production logs this version's responses under (an OpenAI log's `model`); "
                        "those responses are its own answers, trained on as they are (repeatable)")
    p.add_argument("path", help="HF directory, .gguf file or 'demo'")
    command(target, "history", cmd_target_history, "every recorded target version, oldest first", example="target history")

    monitor = group(sub, "monitor", "acceptance monitoring")
    p = command(monitor, "run", cmd_monitor_run, "run the monitoring flow once: sample acceptance, fall back and retrain below 50%",
                example="monitor run --config deploy/monitor/monitor.yaml replay_prompts=8")
    p.add_argument("--config", default=None,
                   help="monitor YAML config (default: the code's defaults in specdistill/pipeline/monitor_recipe.py)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. replay_prompts=8")
    p = command(monitor, "sample", cmd_monitor_sample, "replay the newest logged prompts: the draft's acceptance on the target",
                example="monitor sample --target demo --draft models:/draft@champion --n 16 --threads 1")
    p.add_argument("--target", default="demo")
    p.add_argument("--draft", required=True, help="draft directory or models:/NAME@champion")
    p.add_argument("--draft-version", default=None, help="version recorded with the samples (default: the reference)")
    p.add_argument("--n", type=count_in(bounds.MAX_PROMPTS), default=16, help="prompts to replay")
    p.add_argument("--gamma", type=count_in(bounds.MAX_GAMMA), default=DEFAULT_GAMMA)
    p.add_argument("--max-new-tokens", type=count_in(bounds.MAX_NEW_TOKENS), default=48)
    p.add_argument("--min-draft-tokens", type=count_in(bounds.MAX_TOKENS), default=100, help="fewer proposed tokens: no sample")
    p.add_argument("--threshold", type=number_in(0.0, 1.0), default=None, help="first-position acceptance under which: fallback (0.5)")
    add_db(p)
    add_threads(p)
    p = command(monitor, "serve", cmd_monitor_serve, "expose the spec-decode metrics over HTTP, fed from the log store",
                example="monitor serve --port 9464 --interval 15")
    p.add_argument("--port", type=port_number, default=9464)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--interval", type=number_in(MIN_REFRESH_S), default=15.0, help="seconds between refreshes from the log store")
    add_db(p)
    p.add_argument("--serving", default=None, help="serving config (default: $SPECDISTILL_HOME/serving.json)")

    serving = group(sub, "serving", "serving config")
    p = command(serving, "show", cmd_serving_show, "print the current serving config", example="serving show")
    p.add_argument("--path", default=None, help="default: $SPECDISTILL_HOME/serving.json")
