"""Stage: without a promotion, the serving config alone (the champion unchanged)."""

from __future__ import annotations

from specdistill.ops import registry
from specdistill.ops.serving import write_serving_config
from specdistill.pipeline.nightly_recipe import NightlyConfig
from specdistill.pipeline.outputs import Champion, ServingDecision, TargetInfo
from specdistill.pipeline.serving import serving_config


def write_serving(config: NightlyConfig, target: TargetInfo, serving: ServingDecision, champion: Champion | None) -> str:
    """Without a promotion: the serving config for the fastest mode measured this run, written under
    the promotion lock (a concurrent promotion is never half overwritten)."""
    cfg = serving_config(serving, target, champion=champion)
    with registry.promotion_lock():
        return str(write_serving_config(cfg, config.serving_path))
