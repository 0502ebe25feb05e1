"""`specdistill distill`: train a draft from its target (also under torchrun: `-m specdistill.cli distill`)."""

from __future__ import annotations

import argparse
import os

from specdistill.acceptance import DEFAULT_GAMMA
from specdistill.cli.common import Subcommands, command, emit


def cmd_distill(args: argparse.Namespace) -> int:
    from specdistill.distill.distill_recipe import load_config  # lazy: CLI start-up
    from specdistill.distill.train import distill  # lazy: CLI start-up

    config = load_config(args.config, args.overrides)  # fails on unknown keys before any work
    result = distill(config)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun only rank 0 reports
        return 0
    last = result.curve[-1] if result.curve else {}
    text = (f"{result.steps} steps, {result.tokens} tokens, {result.train_minutes:.1f} min, loss {result.loss:.4f}"
            + (f", held-out acceptance {last['acceptance']:.3f}, tau({DEFAULT_GAMMA}) {last['tau']:.2f}" if "acceptance" in last else "")
            + f" -> {result.draft_dir}")
    emit(args, result.result_json(), text)
    return 0


def register(sub: Subcommands) -> None:
    p = command(sub, "distill", cmd_distill, "distill a draft from its target (YAML config, key=value overrides)",
                example="distill --config deploy/distill/demo.yaml optim.lr=3e-4 loss.kind=jsd")
    p.add_argument("--config", default=None, help="YAML file; see specdistill.distill.distill_recipe.DistillConfig")
    p.add_argument("overrides", nargs="*", help="dotted overrides such as optim.lr=3e-4 loss.kind=jsd")
