"""Batched decode attention computes what SDPA computes, padding included, and is switched off again."""

from __future__ import annotations

import torch

from specdistill.modeling.attention import DECODE_ATTENTION, decode_attention, decode_attention_for
from specdistill.modeling.kv_cache import BLOCK, PreallocatedLayer, dense_buffers
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
        with decode_attention_for(model):
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
    with decode_attention_for(model):
        assert model.config._attn_implementation == "eager"
    assert model.config._attn_implementation == "eager"


def test_bf16_steps_over_a_preallocated_cache_attend_over_whole_buffers_with_the_same_numbers():
    """bf16 decode steps read a preallocated cache's whole buffers (the unfilled columns masked): the
    result is bit-identical to attending over copies of the filled part, with or without padding."""
    gen = torch.Generator().manual_seed(0)
    rows, kv_heads, heads, dim, filled = 4, 3, 9, 64, BLOCK + 5
    layer = PreallocatedLayer(*(torch.zeros(rows, kv_heads, BLOCK, dim, dtype=torch.bfloat16) for _ in range(2)),
                              capacity=4 * BLOCK)
    layer.update(*(torch.randn(rows, kv_heads, filled, dim, generator=gen).to(torch.bfloat16) for _ in range(2)))
    assert layer.key_buffer.shape[2] == 2 * BLOCK > filled
    query = torch.randn(rows, heads, 1, dim, generator=gen).to(torch.bfloat16)
    padding = torch.ones(rows, 1, 1, filled, dtype=torch.bool)
    padding[0, ..., :7] = False
    padding[2, ..., :1] = False
    with torch.inference_mode():
        for mask in (padding, None, torch.zeros(rows, 1, 1, filled).masked_fill(~padding, float("-inf"))):
            fast, _ = decode_attention(None, query, layer.keys, layer.values, mask)
            copied, _ = decode_attention(None, query, layer.keys.clone(), layer.values.clone(), mask)
            assert dense_buffers(layer.keys.clone(), layer.values.clone()) is None
            assert fast.shape == (rows, 1, heads, dim)
            assert torch.equal(fast, copied)


def test_a_verification_forward_of_a_few_tokens_matches_sdpa():
    """The k + 1 tokens of a verification attend causally among themselves and to the whole cache."""
    from transformers import DynamicCache

    model = lively(make_tiny_llama(), seed=5).to(torch.float64)
    model.set_attn_implementation("sdpa")
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        outs = []
        for fast in (False, True):
            cache = DynamicCache(config=model.config)
            model(input_ids=ids[:, :7], cache=cache, use_cache=True)
            with decode_attention_for(model) if fast else torch.inference_mode():
                outs.append(model(input_ids=ids[:, 7:], cache=cache, use_cache=True).logits)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-9, atol=1e-9)


def test_a_query_that_sees_no_key_gets_finite_output():
    """A left-padding position of a batched prefill sees no key: finite garbage, never NaN (its cached
    keys and values would spread NaN into every later step through probability 0 × NaN)."""
    query, key, value = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    mask = torch.tensor([[False, False, False], [True, True, False], [True, True, True]])[None, None]
    out, _ = decode_attention(None, query, key, value, mask)
    assert torch.isfinite(out).all()
    reference = torch.nn.functional.scaled_dot_product_attention(query[:, :, 1:], key.repeat_interleave(2, 1),
                                                                 value.repeat_interleave(2, 1), attn_mask=mask[:, :, 1:])
    torch.testing.assert_close(out[:, 1:], reference.transpose(1, 2))
