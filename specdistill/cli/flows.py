"""`specdistill pipeline run` and `specdistill demo [run] | demo target-update`: the nightly flow, now
(`demo`: on the demo recipe, deploy/nightly/demo.yaml).

The flows are the one place Prefect is imported; the library never imports it, and this module
imports `flows.*` only inside the handlers.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specdistill import bounds
from specdistill.cli.common import (
    Subcommands,
    add_out,
    add_threads,
    command,
    count_in,
    emit,
    fail,
    group,
    number_in,
    set_threads,
)


def cmd_nightly(args: argparse.Namespace) -> int:
    """`pipeline run` and `demo [run]` (which has no --config: the demo recipe, deploy/nightly/demo.yaml)."""
    from specdistill.ops.serving import serving_path  # lazy: CLI start-up
    from specdistill.pipeline.nightly_recipe import DEMO_RECIPE, load_nightly_config  # lazy: CLI start-up

    config_path = str(DEMO_RECIPE) if getattr(args, "demo", False) else args.config
    overrides = list(args.overrides)
    config = load_nightly_config(config_path, overrides)  # a bad key fails here, before Prefect is imported
    from flows.nightly import nightly  # lazy: Prefect, only when a flow runs
    from flows.runner import FlowStopped, run_flow, stopped_message  # lazy: the CLI imports flows/ only to run one

    try:
        result = run_flow(nightly, config_path=config_path, overrides=overrides)
    except FlowStopped as stop:  # SIGTERM/SIGINT: the runs are marked, a rerun resumes
        message = stopped_message(stop, "the nightly flow")
        return fail(getattr(args, "json", False), message, stop.exit_code, line=message)
    text = result.report  # the table, the gate, the serving choice, the registered version and its alias
    if not result.promoted:  # a promotion names the file in the report already
        text += f"\nserving config: {config.serving_path or serving_path()}"
    emit(args, result, text)
    return 0


def cmd_demo_target_update(args: argparse.Namespace) -> int:
    from specdistill.modeling.models import load_model  # lazy: CLI start-up
    from specdistill.ops.demo_update import default_update_dir, load_update_meta, make_target_update  # lazy: CLI start-up
    from specdistill.state_lock import state_lock_for  # lazy: CLI start-up

    set_threads(args)
    out = Path(args.out) if args.out else default_update_dir()
    with state_lock_for(out, "demo target-update"):  # the default is inside the state directory
        make_target_update(args.base, out, steps=args.steps, lr=args.lr, top_layers=args.top_layers, force=args.force)
    meta = load_update_meta(out)
    payload = {"out": str(out), "fingerprint": load_model(out).fingerprint, **meta}
    emit(args, payload, f"new target version {payload['fingerprint']} -> {out} "
         f"(vocabulary {meta['vocab_size_before']} -> {meta['vocab_size_after']}, "
         f"loss {meta['losses'][0]:.3f} -> {meta['losses'][-1]:.3f})")
    return 0


class _RunByDefault(argparse._SubParsersAction):
    """Subcommands that also take a key=value word as the first: it and the words after it are the
    `run` subcommand's (`specdistill demo key=value` is `specdistill demo run key=value`)."""

    class _Names(dict):  # name -> parser, as argparse keeps it; it also checks the first word with `in`
        def __contains__(self, word) -> bool:
            return super().__contains__(word) or "=" in word

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.choices = self._name_parser_map = self._Names()

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values[0] not in self.choices.keys():
            values = ["run", *values]
        super().__call__(parser, namespace, values, option_string)


def register(sub: Subcommands) -> None:
    pipeline = group(sub, "pipeline", "the nightly flow")
    p = command(pipeline, "run", cmd_nightly, "run the nightly distillation flow once, now",
                example="pipeline run --config deploy/nightly/nightly.yaml train.optim.max_minutes=2")
    p.add_argument("--config", default=None, help="nightly YAML config (default: the code's defaults, NightlyConfig)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.optim.max_minutes=2")

    demo = command(sub, "demo", cmd_nightly,
                   "run the main job (the nightly flow) on the demo recipe (deploy/nightly/demo.yaml); "
                   "`demo target-update`: a new demo target version",
                   example="demo train.optim.max_minutes=2",
                   description="run the main job (the nightly flow) on the demo recipe, deploy/nightly/demo.yaml")
    demo.usage = "%(prog)s [-h] [--json] [run] [key=value ...]\n       %(prog)s target-update [-h] [--json] ..."
    demo.set_defaults(config=None, overrides=[], demo=True)  # `specdistill demo`, no subcommand: `demo run`
    demo_sub = demo.add_subparsers(dest="demo_command", action=_RunByDefault,
                                   description="`specdistill demo [key=value ...]`, with no subcommand, is `demo run`")
    p = command(demo_sub, "run", cmd_nightly, "the nightly flow on the demo recipe (the default subcommand)",
                example="demo run train.optim.max_minutes=2")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the demo recipe")
    p = command(demo_sub, "target-update", cmd_demo_target_update,
                "a new target version from the demo target: domain tokens + top layers fine-tuned on code",
                example="demo target-update --steps 30 --top-layers 4 --threads 1")
    p.add_argument("--base", default="demo")
    add_out(p, "--out", help="a new directory (default: $SPECDISTILL_HOME/targets/demo-update)")
    p.add_argument("--steps", type=count_in(bounds.MAX_STEPS), default=30)
    p.add_argument("--lr", type=number_in(0.0, low_open=True), default=None, help="default: the measured one (specdistill.ops.demo_update)")
    p.add_argument("--top-layers", type=count_in(bounds.MAX_LAYERS), default=4)
    add_threads(p)
