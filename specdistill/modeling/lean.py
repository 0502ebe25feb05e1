"""A lean inference forward for Llama models: transformers' modules and weights, fewer ops between them.

transformers' per-call machinery (mask construction, decorators, output dataclasses, a module call
per norm and projection) and small ops were a fifth of a bf16 decode step of the demo target on this
2-core CPU. This forward runs the same weights in plain code (gpt-fast style): one fused RMSNorm
kernel per norm, rotary embedding on q and k in one pass, the attention function called directly,
and the EAGLE-3 features returned on the way (no hooks). Its logits equal transformers' (to 1e-10 in
fp64 in the tests); `supports_lean` names the architectures it is known to be right for.

A single-sequence bf16 decode step over 200 cached tokens, 1 thread: 38.5 ms through transformers'
forward, 35.3 ms through this one (both with the matmul attention and a preallocated cache).
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
    """`LlamaRMSNorm` in one kernel, bit-identical (tested): the kernel keeps a bf16 input's statistics in
    float32 as `LlamaRMSNorm` does by upcasting, without its two dtype copies (float64 it also computes in float32)."""
    normed = torch.rms_norm(x.float() if x.dtype == torch.float64 else x, (x.shape[-1],), eps=norm.variance_epsilon)
    return normed.to(x.dtype) * norm.weight


def causal_mask(past: int, new: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """`[1, 1, new, past + new]`: the new tokens see the cached ones and each other causally."""
    return (torch.arange(past + new, device=device) <= torch.arange(past, past + new, device=device).unsqueeze(1))[None, None]


def lean_forward(model: PreTrainedModel, input_ids: torch.Tensor, cache: Cache, *, positions: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None, keep: int = 1, capture: Sequence[int] = (),
                 head: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits of the last `keep` positions, or with `head=False` their final-norm hidden states; the
    hidden states entering the `capture` layers concatenated, or None), appending the new tokens to
    `cache`. `mask`: bool `[B or 1, 1, T, past + T]`, True attended; causal without one."""
    inner = model.model
    device = inner.embed_tokens.weight.device  # the decoding loop's bookkeeping stays on the CPU; the model's inputs go here
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


def decode_forward(model: PreTrainedModel, input_ids: torch.Tensor, cache: Cache, keep: int = 1,
                   head: bool = True, sync: bool = False) -> torch.Tensor:
    """Logits (with `head=False` final-norm hidden states) of the last `keep` positions as the decoding loop
    computes them: drafts step through it and cost measurements time it, so that they price the
    steps the loop actually runs. `sync`: wait for the device (a GPU runs asynchronously)."""
    if supports_lean(model):
        out = lean_forward(model, input_ids, cache, keep=keep, head=head)[0]
    elif head:
        out = model(input_ids=input_ids.to(model.device), cache=cache, use_cache=True, logits_to_keep=keep).logits
    else:
        out = model.model(input_ids=input_ids.to(model.device), cache=cache, use_cache=True).last_hidden_state[:, -keep:]
    if sync:
        hardware.synchronize(out.device)
    return out
