"""The speculative decoding engine: target-only baseline, draft model, self-speculation, n-gram.

    from specdistill.speculative import generate, SelfSpecDrafter, SamplingConfig
    result = generate(target, prompt_ids, max_new_tokens=64, drafter=SelfSpecDrafter(target, 12), gamma=4)
    result.output_ids, result.stats.acceptance_rate, result.stats.accepted_length
"""

from specdistill.speculative.drafters import (
    Drafter,
    ModelDrafter,
    NgramDrafter,
    SelfSpecDrafter,
    early_exit_model,
    make_drafter,
)
from specdistill.speculative.eagle import EagleDrafter
from specdistill.speculative.engine import (
    GenerationResult,
    SpecStats,
    context_length,
    default_stop_ids,
    generate,
)
from specdistill.speculative.sampling import SamplingConfig, probs_from_logits, verify
from specdistill.speculative.specs import DrafterSpec, drafter_from_spec

__all__ = [
    "Drafter",
    "DrafterSpec",
    "EagleDrafter",
    "GenerationResult",
    "ModelDrafter",
    "NgramDrafter",
    "SamplingConfig",
    "SelfSpecDrafter",
    "SpecStats",
    "context_length",
    "default_stop_ids",
    "drafter_from_spec",
    "early_exit_model",
    "generate",
    "make_drafter",
    "probs_from_logits",
    "verify",
]
