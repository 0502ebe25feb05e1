"""MLflow: one experiment and one registered model per target; aliases `challenger` and `champion`.

A draft is logged as a pyfunc model (models from code, no pickle) whose artifact is the plain HF
checkpoint directory, registered as a version with tags (target fingerprint, data window, gate
verdict, parent version). Promotion moves `champion` and writes the serving config together or not
at all, under a lock so two runs started at once cannot both promote.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlflow
from mlflow.exceptions import MlflowException

from specdistill import paths
from specdistill.env import mask_secrets
from specdistill.modeling.mlflow_refs import (  # noqa: F401
    DRAFT_ARTIFACT,
    FILES_TAG,
    RegisteredDraftChanged,
    client,
    download_draft,
    draft_files_sha256,
    tracking_uri,
)
from specdistill.ops.policy import Role
from specdistill.ops.serving import (
    ServingConfig,
    ServingConfigError,
    read_serving_config,
    write_serving_config,
)
from specdistill.ops.serving import serving_path as default_serving_path
from specdistill.speculative.specs import DrafterSpec, draft_kind_name

log = logging.getLogger(__name__)

CHAMPION = Role.CHAMPION.value  # the registry aliases: the best draft, and the newest registered one
CHALLENGER = Role.CHALLENGER.value


def model_name_for(target_name: str) -> str:
    """The registered model holding every draft of one target."""
    return "draft-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", target_name).strip("-")


def experiment_for(target_name: str) -> str:
    name = f"specdistill/{target_name}"
    c = client()
    existing = c.get_experiment_by_name(name)
    if existing is not None:
        return existing.experiment_id
    artifact_location = None
    if tracking_uri().startswith("sqlite:"):
        artifact_location = (paths.ensure_private(paths.registry_artifacts_dir()) / re.sub(r"\W+", "-", target_name)).as_uri()
    try:
        return c.create_experiment(name, artifact_location=artifact_location)
    except MlflowException:  # created concurrently by another run
        return c.get_experiment_by_name(name).experiment_id


@dataclass
class RegisteredDraft:
    name: str
    version: str
    run_id: str
    model_uri: str


def draft_kind_tags(draft_dir: str | Path) -> dict[str, str]:
    """Lineage tags every version carries: its kind (as serving.json names it), and what that kind records
    about its draft (`Kind.tags`: for an EAGLE-3 head the target layers it reads, since a head is only valid on
    a target whose features it was trained on)."""
    kind = DrafterSpec.for_draft(draft_dir).of
    return {"draft_kind": kind.draft_kind, **kind.tags(str(draft_dir))}


def register_draft(
    draft_dir: str | Path,
    *,
    target_name: str,
    params: dict | None = None,
    metrics: dict[str, float] | None = None,
    curves: dict[str, list[float]] | None = None,
    artifacts: list[str | Path] = (),
    tags: dict[str, str] | None = None,
    run_name: str | None = None,
) -> RegisteredDraft:
    """Log a run with the draft as a model, register it as a new version, and alias it `challenger`. The
    version records its files' SHA-256 (`FILES_TAG`), checked whenever it is resolved."""
    c = client()
    name = model_name_for(target_name)
    experiment_id = experiment_for(target_name)
    tags = {**draft_kind_tags(draft_dir), **{k: str(v) for k, v in (tags or {}).items()}}
    files = json.dumps(draft_files_sha256(draft_dir), sort_keys=True)
    with mlflow.start_run(experiment_id=experiment_id, run_name=run_name) as run:
        if params:
            mlflow.log_params({k: mask_secrets(str(v))[:500] for k, v in params.items()})
        if metrics:
            mlflow.log_metrics({k: float(v) for k, v in metrics.items()})
        for key, values in (curves or {}).items():
            for step, value in enumerate(values):
                mlflow.log_metric(key, float(value), step=step)
        for path in artifacts:
            mlflow.log_artifact(str(path))
        mlflow.set_tags(tags)
        info = mlflow.pyfunc.log_model(
            name=DRAFT_ARTIFACT,
            python_model=str(Path(__file__).with_name("mlflow_draft.py")),
            artifacts={DRAFT_ARTIFACT: str(draft_dir)},
            pip_requirements=["torch", "transformers", "safetensors"],
        )
    try:
        c.get_registered_model(name)
    except MlflowException:
        with contextlib.suppress(MlflowException):  # created concurrently
            c.create_registered_model(name, tags={"target": target_name})
    version = c.create_model_version(name, source=info.model_uri, run_id=run.info.run_id, tags={**tags, FILES_TAG: files},
                                     model_id=getattr(info, "model_id", None))
    c.set_registered_model_alias(name, CHALLENGER, version.version)
    return RegisteredDraft(name, str(version.version), run.info.run_id, f"models:/{name}/{version.version}")


def version_by_alias(name: str, alias: str):
    try:
        return client().get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def read_tag(tags: dict[str, str], key: str) -> str | None:
    """A version's tag as this version names it: its `draft_kind` under its one name, whatever name it was
    registered with."""
    return draft_kind_name(tags.get(key)) if key == "draft_kind" else tags.get(key)


def newest_version(name: str, **tags: str):
    """The newest version of `name` whose tags include all of `tags` (None when there is none). Filtered
    here, not in MLflow's filter string, which cannot match a tag whose value is empty, nor read a `draft_kind`
    tag written before under its old name (`layers`, read as `draft_model`)."""
    try:
        versions = client().search_model_versions(f"name = '{name}'")
    except MlflowException:
        return None
    matching = [v for v in versions if all(read_tag(v.tags, k) == value for k, value in tags.items())]
    return max(matching, key=lambda v: int(v.version), default=None)


@contextlib.contextmanager
def promotion_lock() -> Iterator[None]:
    """One promotion at a time on this state directory (a flow-level concurrency limit covers several hosts)."""
    path = paths.ensure(paths.home()) / "promotion.lock"
    with paths.open_private(path, "a+") as f:  # never through a link at its name
        deadline = time.monotonic() + 600.0
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another promotion holds {path}") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _previous_serving(serving_path: str | Path | None) -> ServingConfig | None:
    """The serving config a promotion replaces (restored if the promotion fails). An unreadable file
    does not block the promotion: it is kept beside as `<name>.invalid` and replaced."""
    try:
        return read_serving_config(serving_path)
    except ServingConfigError as exc:
        path = Path(serving_path) if serving_path else default_serving_path()
        keep = path.with_name(path.name + ".invalid")
        try:
            paths.atomic_copy(path, keep)  # beside it, renamed into place: never through a link at `keep`
        except (OSError, ValueError) as why:  # not a regular file (a FIFO, a directory): nothing to keep
            log.warning("%s: replacing it (its content cannot be kept: %s)", exc, why)
        else:
            log.warning("%s: replacing it (its content is kept in %s)", exc, keep)
        return None


class PromotionConflict(RuntimeError):
    """The champion changed between the benchmark and the promotion: the comparison is stale."""


def promote(name: str, version: str, serving: ServingConfig, *, expected_champion: str | None,
            serving_path: str | Path | None = None) -> None:
    """Move `champion` to `version` and write the serving config, both or neither. `expected_champion`: the
    version the challenger was benchmarked against (None: none); if another run promoted meanwhile, nothing changes."""
    c = client()
    with promotion_lock():
        current = version_by_alias(name, CHAMPION)
        current_version = str(current.version) if current else None
        if current_version != (str(expected_champion) if expected_champion else None):
            raise PromotionConflict(
                f"champion of {name} is now version {current_version}, not {expected_champion}: benchmark again"
            )
        previous_serving = _previous_serving(serving_path)
        c.set_registered_model_alias(name, CHAMPION, version)
        try:
            write_serving_config(serving, serving_path)
        except BaseException:
            if current_version:
                c.set_registered_model_alias(name, CHAMPION, current_version)
            else:
                c.delete_registered_model_alias(name, CHAMPION)
            if previous_serving is not None:
                write_serving_config(previous_serving, serving_path)
            raise
        c.set_model_version_tag(name, version, "promoted_at", time.strftime("%Y-%m-%dT%H:%M:%S"))
