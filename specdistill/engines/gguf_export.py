"""Export a layer-extracted draft (an HF Llama checkpoint) to a GGUF file that llama-server loads as
`-md DRAFT.gguf`.

The GGUF's metadata (tokenizer, special tokens, chat template, rope) is copied from the target's own
GGUF, so the vocabulary is the target's by construction and llama.cpp's draft/target compatibility
check (same vocab type, same BOS/EOS, vocab sizes within 128, same token texts) passes. The draft's
weights come from its safetensors with llama.cpp's tensor names; q/k projections are permuted from
HF's rotary layout to GGUF's, as llama.cpp's own converter does.

A reduced draft vocabulary (`draft_vocab.safetensors`, e.g. 8k of 49k) cannot be carried over:
llama.cpp refuses a draft vocabulary that differs from the target's by more than 128 tokens, so the
exported draft drafts over the full head (its tied embeddings). `GgufExport.head` says which.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

LLAMA_VOCAB_MAX_SIZE_DIFFERENCE = 128  # SPEC_VOCAB_MAX_SIZE_DIFFERENCE in llama.cpp's common/speculative.cpp
DTYPES = ("f16", "f32")
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


class GgufExportError(ValueError):
    """The draft cannot become a GGUF llama.cpp would pair with this target; the message says why."""


@dataclass
class GgufExport:
    path: str
    layers: int
    dtype: str
    vocab_size: int
    head: str  # "full" or why the draft vocabulary was not carried over
    bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def permute_rotary(weight: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotate-half q/k rows -> GGUF's interleaved pairs (llama.cpp's LlamaModel.permute)."""
    return (weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _read_draft(draft_dir: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """config.json and every weight as fp32 numpy (read through torch: numpy has no bf16)."""
    import torch
    from safetensors.torch import load_file

    config_path = draft_dir / "config.json"
    if not config_path.is_file():
        raise GgufExportError(f"{draft_dir}: no config.json (not an HF checkpoint)")
    config = json.loads(config_path.read_text())
    if config.get("model_type") != "llama":
        raise GgufExportError(f"{draft_dir}: model_type {config.get('model_type')!r}; only Llama drafts export to GGUF here")
    files = sorted(p for p in draft_dir.glob("*.safetensors") if p.name != "draft_vocab.safetensors")
    if not files:
        raise GgufExportError(f"{draft_dir}: no safetensors weights")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        tensors.update({k: v.to(torch.float32).numpy() for k, v in load_file(str(f)).items()})
    return config, tensors


def _target_fields(reader) -> dict:
    return {name: field for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _check_pairing(config: dict, reader, draft_dir: Path) -> int:
    """Shape and vocabulary checks that llama.cpp would otherwise fail on at load (or silently botch)."""
    fields = _target_fields(reader)
    arch = fields["general.architecture"].contents()
    if arch != "llama":
        raise GgufExportError(f"target GGUF architecture {arch!r}: only llama targets are supported")
    tokens = fields["tokenizer.ggml.tokens"].contents()
    diff = abs(config["vocab_size"] - len(tokens))
    if diff > LLAMA_VOCAB_MAX_SIZE_DIFFERENCE:
        raise GgufExportError(
            f"{draft_dir}: vocabulary-incompatible: draft vocab_size {config['vocab_size']} vs target {len(tokens)} "
            f"(llama.cpp accepts a difference of at most {LLAMA_VOCAB_MAX_SIZE_DIFFERENCE})")
    for key, ours in (("embedding_length", config["hidden_size"]),
                      ("attention.head_count", config["num_attention_heads"]),
                      ("attention.head_count_kv", config.get("num_key_value_heads", config["num_attention_heads"]))):
        theirs = fields[f"llama.{key}"].contents()
        if theirs != ours:
            raise GgufExportError(f"draft {key} {ours} != target's {theirs}: not a layer-extracted draft of this target")
    tokenizer_file = draft_dir / "tokenizer.json"
    if tokenizer_file.is_file():
        vocab = json.loads(tokenizer_file.read_text())["model"].get("vocab", {})
        added = {t["content"]: t["id"] for t in json.loads(tokenizer_file.read_text()).get("added_tokens", [])}
        by_id = {i: tok for tok, i in {**vocab, **added}.items()}
        for i in range(5, min(len(tokens), config["vocab_size"])):  # llama.cpp compares from id 5 on
            if i in by_id and by_id[i] != tokens[i]:
                raise GgufExportError(
                    f"{draft_dir}: vocabulary-incompatible: token {i} is {by_id[i]!r} in the draft, {tokens[i]!r} in the target")
    return len(tokens)


def export_draft_gguf(draft_dir: str | os.PathLike, target_gguf: str | os.PathLike, out_path: str | os.PathLike,
                      *, dtype: str = "f16") -> GgufExport:
    """Write `out_path` (atomically) from the draft's weights and the target GGUF's metadata."""
    import gguf

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {DTYPES}")
    draft_dir, out_path = Path(draft_dir), Path(out_path)
    reader = gguf.GGUFReader(str(target_gguf))
    config, tensors = _read_draft(draft_dir)
    n_vocab = _check_pairing(config, reader, draft_dir)
    n_layers, n_head = config["num_hidden_layers"], config["num_attention_heads"]
    n_head_kv = config.get("num_key_value_heads", n_head)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    overrides = {"llama.block_count": n_layers, "llama.feed_forward_length": config["intermediate_size"],
                 "general.file_type": int(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32),
                 "general.name": f"specdistill draft ({n_layers} layers)"}
    for name, field in _target_fields(reader).items():
        if name == "general.architecture":
            continue  # the writer adds it
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, overrides.get(name, field.contents()), vtype, sub_type=sub)

    def add(name: str, value: np.ndarray) -> None:
        if value.ndim == 1 or dtype == "f32":
            writer.add_tensor(name, value.astype(np.float32))
        else:
            writer.add_tensor(name, value.astype(np.float16))

    add("token_embd.weight", tensors.pop("model.embed_tokens.weight"))
    add("output_norm.weight", tensors.pop("model.norm.weight"))
    if "lm_head.weight" in tensors and not config.get("tie_word_embeddings", False):
        add("output.weight", tensors.pop("lm_head.weight"))
    tensors.pop("lm_head.weight", None)
    for i in range(n_layers):
        for hf, ours in _LAYER_NAMES.items():
            key = f"model.layers.{i}.{hf}"
            if key not in tensors:
                raise GgufExportError(f"{draft_dir}: missing tensor {key}")
            value = tensors.pop(key)
            if hf.startswith("self_attn.q_proj"):
                value = permute_rotary(value, n_head)
            elif hf.startswith("self_attn.k_proj"):
                value = permute_rotary(value, n_head_kv)
            add(f"blk.{i}.{ours}", value)
    leftover = [k for k in tensors if "rotary_emb" not in k]
    if leftover:
        raise GgufExportError(f"{draft_dir}: tensors with no GGUF name: {leftover[:5]}")
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    head = "full"
    if (draft_dir / "draft_vocab.safetensors").is_file():
        head = (f"full ({n_vocab} tokens): the draft's reduced vocabulary is not carried over, llama.cpp requires the "
                f"draft vocabulary to match the target's within {LLAMA_VOCAB_MAX_SIZE_DIFFERENCE} tokens")
    return GgufExport(str(out_path), n_layers, dtype, n_vocab, head, out_path.stat().st_size)
