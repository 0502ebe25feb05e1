"""Attention for decode steps and verifications on a CPU: two small matmuls instead of SDPA's flash kernel.

For the few queries of a decode step or a verification PyTorch's CPU flash-attention kernel is slow
in bf16: one query of the demo target (9 query heads over 3 kv heads, 200 cached tokens) took 190 µs
a layer against about 50 µs as plain matmuls (1 thread); with 16 sequences, ~150 cached tokens, 1.3
ms against 0.64 ms a layer (`benchmarks/experiments/answer_generation.py`, `benchmarks/experiments/decode_vs_hf.py`).
Prefill keeps SDPA. The query heads of one kv head are stacked into one matmul (keys never repeated).
The result matches SDPA's up to rounding; the decoding loop's target-only baseline runs the same attention,
so its lossless checks compare like with like.

In bf16, oneDNN's batched matmul copies any non-dense operand first (a transposed view too), so the
views of a preallocated cache's filled part (`modeling.kv_cache`) cost a copy in every layer at every
step. A bf16 step therefore attends over the cache's whole buffers, grown in blocks of 16 columns,
the unfilled ones masked (an exact 0 after softmax): bit-identical. For 16 rows, 3 kv heads, 1
thread: 258 µs against 334 µs a layer with 170 of 180 columns filled; with 110 of 250 filled the
extra columns cost more than the copies saved (295 against 224 µs), hence the blocks. fp32 keeps
the copying path (MKL's exact numbers).
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


MAX_QUERIES = 16  # forwards of at most this many new tokens per sequence take the matmul path


def decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [B, H, q, D], key/value [B, KV, L, D] -> ([B, q, H, D], None).
    Forwards of at most MAX_QUERIES tokens take the matmul path; prefill and anything unusual go to SDPA."""
    batch, heads, q_len, dim = query.shape
    if (q_len > MAX_QUERIES or (q_len > 1 and attention_mask is None) or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None or kwargs.get("dropout", 0.0)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    kv_heads, length = key.shape[1], key.shape[2]
    group = heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling
    q = query.reshape(batch, kv_heads, group * q_len, dim)  # the query heads of one kv head stacked: no repeated keys
    dense = dense_buffers(key, value) if value.dtype == torch.bfloat16 else None
    if dense is not None:
        # a preallocated cache's whole buffers (modeling.kv_cache), the columns past `length` masked:
        # oneDNN's bf16 bmm would copy the views of the filled part (it takes only dense operands)
        key, value = dense
    else:
        # a view into a preallocated cache is copied once here: matmul would copy its transpose
        # element by element (3x the time of q·Kᵀ itself in bf16); the same numbers either way
        key = key.contiguous()
    columns = key.shape[2]
    scores = torch.matmul(q, key.transpose(2, 3)).view(batch, kv_heads, group, q_len, columns)
    mask = _additive_mask(attention_mask, batch, q_len, length, columns, key.device)  # [B, 1, 1, q, columns] float32
    probs = torch.softmax(torch.add(mask, scores, alpha=scale), dim=-1).to(value.dtype)
    out = torch.matmul(probs.view(batch, kv_heads, group * q_len, columns), value)  # [B, KV, G·q, D]
    return out.view(batch, heads, q_len, dim).transpose(1, 2).contiguous(), None


_last_mask: tuple = (None,)
# a masked score: finite, so that a query that sees no key at all (a left-padding position in a
# batched prefill) gets finite garbage, not NaN that its cached keys and values would spread; still
# an exact 0 after softmax next to any attended key
MASKED = -1e30


def _additive_mask(mask: torch.Tensor | None, batch: int, q_len: int, length: int, columns: int,
                   device: torch.device) -> torch.Tensor:
    """`mask` (bool or additive `[B or 1, 1, q, length]`, or None: every key seen) as a float32
    `[B, 1, 1, q, columns]` to add: MASKED where not attended and past `length`. Every layer of a
    forward gets the same mask object, so the last one converted is kept."""
    global _last_mask
    if _last_mask[0] is mask and _last_mask[1:-1] == (batch, q_len, length, columns, device):
        return _last_mask[-1]
    additive = torch.full((batch, 1, q_len, columns), MASKED, device=device)
    if mask is None:
        additive[..., :length] = 0.0
    elif mask.dtype == torch.bool:
        additive[..., :length].masked_fill_(mask[..., -q_len:, -length:].expand(batch, 1, q_len, length), 0.0)
    else:
        additive[..., :length] = mask[..., -q_len:, -length:].float().expand(batch, 1, q_len, length)
    additive = additive.unsqueeze(1)
    _last_mask = (mask, batch, q_len, length, columns, device, additive)
    return additive


AttentionInterface.register(DECODE_ATTENTION, decode_attention)
AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)  # the masks SDPA gets (padding included)


@contextmanager
def decode_attention_for(*models: PreTrainedModel | None) -> Iterator[None]:
    """Run each of `models` that uses SDPA with `decode_attention` inside the block, then restore it
    (None, models on another attention and models on a GPU, where SDPA's kernels suit few-token
    forwards, are left alone)."""
    switched = [m for m in models if m is not None and getattr(m.config, "_attn_implementation", None) == "sdpa"
                and m.device.type == "cpu"]
    for m in switched:
        m.set_attn_implementation(DECODE_ATTENTION)
    try:
        yield
    finally:
        for m in switched:
            m.set_attn_implementation("sdpa")
