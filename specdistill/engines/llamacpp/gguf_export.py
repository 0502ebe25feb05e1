"""Export a layer-extracted draft (an HF Llama checkpoint) to a GGUF file that llama-server loads as
`-md DRAFT.gguf`.

The GGUF's metadata (tokenizer, special tokens, chat template, rope) is copied from the target's own
GGUF, so the vocabulary is the target's by construction and llama.cpp's draft/target compatibility
check (same vocab type, same BOS/EOS, vocab sizes within 128, same token texts) passes. The draft's
weights come from its safetensors with llama.cpp's tensor names; q/k projections are permuted from
HF's rotary layout to GGUF's, as llama.cpp's own converter does.

A reduced draft vocabulary (`draft_vocab/draft_vocab.safetensors`, e.g. 8k of 49k) cannot be carried over:
llama.cpp refuses a draft vocabulary that differs from the target's by more than 128 tokens, so the
exported draft drafts over the full head (its tied embeddings). `GgufExport.head` says which.

An EAGLE-3 head (`modeling/eagle3_io.py`'s layout) becomes the `eagle3` architecture that llama.cpp's
`--spec-type draft-eagle3` loads, as its own converter (`conversion/llama.py`, `convert_hf_to_gguf.py
--target-model-dir`) writes it: the target's tokenizer, `eagle3.target_layers` (the three layers whose
inputs feed `fc`, the same "input of layer i" our hooks capture) and `eagle3.target_hidden_size`,
`fc.weight`, the midlayer as `blk.0.*` with `hidden_norm` as `attn_norm_2`, `d2t` as absolute target ids
(int64), `t2d` left out. No `token_embd`: llama.cpp then embeds with the target's, as vLLM and SGLang
do. Unlike a layer draft, the reduced draft vocabulary is carried over: llama.cpp's EAGLE-3 graph
scatters the head's logits to the target vocabulary through `d2t`. A head with an Eagle 3.1 norm switch
(`modeling.eagle3.NORM_OPTIONS`) is refused: llama.cpp's eagle3 graph computes none of them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from specdistill import paths
from specdistill.modeling.eagle3 import NORM_OPTIONS, Eagle3ShapeError, norm_options
from specdistill.modeling.eagle3_io import check_fits, is_eagle3_dir, read_config
from specdistill.modeling.vocab import LEGACY_DRAFT_VOCAB_FILE, draft_vocab_path

LLAMA_VOCAB_MAX_SIZE_DIFFERENCE = 128  # SPEC_VOCAB_MAX_SIZE_DIFFERENCE in llama.cpp's common/speculative.cpp
DTYPES = ("f16", "f32", "q8_0")  # q8_0: llama.cpp's 8-bit blocks (32 weights, one fp16 scale), matrices only
EAGLE3_ARCH = "eagle3"  # MODEL_ARCH.EAGLE3 in llama.cpp's gguf-py (newer than the `gguf` package on PyPI)
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
_EAGLE3_NAMES = {"fc.weight": "fc.weight", "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight",
                 "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
                 **{f"midlayer.{hf}": f"blk.0.{ours}" for hf, ours in _LAYER_NAMES.items()}}


class GgufExportError(ValueError):
    """The draft cannot become a GGUF llama.cpp would pair with this target; the message says why."""


@dataclass
class GgufExport:
    path: str
    layers: int
    vocab_size: int
    head: str  # "full" or why the draft vocabulary was not carried over; for an EAGLE-3 head, its draft vocabulary
    spec_type: str = "draft-simple"  # the llama-server --spec-type that loads it


def permute_rotary(weight: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotate-half q/k rows -> GGUF's interleaved pairs (llama.cpp's LlamaModel.permute)."""
    return (weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _read_weights(directory: Path) -> dict[str, np.ndarray]:
    """Every weight as numpy, floats as fp32 (read through torch: numpy has no bf16), integers as they are."""
    files = sorted(p for p in directory.glob("*.safetensors") if p.name != LEGACY_DRAFT_VOCAB_FILE)
    if not files:
        raise GgufExportError(f"{directory}: no safetensors weights")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        tensors.update({k: (v.to(torch.float32) if v.is_floating_point() else v).numpy() for k, v in load_file(str(f)).items()})
    return tensors


def _target_fields(reader) -> dict:
    return {name: field for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _target_llama(reader) -> dict:
    """The target GGUF's fields, after checking it is a Llama (the only architecture drafted for here)."""
    fields = _target_fields(reader)
    arch = fields["general.architecture"].contents()
    if arch != "llama":
        raise GgufExportError(f"target GGUF architecture {arch!r}: only llama targets are supported")
    return fields


def _check_tokens(draft_dir: Path, tokens: list[str], vocab_size: int) -> None:
    """The draft's saved tokenizer against the target GGUF's token texts, as llama.cpp compares them."""
    tokenizer_file = draft_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        return
    saved = paths.read_json(tokenizer_file, "tokenizer file")
    vocab = saved["model"].get("vocab", {})
    added = {t["content"]: t["id"] for t in saved.get("added_tokens", [])}
    by_id = {i: tok for tok, i in {**vocab, **added}.items()}
    for i in range(5, min(len(tokens), vocab_size)):  # llama.cpp compares from id 5 on
        if i in by_id and by_id[i] != tokens[i]:
            raise GgufExportError(
                f"{draft_dir}: vocabulary-incompatible: token {i} is {by_id[i]!r} in the draft, {tokens[i]!r} in the target")


def _check_pairing(config: dict, reader, draft_dir: Path) -> int:
    """Shape and vocabulary checks that llama.cpp would otherwise fail on at load (or silently botch)."""
    fields = _target_llama(reader)
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
    _check_tokens(draft_dir, tokens, config["vocab_size"])
    return len(tokens)


def _gguf_tensors(tensors: dict[str, np.ndarray], names: dict[str, str], n_head: int, n_head_kv: int,
                  where: Path) -> dict[str, np.ndarray]:
    """Pop `names` (HF name -> GGUF name) out of `tensors`, q/k projections permuted to GGUF's rotary layout."""
    out = {}
    for hf, ours in names.items():
        if hf not in tensors:
            raise GgufExportError(f"{where}: missing tensor {hf}")
        value = tensors.pop(hf)
        if hf.endswith("self_attn.q_proj.weight"):
            value = permute_rotary(value, n_head)
        elif hf.endswith("self_attn.k_proj.weight"):
            value = permute_rotary(value, n_head_kv)
        out[ours] = value
    return out


def _value_type(value):
    """The GGUF type of a key the target GGUF lacks (lists are llama.cpp's int32 arrays)."""
    t = gguf.GGUFValueType
    if isinstance(value, list):
        return t.ARRAY, t.INT32
    return {bool: t.BOOL, int: t.UINT32, float: t.FLOAT32, str: t.STRING}[type(value)], None


def _write_gguf(out_path: Path, arch: str, reader, overrides: dict, tensors: dict[str, np.ndarray], dtype: str) -> None:
    """Write `out_path` atomically: the target GGUF's metadata (its `llama.*` keys as `{arch}.*`) with
    `overrides` (keys the target lacks are added), then the tensors (matrices in `dtype`, vectors in
    f32, integer tensors as they are)."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    paths.remove_entry(tmp)  # a link (or anything) left at the temporary name is removed, never written through
    writer = gguf.GGUFWriter(str(tmp), arch)
    file_type = {"f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}.get(dtype, gguf.LlamaFileType.ALL_F32)
    overrides = {**overrides, "general.file_type": int(file_type)}
    for name, field in _target_fields(reader).items():
        if name == "general.architecture":
            continue  # the writer adds it
        name = f"{arch}.{name.removeprefix('llama.')}" if name.startswith("llama.") else name
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, overrides.pop(name, field.contents()), vtype, sub_type=sub)
    for name, value in overrides.items():
        vtype, sub = _value_type(value)
        writer.add_key_value(name, value, vtype, sub_type=sub)
    for name, value in tensors.items():
        if not np.issubdtype(value.dtype, np.floating):
            writer.add_tensor(name, value)
        elif value.ndim == 1 or dtype == "f32":
            writer.add_tensor(name, value.astype(np.float32))
        elif dtype == "q8_0":
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(value.astype(np.float32), q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, value.astype(np.float16))
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)


def export_draft_gguf(draft_dir: str | os.PathLike, target_gguf: str | os.PathLike, out_path: str | os.PathLike,
                      *, dtype: str = "f16") -> GgufExport:
    """Write `out_path` (atomically) from the draft's weights and the target GGUF's metadata."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {DTYPES}")
    draft_dir, out_path = Path(draft_dir), Path(out_path)
    reader = gguf.GGUFReader(str(target_gguf))
    if not (draft_dir / "config.json").is_file():
        raise GgufExportError(f"{draft_dir}: no config.json (not an HF checkpoint)")
    config = paths.read_json(draft_dir / "config.json", "model config")
    if config.get("model_type") != "llama":
        raise GgufExportError(f"{draft_dir}: model_type {config.get('model_type')!r}; only Llama drafts export to GGUF here")
    tensors = _read_weights(draft_dir)
    n_vocab = _check_pairing(config, reader, draft_dir)
    n_layers, n_head = config["num_hidden_layers"], config["num_attention_heads"]
    n_head_kv = config.get("num_key_value_heads", n_head)

    out = {"token_embd.weight": tensors.pop("model.embed_tokens.weight"), "output_norm.weight": tensors.pop("model.norm.weight")}
    if "lm_head.weight" in tensors and not config.get("tie_word_embeddings", False):
        out["output.weight"] = tensors.pop("lm_head.weight")
    tensors.pop("lm_head.weight", None)
    names = {f"model.layers.{i}.{hf}": f"blk.{i}.{ours}" for i in range(n_layers) for hf, ours in _LAYER_NAMES.items()}
    out.update(_gguf_tensors(tensors, names, n_head, n_head_kv, draft_dir))
    leftover = [k for k in tensors if "rotary_emb" not in k]
    if leftover:
        raise GgufExportError(f"{draft_dir}: tensors with no GGUF name: {leftover[:5]}")
    overrides = {"llama.block_count": n_layers, "llama.feed_forward_length": config["intermediate_size"],
                 "general.name": f"specdistill draft ({n_layers} layers)"}
    _write_gguf(out_path, "llama", reader, overrides, out, dtype)

    head = "full"
    if draft_vocab_path(draft_dir) is not None:
        head = (f"full ({n_vocab} tokens): the draft's reduced vocabulary is not carried over, llama.cpp requires the "
                f"draft vocabulary to match the target's within {LLAMA_VOCAB_MAX_SIZE_DIFFERENCE} tokens")
    return GgufExport(str(out_path), n_layers, n_vocab, head)


def _check_eagle3(config: dict, fields: dict, head_dir: Path) -> list[str]:
    """The head against the target GGUF (widths, vocabulary, feature layers, token texts), with the
    same checks and messages as loading it on the target in PyTorch. Returns the target's tokens."""
    tokens = fields["tokenizer.ggml.tokens"].contents()
    target = SimpleNamespace(hidden_size=fields["llama.embedding_length"].contents(), vocab_size=len(tokens),
                             num_hidden_layers=fields["llama.block_count"].contents())
    try:
        check_fits(config, target, where=str(head_dir))
    except Eagle3ShapeError as exc:
        raise GgufExportError(f"{exc} (the target GGUF's shapes)") from exc
    _check_tokens(head_dir, tokens, config["vocab_size"])
    return tokens


def _refuse_norm_options(config: dict, head_dir: Path) -> None:
    """llama.cpp's eagle3 graph has no Eagle 3.1 norms: such a head would draft there as another head."""
    on = [name for name, set_ in norm_options(config).items() if set_]
    if on:
        what = "; ".join(f"`{name}: true` ({NORM_OPTIONS[name]})" for name in on)
        verb = "is" if len(on) == 1 else "are"
        raise GgufExportError(f"{head_dir}: {what} {verb} not computed by llama.cpp's eagle3 graph, so the head is refused "
                              "rather than exported without it (vLLM runs it: `draft export`)")


def export_eagle3_gguf(head_dir: str | os.PathLike, target_gguf: str | os.PathLike,
                       out_path: str | os.PathLike) -> GgufExport:
    """Write `out_path` (atomically, f16): the EAGLE-3 head in `head_dir` as llama.cpp's `eagle3` architecture,
    paired with the target GGUF (its tokenizer and metadata)."""
    head_dir, out_path = Path(head_dir), Path(out_path)
    if not is_eagle3_dir(head_dir):
        raise GgufExportError(f"{head_dir}: not an EAGLE-3 head (config.json must name LlamaForCausalLMEagle3)")
    config = read_config(head_dir)
    _refuse_norm_options(config, head_dir)
    reader = gguf.GGUFReader(str(target_gguf))
    tokens = _check_eagle3(config, _target_llama(reader), head_dir)
    tensors = _read_weights(head_dir)
    d2t = tensors.pop("d2t", None)
    tensors.pop("t2d", None)  # llama.cpp does not read it
    if d2t is None:
        raise GgufExportError(f"{head_dir}: no d2t tensor (the draft vocabulary's map to target ids)")
    target_ids = d2t.astype(np.int64) + np.arange(d2t.size, dtype=np.int64)
    if target_ids.min() < 0 or target_ids.max() >= len(tokens) or np.unique(target_ids).size != target_ids.size:
        raise GgufExportError(f"{head_dir}: d2t maps the draft vocabulary outside the target's {len(tokens)} tokens or "
                              "onto the same token twice")
    n_head = config["num_attention_heads"]
    out = _gguf_tensors(tensors, _EAGLE3_NAMES, n_head, config.get("num_key_value_heads", n_head), head_dir)
    out["d2t"] = target_ids
    if tensors:
        raise GgufExportError(f"{head_dir}: tensors with no GGUF name: {sorted(tensors)[:5]}")
    if "rope_freqs.weight" in {t.name for t in reader.tensors}:  # llama3-style rope: the head rotates as its target
        out["rope_freqs.weight"] = np.array(next(t.data for t in reader.tensors if t.name == "rope_freqs.weight"))

    layers = [int(i) for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    overrides = {
        "general.name": f"specdistill EAGLE-3 head (target layers {layers})",
        f"{EAGLE3_ARCH}.block_count": 1,
        f"{EAGLE3_ARCH}.embedding_length": config["hidden_size"],
        f"{EAGLE3_ARCH}.feed_forward_length": config["intermediate_size"],
        f"{EAGLE3_ARCH}.attention.head_count": n_head,
        f"{EAGLE3_ARCH}.attention.head_count_kv": config.get("num_key_value_heads", n_head),
        f"{EAGLE3_ARCH}.attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        f"{EAGLE3_ARCH}.rope.dimension_count": head_dim,
        f"{EAGLE3_ARCH}.target_layers": layers,
        f"{EAGLE3_ARCH}.target_hidden_size": int(config["target_hidden_size"]),
    }
    if config.get("rope_theta") is not None:
        overrides[f"{EAGLE3_ARCH}.rope.freq_base"] = float(config["rope_theta"])
    _write_gguf(out_path, EAGLE3_ARCH, reader, overrides, out, "f16")
    head = f"draft vocabulary of {d2t.size} tokens (d2t), of the target's {len(tokens)}"
    return GgufExport(str(out_path), 1, len(tokens), head, spec_type="draft-eagle3")


def export_gguf(draft_dir: str | os.PathLike, target_gguf: str | os.PathLike,
                out_path: str | os.PathLike) -> GgufExport:
    """Either kind of draft directory: an EAGLE-3 head (known by its config) or a layer-extracted draft."""
    export = export_eagle3_gguf if is_eagle3_dir(draft_dir) else export_draft_gguf
    return export(draft_dir, target_gguf, out_path)


def gguf_spec_type(path: str | os.PathLike) -> str:
    """The llama-server --spec-type that loads a draft GGUF, from its architecture."""
    field = gguf.GGUFReader(str(path)).fields.get("general.architecture")
    return "draft-eagle3" if field is not None and field.contents() == EAGLE3_ARCH else "draft-simple"
