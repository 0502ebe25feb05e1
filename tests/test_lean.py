"""The lean forward computes transformers' forward: prefill, decode steps, verifications, draft trees,
left-padded batches, and the features a hook on the layers would capture."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from specdistill.modeling.attention import decode_attention_for
from specdistill.modeling.feature_hooks import FeatureHooks
from specdistill.modeling.kv_cache import preallocated_cache
from specdistill.modeling.lean import causal_mask, lean_forward, supports_lean
from tests.conftest import lively, make_tiny_llama


@pytest.fixture(params=["sdpa", "decode"])
def model(request):
    """The tiny model on SDPA, or inside `decode_attention_for` (the matmul attention; transformers too)."""
    m = lively(make_tiny_llama(), seed=7).to(torch.float64)
    m.set_attn_implementation("sdpa")
    if request.param == "sdpa":
        yield m.eval()
    else:
        with decode_attention_for(m):
            yield m.eval()


def hf_step(model, ids, cache, **kwargs):
    return model(input_ids=ids, cache=cache, use_cache=True, **kwargs).logits


@pytest.mark.parametrize("preallocated", [False, True])
def test_prefill_steps_and_verifications_match_transformers(model, preallocated):
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    ours = preallocated_cache(model, 1, 32) if preallocated else DynamicCache(config=model.config)
    theirs = DynamicCache(config=model.config)
    with torch.inference_mode():
        for a, b in [(0, 9), (9, 10), (10, 14), (14, 15), (15, 20)]:  # prefill, step, verification of 4, step, 5
            logits, features = lean_forward(model, ids[:, a:b], ours, keep=b - a, capture=[0, 2])
            with FeatureHooks(model, [0, 2]) as hooks:
                expected = hf_step(model, ids[:, a:b], theirs)
                torch.testing.assert_close(features, hooks.take(), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(logits, expected, rtol=1e-10, atol=1e-10)
        assert ours.get_seq_length() == theirs.get_seq_length() == 20


def test_a_tree_mask_and_positions_match_transformers(model):
    """A draft tree: two siblings at the same position, each seeing only the pending token."""
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(1))
    tree = torch.tensor([[5, 6, 7]])
    visible = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(3, 8, dtype=torch.bool), visible], dim=1)[None, None]
    positions = torch.tensor([[8, 9, 9]])
    with torch.inference_mode():
        caches = [DynamicCache(config=model.config) for _ in range(2)]
        for c in caches:
            hf_step(model, ids, c)
        logits, _ = lean_forward(model, tree, caches[0], positions=positions, mask=mask, keep=3)
        expected = hf_step(model, tree, caches[1], attention_mask=mask, position_ids=positions)
    torch.testing.assert_close(logits, expected, rtol=1e-10, atol=1e-10)


def test_a_left_padded_batch_step_matches_transformers(model):
    ids = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(2))
    attention = torch.ones(2, 7, dtype=torch.long)
    attention[0, :2] = 0
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    step = torch.tensor([[11], [12]])
    with torch.inference_mode():
        caches = [DynamicCache(config=model.config) for _ in range(2)]
        for c in caches:
            model(input_ids=ids, attention_mask=attention[:, :6], position_ids=positions[:, :6], cache=c, use_cache=True)
        logits, _ = lean_forward(model, step, caches[0], positions=positions[:, 6:], mask=attention.bool()[:, None, None])
        expected = hf_step(model, step, caches[1], attention_mask=attention, position_ids=positions[:, 6:])
    torch.testing.assert_close(logits, expected, rtol=1e-10, atol=1e-10)


def test_causal_mask_and_support():
    assert causal_mask(2, 2)[0, 0].tolist() == [[True, True, True, False], [True, True, True, True]]
    m = make_tiny_llama()
    m.set_attn_implementation("sdpa")
    assert supports_lean(m.eval())
    assert not supports_lean(m.train())
    m.eval().set_attn_implementation("eager")
    assert not supports_lean(m)


@pytest.mark.parametrize("hidden", [64, 576])
def test_rms_norm_is_bit_identical_to_llama_rms_norm_in_bf16(hidden):
    """One kernel on the bf16 input (no float32 copy) rounds exactly where `LlamaRMSNorm` does."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from specdistill.modeling.lean import rms_norm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(hidden, eps=1e-5).to(torch.bfloat16)
    norm.weight.data = (torch.randn(hidden) * 0.5 + 1).to(torch.bfloat16)
    for scale in (1e-2, 1.0, 30.0):
        x = (torch.randn(2, 5, hidden) * scale).to(torch.bfloat16)
        assert torch.equal(rms_norm(norm, x), norm(x))
