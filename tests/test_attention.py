"""Batched decode attention computes what SDPA computes, padding included, and is switched off again."""

from __future__ import annotations

import torch

from specdistill.modeling.attention import DECODE_ATTENTION, batched_decode_attention
from tests.conftest import lively, make_tiny_llama


def test_decode_steps_match_sdpa_on_a_left_padded_batch():
    model = lively(make_tiny_llama(), seed=3).to(torch.float64)
    model.set_attn_implementation("sdpa")
    ids = torch.randint(3, 96, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :4] = 0  # left padding, as batched answer generation pads
    mask[1, :1] = 0
    with torch.inference_mode():
        plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                               output_scores=True, return_dict_in_generate=True, pad_token_id=2, eos_token_id=None)
        with batched_decode_attention(model):
            assert model.config._attn_implementation == DECODE_ATTENTION
            fast = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                  output_scores=True, return_dict_in_generate=True, pad_token_id=2, eos_token_id=None)
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(plain.sequences, fast.sequences)
    for a, b in zip(plain.scores, fast.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # scores come back as float32


def test_a_model_not_on_sdpa_is_left_alone():
    model = make_tiny_llama()
    model.set_attn_implementation("eager")
    with batched_decode_attention(model):
        assert model.config._attn_implementation == "eager"
    assert model.config._attn_implementation == "eager"
