"""Attention for batched decode steps on a CPU: two small matmuls instead of SDPA's flash kernel.

A decode step has one query per sequence. For it, PyTorch's CPU flash-attention kernel is slow in
bf16: with 16 sequences, the demo target's 9 query heads over 3 key/value heads and ~150 cached
tokens it took 1.3 ms per layer where q·Kᵀ, softmax and ·V as plain batched matmuls took 0.64 ms
(same process, interleaved, 1 thread, busy machine); in a profile of a batched bf16 decode step
SDPA was about half the step. `benchmarks/answer_generation.py` measures the whole effect. Prefill
(more than one query) keeps SDPA. The query heads that share a key/value head are packed into one matmul, so
keys and values are never repeated per head. The result matches SDPA's up to bf16 rounding
(greedy outputs can differ at numerical near-ties).

In bf16, oneDNN's batched matmul takes only dense operands and copies anything else first, so the
views of a preallocated cache's filled part (`modeling.kv_cache`) cost a copy of the keys and the
values in every layer at every step. Keeping the keys transposed does not help (the transposed view
of a part of a buffer is not dense either: still copied inside bmm). A bf16 step over a
preallocated cache therefore attends over the cache's whole buffers, which grow in blocks of 16
columns, with the unfilled columns masked (-inf, an exact 0 after softmax): bit-identical to the
copying path. For 16 rows, 3 kv heads, 1 thread, interleaved (load 2.4): 258 µs against 334 µs a
layer with 170 of 180 columns filled; with 110 of 250 filled the extra columns cost more than the
copies saved (295 against 224 µs), hence the blocks. fp32 keeps the copying path (MKL's exact numbers).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specdistill.modeling.kv_cache import dense_buffers

DECODE_ATTENTION = "specdistill_decode"


def decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [B, H, q, D], key/value [B, KV, L, D] -> ([B, q, H, D], None)."""
    batch, heads, q_len, dim = query.shape
    if q_len != 1 or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    kv_heads, length = key.shape[1], key.shape[2]
    scale = dim**-0.5 if scaling is None else scaling
    q = query.reshape(batch, kv_heads, heads // kv_heads, dim)  # the query heads of one kv head side by side
    dense = dense_buffers(key, value) if value.dtype == torch.bfloat16 else None
    if dense is not None:
        # a preallocated cache's whole buffers (modeling.kv_cache), the columns past `length` masked:
        # oneDNN's bf16 bmm would copy the views of the filled part (it takes only dense operands)
        key, value = dense
        scores = torch.matmul(q, key.transpose(2, 3))  # [B, KV, G, columns]
        scores = torch.add(_additive_mask(attention_mask, batch, length, key.shape[2]), scores, alpha=scale)
        probs = torch.softmax(scores, dim=-1).to(value.dtype)
        out = torch.matmul(probs, value)  # [B, KV, G, D]
        return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None
    # a view into a preallocated cache (modeling.kv_cache) is copied once here: matmul would copy its
    # transpose element by element (3x the time of q·Kᵀ itself in bf16); the same numbers either way
    key = key.contiguous()
    scores = torch.matmul(q, key.transpose(2, 3)) * scale  # [B, KV, G, L]
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs, value)  # [B, KV, G, D]
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


_last_mask: tuple = (None,)


def _additive_mask(mask: torch.Tensor | None, batch: int, length: int, columns: int) -> torch.Tensor:
    """`mask` (transformers' decode-step mask over `length` keys, bool or additive, or None) as a float32
    `[B, 1, 1, columns]` to add: 0 where attended, -inf elsewhere and at every column past `length`.

    Every layer of a forward gets the same mask object: it is converted once (the last one is kept).
    """
    global _last_mask
    if _last_mask[0] is mask and mask is not None and _last_mask[1:] == (batch, length, columns):
        return _last_mask[-1]
    additive = torch.full((batch, 1, 1, columns), float("-inf"))
    if mask is None:
        additive[..., :length] = 0.0
    elif mask.dtype == torch.bool:
        additive[..., :length].masked_fill_(mask.expand(batch, 1, 1, length), 0.0)
    else:
        additive[..., :length] = mask.float().expand(batch, 1, 1, length)
    _last_mask = (mask, batch, length, columns, additive)
    return additive


AttentionInterface.register(DECODE_ATTENTION, decode_attention)
AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)  # the masks SDPA gets (padding included)


@contextmanager
def batched_decode_attention(model: PreTrainedModel) -> Iterator[PreTrainedModel]:
    """Run `model` with `decode_attention` inside the block (only if it uses SDPA), then restore it."""
    before = model.config._attn_implementation
    if before != "sdpa":
        yield model
        return
    model.set_attn_implementation(DECODE_ATTENTION)
    try:
        yield model
    finally:
        model.set_attn_implementation(before)
