"""Stage: the challenger into the MLflow registry with its numbers, curves, artifacts and lineage."""

from __future__ import annotations

from specdistill.data.results import BenchResult
from specdistill.ops import registry
from specdistill.ops.policy import FIRST_POSITION_TAG, SHAPE_GAMMA_TAG, SHAPE_TREE_TAG, GateVerdict, Role, first_position
from specdistill.ops.registry import RegisteredDraft
from specdistill.pipeline.nightly_recipe import NightlyConfig
from specdistill.pipeline.outputs import NO_WORSE_TAG, TargetInfo, Trained, WarmStart, Window
from specdistill.pipeline.report import registration_artifacts, registration_metrics, train_losses


def flat_params(section: dict, prefix: str = "") -> dict:
    """A nested config as MLflow params: one dotted key per setting (`optim.lr`), as the YAML names it."""
    flat = {}
    for key, value in section.items():
        if isinstance(value, dict):
            flat.update(flat_params(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


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
