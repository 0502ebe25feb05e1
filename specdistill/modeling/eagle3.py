"""EAGLE-3 draft head: one decoder layer that drafts from the target's own features.

Entry t of the head's sequence pairs the target's features at position t (the inputs of three of
its decoder layers, low/mid/high, concatenated and projected by `fc`) with the embedding of token
t+1, and predicts token t+2. Later draft steps feed the head's own output back (pre-norm, or normed
with `norm_output`) in place of `fc(features)`. Training unrolls those later steps on the training data ("training-time test") so
that they see at training time the inputs they see when drafting.

Parameter names follow the layout vLLM and SGLang load (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`,
`t2d`); the token embeddings are the target's own, frozen and not part of the head's weights.

Eagle 3.1's norm switches (`NORM_OPTIONS`, speculators' and vLLM's names, false when the config leaves them
out) are computed as speculators 0.9's `Eagle3DraftModel` does: `norm_before_fc` (`input_norm`) or `fc_norm`
(`fc_norm.0-2`) normalize the target features before `fc`, `norm_before_residual` adds the attention output to
the normed feature stream, and `norm_output` feeds the normed output back (and `lm_head` reads it unnormed again).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from specdistill.modeling.attention import MAX_QUERIES, decode_attention
from specdistill.modeling.eagle3_files import EAGLE3_ARCHITECTURE  # noqa: F401  (read from here too)
from specdistill.modeling.lean import causal_mask
from specdistill.modeling.vocab import DraftVocab


class Eagle3ShapeError(ValueError):
    """The head and the target it is paired with do not fit (layers, widths, vocabulary)."""


# Eagle 3.1's switches (speculators' Eagle3SpeculatorConfig, vLLM's llama_eagle3.py), each in one phrase
NORM_OPTIONS = {
    "norm_before_residual": "the residual taken after hidden_norm",
    "norm_before_fc": "an RMSNorm over the concatenated target features before fc",
    "fc_norm": "an RMSNorm over each target feature layer before fc",
    "norm_output": "the normed hidden state fed back across draft steps",
}


def norm_options(config: LlamaConfig | dict) -> dict[str, bool]:
    """The Eagle 3.1 switches a head config sets; one that leaves a switch out is an EAGLE-3 head there."""
    values = config if isinstance(config, dict) else vars(config)
    return {name: bool(values.get(name, False)) for name in NORM_OPTIONS}


# Decoder layers with q/k/v, gate/up/down (or Phi-3's fused ones) and RMS norms (Gemma's scale by 1 + weight).
# Llama, Mistral, Qwen2, Qwen3 and Phi-3 are the ones vLLM's EAGLE-3 serves as Llama-style models.
EAGLE3_TARGET_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                               "Phi3ForCausalLM", "Gemma2ForCausalLM")


class UnsupportedTargetError(Eagle3ShapeError):
    """A target architecture an EAGLE-3 head cannot be built for; the message names it and the supported ones."""


def check_eagle3_target(architecture: str | None, where: object = "the target") -> None:
    """Refuse, in one line and before any work, a target whose architecture the head cannot start from."""
    if architecture not in EAGLE3_TARGET_ARCHITECTURES:
        raise UnsupportedTargetError(
            f"{where}: an EAGLE-3 head cannot be built for architecture {architecture or 'unknown'} "
            f"(supported: {', '.join(EAGLE3_TARGET_ARCHITECTURES)})")


def target_architecture(config) -> str | None:
    names = getattr(config, "architectures", None) or []
    return names[0] if names else None


def default_aux_layers(num_layers: int) -> list[int]:
    """Low, mid and high feature layers as vLLM and SGLang capture them for an N-layer target."""
    if num_layers < 4:
        raise Eagle3ShapeError(f"an EAGLE-3 head needs a target of at least 4 layers, this one has {num_layers}")
    return [2, num_layers // 2, num_layers - 3]


def eagle3_config(target_config, draft_vocab_size: int, aux_layers: list[int] | None = None) -> LlamaConfig:
    """The head's config: the target's attention and MLP shapes for one layer, plus the EAGLE-3 fields."""
    n = target_config.num_hidden_layers
    aux_layers = list(aux_layers) if aux_layers is not None else default_aux_layers(n)
    if len(aux_layers) != 3 or not all(0 <= i < n for i in aux_layers):
        raise Eagle3ShapeError(f"feature layers must be three layer indices in 0..{n - 1}, got {aux_layers}")
    if not 1 <= draft_vocab_size <= target_config.vocab_size:
        raise Eagle3ShapeError(f"draft vocabulary of {draft_vocab_size} does not fit a target vocabulary of {target_config.vocab_size}")
    head_dim = getattr(target_config, "head_dim", None) or target_config.hidden_size // target_config.num_attention_heads
    rope = getattr(target_config, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": getattr(target_config, "rope_theta", 10000.0),
    }
    act = getattr(target_config, "hidden_act", None) or getattr(target_config, "hidden_activation", None) or "silu"
    config = LlamaConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=target_config.hidden_size,
        intermediate_size=target_config.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=target_config.num_attention_heads,
        num_key_value_heads=target_config.num_key_value_heads,
        head_dim=head_dim,
        hidden_act=act,
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=target_config.rms_norm_eps,
        rope_parameters=dict(rope),
        tie_word_embeddings=False,
        bos_token_id=getattr(target_config, "bos_token_id", None),
        eos_token_id=getattr(target_config, "eos_token_id", None),
        pad_token_id=getattr(target_config, "pad_token_id", None),
    )
    config.architectures = [EAGLE3_ARCHITECTURE]
    config.draft_vocab_size = draft_vocab_size
    config.target_hidden_size = target_config.hidden_size
    config.eagle_config = {"eagle_aux_hidden_state_layer_ids": aux_layers, "use_aux_hidden_state": True}
    return config


@dataclass
class Eagle3Cache:
    """The head's own KV cache for one sequence: keys and values [1, kv_heads, length, head_dim]."""

    key: torch.Tensor | None = None
    value: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.key is None else self.key.shape[2]

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.key = key if self.key is None else torch.cat([self.key, key], dim=2)
        self.value = value if self.value is None else torch.cat([self.value, value], dim=2)
        return self.key, self.value

    def crop(self, length: int) -> None:
        if self.key is not None and length < self.length:
            self.key, self.value = self.key[:, :, :length], self.value[:, :, :length]


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read the 2H-wide [token embedding ; feature] input."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        width = 2 * config.hidden_size
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def out(self, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))

    def expand(self, kv: torch.Tensor) -> torch.Tensor:
        """Grouped-query attention: repeat each key/value head for the query heads that share it."""
        return kv.repeat_interleave(self.heads // self.kv_heads, dim=1)


class Eagle3Layer(nn.Module):
    """The `midlayer`: a Llama decoder layer with a second input norm for the feature stream."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.norm_before_residual = norm_options(config)["norm_before_residual"]
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def attn_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's input [norm(embeds) ; hidden_norm(hidden)] and the residual its output is added to:
        the feature stream as it came, or with `norm_before_residual` as hidden_norm left it."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(embeds), normed], dim=-1), residual

    def finish(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        hidden = residual + attn_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Draft(nn.Module):
    """The head. `forward` drafts with a KV cache; `unroll` is the training-time-test pass."""

    def __init__(self, config: LlamaConfig, embed_tokens: nn.Embedding):
        super().__init__()
        if embed_tokens.weight.shape != (config.vocab_size, config.hidden_size):
            raise Eagle3ShapeError(
                f"token embeddings of shape {tuple(embed_tokens.weight.shape)} do not fit a head for "
                f"vocabulary {config.vocab_size} and width {config.hidden_size}"
            )
        options = norm_options(config)
        if options["norm_before_fc"] and options["fc_norm"]:
            raise Eagle3ShapeError("norm_before_fc and fc_norm are exclusive (one norm over the concatenated features, "
                                   "or one per feature layer), as speculators' config has them")
        self.config = config
        self.norm_output = options["norm_output"]
        self.embed_tokens = embed_tokens
        self.embed_tokens.requires_grad_(False)
        width, eps = config.target_hidden_size, config.rms_norm_eps
        self.input_norm = LlamaRMSNorm(3 * width, eps=eps) if options["norm_before_fc"] else None
        self.fc_norm = nn.ModuleList(LlamaRMSNorm(width, eps=eps) for _ in range(3)) if options["fc_norm"] else None
        self.fc = nn.Linear(3 * width, config.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    @property
    def aux_layers(self) -> list[int]:
        return list(self.config.eagle_config["eagle_aux_hidden_state_layer_ids"])

    @property
    def draft_vocab(self) -> DraftVocab:
        return DraftVocab(self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device), self.config.vocab_size)

    def set_draft_vocab(self, vocab: DraftVocab) -> None:
        if vocab.size != self.config.draft_vocab_size or vocab.target_vocab_size != self.config.vocab_size:
            raise Eagle3ShapeError(
                f"draft vocabulary of {vocab.size} tokens over {vocab.target_vocab_size} does not fit a head "
                f"of {self.config.draft_vocab_size} over {self.config.vocab_size}"
            )
        self.d2t.copy_(vocab.d2t)
        self.t2d.copy_(vocab.t2d)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The first draft step's feature stream from the target's features [..., 3·H_target]."""
        features = features.to(self.fc.weight.dtype)
        if self.input_norm is not None:
            features = self.input_norm(features)
        if self.fc_norm is not None:
            chunks = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(features)

    def output(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the layer's output becomes for the next draft step: itself, or with `norm_output` its normed form."""
        return self.norm(hidden) if self.norm_output else hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits from a hidden state `forward` returned (already normed with `norm_output`)."""
        return self.lm_head(hidden if self.norm_output else self.norm(hidden))

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor, cache: Eagle3Cache,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """One drafting call on a single sequence: hidden [1, T, H] is projected features or the head's
        own earlier outputs; appends T entries to `cache`; returns the hidden state [1, T, H] the next step reads
        and `logits` takes (pre-norm, or normed with `norm_output`).
        `mask` (bool [1, 1, T, past + T]) replaces the causal one: a draft tree's nodes see their own branch."""
        input_ids, position_ids = input_ids.to(hidden.device), position_ids.to(hidden.device)
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary_emb(hidden, position_ids)
        attn = self.midlayer.self_attn
        x, residual = self.midlayer.attn_input(embeds, hidden)
        q, k, v = attn.qkv(x, cos, sin)
        past = cache.length
        keys, values = cache.append(k, v)
        t = q.shape[2]
        mask = causal_mask(past, t, q.device) if mask is None else mask.to(q.device)  # [1, 1, T, past + T]
        if t > MAX_QUERIES:  # a long prefill: SDPA
            out = F.scaled_dot_product_attention(q, attn.expand(keys), attn.expand(values), attn_mask=mask).transpose(1, 2)
        else:  # the few tokens of a drafting step: matmuls, not SDPA's slow CPU kernel (modeling.attention)
            out, _ = decode_attention(None, q, keys, values, mask)  # [1, T, heads, head_dim]
        return self.output(self.midlayer.finish(residual, attn.o_proj(out.reshape(1, t, -1))))

    def unroll(self, next_ids: torch.Tensor, features: torch.Tensor, steps: int, valid: torch.Tensor,
               keep: list[torch.Tensor] | None = None, deep: torch.Tensor | None = None,
               alignment: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Training-time test over a batch: `features` [B, T, 3·H_target] are the target's at
        positions t, `next_ids` [B, T] the tokens t+1, `valid` [B, T] marks real positions.

        Step j (0-based) at position t drafts token t+2+j, as the j-th draft of a round that started
        after position t: it reads token t+1+j and the previous step's output at t, and attends to
        step 0's entries at positions <= t plus its own and earlier steps' entries at t (the entries
        a drafting KV cache would hold). Returns one logits tensor [B, T, draft_vocab] per step, or
        with `keep` (per step [B, T] bool) [kept, draft_vocab] for the kept entries only.

        With `deep` [B, T] bool, the steps after the first run at the entries it marks only, and their
        logits are those entries' (kept ones with `keep`, else all marked), in row-major order. That is exact
        for the marked entries, since an entry's later steps read its own earlier steps and step 0's keys,
        never another entry's later steps; their cost is the marked share of a full step's.

        With `alignment` (a list), the mean over entries of how far step 0's output at t lies from the projected
        target features at t+1 (`feature_alignment`) is appended to it: the input the next draft step reads,
        pulled toward the input the first step reads there, where it is trained on every entry."""
        b, t = next_ids.shape
        positions = torch.arange(t, device=next_ids.device).expand(b, t)
        hidden = self.project(features)
        attn, layer = self.midlayer.self_attn, self.midlayer
        causal = torch.ones(t, t, dtype=torch.bool, device=next_ids.device).tril()
        key_mask = causal & valid[:, None, None, :]  # [B, 1, T, T]
        shifted = [F.pad(next_ids[:, j:], (0, j), value=0) for j in range(steps)]  # token t+1+j at t
        rows = None  # [B, S] the entries the later steps run at (None: all)
        if deep is not None and steps > 1:
            count = max(1, int(deep.sum(1).max()))
            rows = torch.argsort((~deep).to(torch.int8), dim=1, stable=True)[:, :count]  # marked first, in order
            marked = deep.gather(1, rows)
            keep = [keep[0] if keep is not None else None,
                    *((keep[j].gather(1, rows) if keep is not None else torch.ones_like(marked)) & marked
                      for j in range(1, steps))]
        keys0 = values0 = None
        diag_keys: list[torch.Tensor] = []
        diag_values: list[torch.Tensor] = []
        out = []
        for j in range(steps):
            ids, at = shifted[j], positions + j
            if j == 1 and rows is not None:  # from here on, the marked entries alone
                hidden = hidden.gather(1, rows[..., None].expand(-1, -1, hidden.shape[-1]))
                key_mask = (torch.arange(t, device=rows.device)[None, None, :] <= rows[:, :, None]) & valid[:, None, :]
                key_mask = key_mask[:, None]  # [B, 1, S, T]
            if j >= 1 and rows is not None:
                ids, at = ids.gather(1, rows), rows + j
            embeds = self.embed_tokens(ids).to(hidden.dtype)
            cos, sin = self.rotary_emb(hidden, at)
            x, residual = layer.attn_input(embeds, hidden)
            q, k, v = attn.qkv(x, cos, sin)
            k, v = attn.expand(k), attn.expand(v)
            if j == 0:
                keys0, values0 = k, v
            else:
                diag_keys.append(k)
                diag_values.append(v)
            # matmuls, step 0 too: SDPA's CPU kernel is ~3x slower here in bf16, forward and backward
            o = _unrolled_attention(q, keys0, values0, key_mask, diag_keys, diag_values, attn.head_dim**-0.5)
            if j == 0 and alignment is not None:
                projected = hidden
            hidden = self.output(layer.finish(residual, attn.out(o)))
            if j == 0 and alignment is not None:
                alignment.append(feature_alignment(hidden, projected, valid))
            out.append(self.logits(hidden if keep is None or keep[j] is None else hidden[keep[j]]))
        return out


def feature_alignment(output: torch.Tensor, projected: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over entries t (with t+1 real) of ||out_t - p_{t+1}||² / ||p_{t+1}||², p the projected target features,
    held fixed: EAGLE's feature regression, as a pull on the hidden state a later draft step reads."""
    want = projected[:, 1:].detach().float()
    diff = output[:, :-1].float() - want
    rows = valid[:, 1:] & valid[:, :-1]
    per = diff.pow(2).sum(-1) / want.pow(2).sum(-1).clamp_min(1e-6)
    return per[rows].mean() if bool(rows.any()) else output.sum() * 0.0


def _unrolled_attention(q: torch.Tensor, keys0: torch.Tensor, values0: torch.Tensor, key_mask: torch.Tensor,
                        diag_keys: list[torch.Tensor], diag_values: list[torch.Tensor], scale: float) -> torch.Tensor:
    """Queries [B, h, S, d] over step 0's keys [B, h, T, d] (under `key_mask` [B, 1, S, T]) and over their own
    entries' earlier steps (`diag_*`, each [B, h, S, d]), in one softmax."""
    t = keys0.shape[2]
    scores = ((q @ keys0.transpose(-1, -2)) * scale).masked_fill(~key_mask, float("-inf"))
    diag = [torch.stack([(q * dk).sum(-1) for dk in diag_keys], dim=-1) * scale] if diag_keys else []  # [B, h, S, j]
    weights = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1)
    o = weights[..., :t] @ values0
    return o + sum(weights[..., t + i, None] * dv for i, dv in enumerate(diag_values))


def check_fits(config: dict, target_config, *, where: str = "", feature_layers: list[int] | None = None,
               check_vocab_size: bool = True) -> None:
    """Refuse a head (its config.json, before any weight is read) whose shapes do not fit this target, naming
    every mismatch. Shapes decide, not the target's version: a head trained for an earlier version of the
    target is exactly what incremental distillation starts from after a target update."""
    problems = []
    target_hidden = config.get("target_hidden_size", config.get("hidden_size"))
    if target_hidden != target_config.hidden_size:
        problems.append(f"target hidden size {target_config.hidden_size}, head built for {target_hidden}")
    if config.get("hidden_size") != target_config.hidden_size:
        problems.append(f"head width {config.get('hidden_size')} differs from the target's embedding width {target_config.hidden_size}")
    if check_vocab_size and config.get("vocab_size") != target_config.vocab_size:
        problems.append(f"target vocabulary {target_config.vocab_size}, head built for {config.get('vocab_size')}")
    layers = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []
    if len(layers) != 3 or not all(0 <= i < target_config.num_hidden_layers for i in layers):
        problems.append(f"head reads target layers {layers}, the target has {target_config.num_hidden_layers}")
    if feature_layers is not None and list(feature_layers) != list(layers):
        problems.append(f"head reads target layers {layers}, the features given are of layers {list(feature_layers)}")
    if problems:
        raise Eagle3ShapeError(f"EAGLE-3 head {where}{' ' if where else ''}does not fit this target: " + "; ".join(problems))


def check_head_fits(head: Eagle3Draft, target: PreTrainedModel) -> None:
    """Fail before any work when a head was built for another target shape."""
    check_fits(head.config.to_dict(), target.config)
