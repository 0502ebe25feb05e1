"""A lean inference forward for Llama models: transformers' modules and weights, fewer ops between them.

A decode step of the demo target is 30 layers of four packed GEMMs and a few dozen small ops.
transformers' forward adds per-call machinery around them (mask construction, decorators, output
dataclasses, a module call per norm and projection, rotary embedding applied to q and k
separately); on this 2-core CPU the small ops and that machinery were a fifth of a bf16 step. This
forward runs the same modules' weights in plain code (gpt-fast style): one fused RMSNorm kernel per
norm, rotary embedding applied to q and k in one pass, the model's attention function (SDPA, or
`modeling.attention`'s inside `decode_attention_for`) called directly, and the hidden states
entering chosen layers returned on the way (the EAGLE-3 features, without hooks). Its logits equal
transformers' (to 1e-10 in fp64 in the tests that compare them) and it is used only where it is
known to: `supports_lean` names the architectures.

A single-sequence bf16 decode step of the demo target over 200 cached tokens, 1 thread, interleaved:
38.5 ms through transformers' forward, 35.3 ms through this one (both with the matmul attention and
a preallocated cache; greedy logits identical).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import AttentionInterface, Cache, PreTrainedModel

from specdistill import hardware
from specdistill.modeling.attention import DECODE_ATTENTION

LEAN_ARCHITECTURES = ("LlamaForCausalLM",)


def supports_lean(model: PreTrainedModel) -> bool:
    """A Llama model at inference whose attention is SDPA's or ours (anything else keeps its own forward)."""
    config = model.config
    return (type(model).__name__ in LEAN_ARCHITECTURES and not model.training
            and getattr(config, "pretraining_tp", 1) == 1
            and config._attn_implementation in ("sdpa", DECODE_ATTENTION))


def rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`LlamaRMSNorm` in one kernel: the kernel keeps a bf16 input's statistics in float32 and rounds the
    normalized value once, as `LlamaRMSNorm` does by upcasting first (bit-identical, tested), without the
    two dtype copies; the weight is applied in the input dtype. (`LlamaRMSNorm` computes a float64
    input in float32 too.)"""
    normed = torch.rms_norm(x.float() if x.dtype == torch.float64 else x, (x.shape[-1],), eps=norm.variance_epsilon)
    return normed.to(x.dtype) * norm.weight


def causal_mask(past: int, new: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """`[1, 1, new, past + new]`: the new tokens see the cached ones and each other causally."""
    return (torch.arange(past + new, device=device) <= torch.arange(past, past + new, device=device).unsqueeze(1))[None, None]


def lean_forward(model: PreTrainedModel, input_ids: torch.Tensor, cache: Cache, *, positions: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None, keep: int = 1, capture: Sequence[int] = (),
                 head: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits of the last `keep` positions `[B, keep, V]`, the hidden states entering the `capture`
    layers concatenated `[B, T, len(capture)·H]` or None), appending the T new tokens to `cache`.
    With `head=False`, the final-norm hidden states `[B, keep, H]` instead of logits (a draft with a
    reduced vocabulary applies its own rows of the head).

    `positions` `[B, T]` default to the ones after the cache; `mask` is a bool `[B or 1, 1, T, past + T]`
    (True: attended); without one the new tokens attend causally to the cache and each other.
    """
    inner = model.model
    device = inner.embed_tokens.weight.device  # the engine's bookkeeping stays on the CPU; the model's inputs go here
    input_ids = input_ids.to(device)
    batch, new = input_ids.shape
    past = cache.get_seq_length()
    if positions is None:
        positions = torch.arange(past, past + new, device=device).unsqueeze(0)
    positions = positions.to(device)
    if mask is None and new > 1 and past > 0:
        mask = causal_mask(past, new, device)
    elif mask is not None:
        mask = mask.to(device)
    attend = AttentionInterface()[model.config._attn_implementation]  # SDPA, or ours inside `decode_attention_for`
    x = inner.embed_tokens(input_ids)
    cos, sin = (t.unsqueeze(1) for t in inner.rotary_emb(x, positions))  # [B, 1, T, D]
    seen: dict[int, torch.Tensor] = {}
    for index, layer in enumerate(inner.layers):
        if index in capture:
            seen[index] = x
        attn = layer.self_attn
        h = rms_norm(layer.input_layernorm, x)
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)  # one packed GEMM when fused (modeling.packed)
        heads, dim = q.shape[-1] // attn.head_dim, attn.head_dim
        qk = torch.cat([q, k], dim=-1).view(batch, new, -1, dim).transpose(1, 2)  # rotary on q and k in one pass
        half = dim // 2
        qk = qk * cos + torch.cat([-qk[..., half:], qk[..., :half]], dim=-1) * sin
        q, k = qk[:, :heads], qk[:, heads:]
        keys, values = cache.layers[index].update(k, v.view(batch, new, -1, dim).transpose(1, 2))
        out, _ = attend(attn, q, keys, values, mask, scaling=attn.scaling, dropout=0.0)
        x = x + attn.o_proj(out.reshape(batch, new, heads * dim))
        mlp = layer.mlp
        h = rms_norm(layer.post_attention_layernorm, x)
        x = x + mlp.down_proj(mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h))
    hidden = rms_norm(inner.norm, x[:, -keep:])
    features = torch.cat([seen[i] for i in capture], dim=-1) if capture else None
    return (model.lm_head(hidden) if head else hidden), features


def engine_forward(model: PreTrainedModel, input_ids: torch.Tensor, cache: Cache, keep: int = 1,
                   head: bool = True, sync: bool = False) -> torch.Tensor:
    """Logits `[B, keep, V]` (with `head=False` the final-norm hidden states `[B, keep, H]`) as the
    engine computes them: the lean forward where supported, transformers' elsewhere. Drafts step
    through it, and cost measurements (c, v(k)) time it inside `decode_attention_for`, so that they
    price the steps the engine actually runs. Inputs move to the model's device; the result stays there.
    `sync`: return only when the device has finished (a GPU runs asynchronously): for timings."""
    if supports_lean(model):
        out = lean_forward(model, input_ids, cache, keep=keep, head=head)[0]
    elif head:
        out = model(input_ids=input_ids.to(model.device), cache=cache, use_cache=True, logits_to_keep=keep).logits
    else:
        out = model.model(input_ids=input_ids.to(model.device), cache=cache, use_cache=True).last_hidden_state[:, -keep:]
    if sync:
        hardware.synchronize(out.device)
    return out
