"""An EAGLE-3 head started from its target's weights: what night one trains, before any distillation.

The midlayer is the target's top decoder layer (the q/k/v half that reads token embeddings from its first
layer), `fc` the identity on the high feature layer, the norm and the draft vocabulary's lm_head rows the
target's own: the head drafts something sensible from its first step, and training starts there.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig, PreTrainedModel

from specdistill.modeling.eagle3 import Eagle3Draft, check_eagle3_target, eagle3_config, target_architecture
from specdistill.modeling.vocab import DraftVocab


@torch.no_grad()
def init_eagle3_from_target(target: PreTrainedModel, draft_vocab: DraftVocab, aux_layers: list[int] | None = None) -> Eagle3Draft:
    """An untrained head started from the target's weights where the shapes fit: the midlayer from its
    top layer (q/k/v's embedding half from its first), fc the identity on the high feature layer."""
    check_eagle3_target(target_architecture(target.config) or type(target).__name__)
    config = eagle3_config(target.config, draft_vocab.size, aux_layers)
    head = Eagle3Draft(config, target.get_input_embeddings())
    dtype = next(target.parameters()).dtype
    top, first = target.model.layers[-1], target.model.layers[0]
    h = config.hidden_size
    layer = head.midlayer
    first_qkv, top_qkv = _qkv_weights(first.self_attn, config), _qkv_weights(top.self_attn, config)
    for name in ("q_proj", "k_proj", "v_proj"):
        w = getattr(layer.self_attn, name).weight
        w[:, :h] = first_qkv[name]
        w[:, h:] = top_qkv[name]
    layer.self_attn.o_proj.weight.copy_(top.self_attn.o_proj.weight)
    layer.input_layernorm.weight.copy_(_rms_scale(first.input_layernorm))
    layer.hidden_norm.weight.copy_(_rms_scale(top.input_layernorm))
    # the norm before the MLP: Gemma-2 names it pre_feedforward_layernorm (its post_attention_layernorm
    # normalizes the attention output before the residual add)
    layer.post_attention_layernorm.weight.copy_(
        _rms_scale(getattr(top, "pre_feedforward_layernorm", None) or top.post_attention_layernorm))
    layer.mlp.load_state_dict(_mlp_weights(top.mlp))
    head.fc.weight.zero_()
    head.fc.weight[:, 2 * h :] = torch.eye(h)
    head.norm.weight.copy_(_rms_scale(target.model.norm))
    head.lm_head.weight.copy_(target.get_output_embeddings().weight.index_select(0, draft_vocab.token_ids))
    head.set_draft_vocab(draft_vocab)
    return head.to(dtype)


def _qkv_weights(attn: nn.Module, config: LlamaConfig) -> dict[str, torch.Tensor]:
    """q/k/v weights of a target attention: separate projections, or Phi-3's fused `qkv_proj` split by rows."""
    if hasattr(attn, "q_proj"):
        return {name: getattr(attn, name).weight for name in ("q_proj", "k_proj", "v_proj")}
    q_rows, kv_rows = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    q, k, v = attn.qkv_proj.weight.split([q_rows, kv_rows, kv_rows], dim=0)
    return {"q_proj": q, "k_proj": k, "v_proj": v}


def _mlp_weights(mlp: nn.Module) -> dict[str, torch.Tensor]:
    """gate/up/down weights of a target MLP: separate, or Phi-3's fused `gate_up_proj` (gate rows first)."""
    if hasattr(mlp, "gate_proj"):
        return {f"{name}.weight": getattr(mlp, name).weight for name in ("gate_proj", "up_proj", "down_proj")}
    gate, up = mlp.gate_up_proj.weight.chunk(2, dim=0)
    return {"gate_proj.weight": gate, "up_proj.weight": up, "down_proj.weight": mlp.down_proj.weight}


def _rms_scale(norm: nn.Module) -> torch.Tensor:
    """The multiplier an RMS norm applies, as the head's Llama norm holds it: Gemma's norms scale by 1 + weight."""
    return norm.weight + 1 if type(norm).__name__.startswith("Gemma") else norm.weight
