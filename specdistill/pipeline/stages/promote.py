"""Stage: a challenger that passed the gate becomes the champion, with the serving config, together or
not at all."""

from __future__ import annotations

from specdistill.ops import registry
from specdistill.ops.registry import RegisteredDraft
from specdistill.ops.serving import serving_path
from specdistill.pipeline.nightly_recipe import NightlyConfig
from specdistill.pipeline.outputs import Promoted, ServingDecision, TargetInfo
from specdistill.pipeline.serving import serving_config


def promote(config: NightlyConfig, registered: RegisteredDraft, target: TargetInfo, expected_champion: str | None,
            serving: ServingDecision) -> Promoted:
    """Alias `champion` and the serving config, together or not at all (see registry.promote). The
    serving config names the mode `serve.choose_serving` picked, which need not be the new draft."""
    draft_dir = registry.download_draft(registered.model_uri)
    cfg = serving_config(serving, target, registered.version, str(draft_dir))
    registry.promote(registered.name, registered.version, cfg, expected_champion=expected_champion,
                     serving_path=config.serving_path)
    return Promoted(version=registered.version, serving_config=str(config.serving_path or serving_path()))
