"""Speculative decoding: the decoding loop (`decode.generate`, gpt-fast's `speculative_decode`) and the
drafters whose proposals it verifies. "Engine" names what runs the target (the harness, this project's
PyTorch engine, which decodes through this loop; llama.cpp and vLLM in `specdistill.engines`), never the loop.

Target-only decoding (no drafter) is the baseline. The drafter kinds are the modules of `kinds/`, which
register them in `specs.KINDS` (the list to trust): a layer draft (a small LM with the target's tokenizer),
self-speculation (the target's first layers), n-gram (the request's own history), suffix (a corpus of past
answers), hybrid (suffix where its match is confident, a draft model elsewhere) and an EAGLE-3 head.

    from specdistill.speculative import generate, SelfSpecDrafter, SamplingConfig
    result = generate(target, prompt_ids, max_new_tokens=64, drafter=SelfSpecDrafter(target, 12), gamma=4)
    result.output_ids, result.stats.counts.acceptance_rate, result.stats.counts.accepted_length
"""

from __future__ import annotations

import importlib
from typing import Any

from specdistill.speculative import kinds  # noqa: F401  registers the drafter kinds (torch-free)

# name -> its module. Loaded on first use (PEP 562), so that the drafter specs (`specs`: kinds, serving
# modes) are read by `serving show` and the metrics without importing torch.
_HOMES = {
    "Drafter": "drafters", "ModelDrafter": "drafters", "NgramDrafter": "drafters", "SelfSpecDrafter": "drafters",
    "early_exit_model": "drafters",
    "EagleDrafter": "eagle",
    "GenerationResult": "decode", "SpecStats": "decode", "context_length": "decode", "default_stop_ids": "decode",
    "generate": "decode",
    "SamplingConfig": "sampling", "probs_from_logits": "sampling", "verify": "sampling",
    "DrafterSpec": "specs", "drafter_from_spec": "specs",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)


__all__ = sorted(_HOMES)
