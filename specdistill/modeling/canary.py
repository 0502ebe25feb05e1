"""A model that cannot be silently garbage: one short forward over a fixed canary prompt at load.

Damaged weights (an overwrite the integrity record did not see, a bad conversion) give logits that
are NaN, infinite or all equal (greedy output: token 0 over and over). Such a target "agrees" with
any drafter: acceptance 1.0, speedups on garbage, a gate that promotes on them. Repeating one token
is not refused: a small randomly initialized model (the tests') legitimately does that.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

CANARY_PROMPT = "The quick brown fox jumps over the lazy dog. def add(a, b): return a + b"
CANARY_TOKENS = 16


class DegenerateModelError(RuntimeError):
    """A model whose output on the canary prompt shows broken weights; the message names its files."""


@torch.no_grad()
def check_canary(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, model_dir: Path) -> None:
    """Refuse a model whose logits on the canary prompt are non-finite or flat (`DegenerateModelError`,
    naming its weights files and, for non-finite values, the first tensor holding one)."""
    vocab_size = model.config.vocab_size
    ids = [i for i in tokenizer(CANARY_PROMPT, add_special_tokens=False)["input_ids"] if 0 <= i < vocab_size]
    ids = ids[:CANARY_TOKENS] or list(range(min(CANARY_TOKENS, vocab_size)))  # fixed ids if the tokenizer gives none
    ids = torch.tensor([ids], device=model.device)
    logits = model(input_ids=ids, use_cache=False).logits.float()
    where = ", ".join(str(p) for p in sorted(Path(model_dir).glob("*.safetensors"))) or str(model_dir)
    if not torch.isfinite(logits).all():
        tensor = next((name for name, t in model.state_dict().items()
                       if t.is_floating_point() and not torch.isfinite(t).all()), None)
        detail = f" (tensor {tensor} holds NaN or infinite values)" if tensor else ""
        raise DegenerateModelError(f"{where}: the model's logits on the canary prompt are not finite{detail}: "
                                   "its weights are damaged; refusing it before anything is measured")
    top, bottom = logits.amax(-1), logits.amin(-1)
    if bool(((top - bottom) <= 1e-6 * top.abs().clamp(min=1.0)).all()):
        raise DegenerateModelError(f"{where}: the model's logits on the canary prompt are the same for every token "
                                   "(its greedy output is token 0 over and over): its weights are damaged; refusing "
                                   "it before anything is measured")
