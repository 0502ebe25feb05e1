"""Stage: the registry's champion, and where tonight's training starts (the champion, or a newer or
same-kind draft registered for this target), said in words for the report."""

from __future__ import annotations

from specdistill.ops import registry
from specdistill.pipeline.nightly_recipe import NightlyConfig
from specdistill.pipeline.outputs import NO_WORSE_TAG, Champion, WarmStart


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
    """`draft_model` or `eagle3`: the version's tag (`layers` read as draft_model), or its files for a version
    registered without one."""
    return registry.read_tag(draft.tags, "draft_kind") or registry.draft_kind_tags(draft.dir)["draft_kind"]


def _registered(name: str, mv) -> Champion | None:
    if mv is None:
        return None
    return Champion(name=name, version=str(mv.version), dir=str(registry.download_draft(f"models:/{name}/{mv.version}")),
                    tags=dict(mv.tags))


def started_from(warm_start: WarmStart | None, champion: Champion | None, target_fingerprint: str | None = None) -> str:
    """The report's line on where tonight's training started, and why there."""
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
    why = (f"the champion, version {champion.version}, is of kind {draft_kind(champion)}" if champion is not None
           else "there is no champion")
    if warm_start is None:
        return f"training started from the target's weights (no draft of this kind registered for this target; {why})"
    verdict = warm_start.tags.get("gate_verdict", "unknown")
    return (f"training started from version {warm_start.version}, the newest draft of this kind registered for "
            f"this target (gate {verdict}; {why})")
