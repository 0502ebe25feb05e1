"""EAGLE-3 heads on disk: the layout vLLM and SGLang load, field by field; loading back with a
target; refusing a head for another target before any work; `draft init --kind eagle3`."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

from specdistill.modeling import eagle3_io
from specdistill.modeling.eagle3 import Eagle3Cache, Eagle3ShapeError
from specdistill.modeling.eagle3_init import init_eagle3_from_target
from specdistill.modeling.eagle3_io import aux_layers_of, is_eagle3_dir, load_eagle3, save_eagle3
from specdistill.modeling.models import ModelLoadError, load_model
from specdistill.modeling.vocab import DraftVocab
from specdistill.speculative.specs import DrafterSpec
from tests.conftest import eval_window, save_tiny_target, train_bpe

# SpecForge configs/llama3-8B-eagle3.json (sgl-project/SpecForge; the yuhuili/EAGLE3-LLaMA3.1-Instruct-8B
# layout), plus head_dim / rope_theta from configs/llama3-70B-ealge3.json, target_hidden_size as vLLM's
# and SGLang's llama_eagle3.py read it, and eagle_config as in SpecForge's tests.
PUBLISHED_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 128000, "eos_token_id": 128001,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
    "torch_dtype": "float16", "transformers_version": "4.28.1", "use_cache": True, "vocab_size": 128256,
    "draft_vocab_size": 31960, "head_dim": 128, "rope_theta": 500000.0, "target_hidden_size": 4096,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57], "use_aux_hidden_state": True},
}
SAME_VALUE = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_act": "silu", "model_type": "llama",
              "num_hidden_layers": 1, "tie_word_embeddings": False, "use_cache": True}

# The tensors both loaders take, with their shapes (H head width, T target width, I MLP width, n/kv
# heads, d head_dim, V target vocabulary, N draft vocabulary) and dtypes. vLLM's
# Eagle3LlamaForCausalLM.load_weights: `d2t` -> draft_id_to_target_id, `t2d` skipped, `midlayer.` ->
# `layers.0.`, every name but lm_head prefixed `model.`; q/k/v and gate/up stacked. No embed_tokens:
# vLLM's EagleProposer and SGLang's EAGLE worker then use the target's.
PUBLISHED_TENSORS = {
    "fc.weight": (("H", "3T"), "float"),
    "midlayer.input_layernorm.weight": (("H",), "float"),
    "midlayer.hidden_norm.weight": (("H",), "float"),
    "midlayer.self_attn.q_proj.weight": (("n*d", "2H"), "float"),
    "midlayer.self_attn.k_proj.weight": (("kv*d", "2H"), "float"),
    "midlayer.self_attn.v_proj.weight": (("kv*d", "2H"), "float"),
    "midlayer.self_attn.o_proj.weight": (("H", "n*d"), "float"),
    "midlayer.post_attention_layernorm.weight": (("H",), "float"),
    "midlayer.mlp.gate_proj.weight": (("I", "H"), "float"),
    "midlayer.mlp.up_proj.weight": (("I", "H"), "float"),
    "midlayer.mlp.down_proj.weight": (("H", "I"), "float"),
    "norm.weight": (("H",), "float"),
    "lm_head.weight": (("N", "H"), "float"),
    "d2t": (("N",), "int64"),
    "t2d": (("V",), "bool"),
}
VLLM_PARAMETERS = {
    "model.fc.weight", "model.layers.0.input_layernorm.weight", "model.layers.0.hidden_norm.weight",
    "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.post_attention_layernorm.weight", "model.layers.0.mlp.gate_up_proj.weight",
    "model.layers.0.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight", "draft_id_to_target_id",
}


def vllm_name(name: str) -> str | None:
    """The parameter a checkpoint tensor lands in, by vLLM's llama_eagle3.py load_weights rules."""
    if name == "t2d":
        return None
    if name == "d2t":
        return "draft_id_to_target_id"
    name = name.replace("midlayer.", "layers.0.")
    for part, stacked in ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
                          (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj")):
        name = name.replace(part, stacked)
    return name if name.startswith("lm_head") else "model." + name


@pytest.fixture
def target_dir(tmp_path):
    return save_tiny_target(tmp_path / "target", layers=6, seed=1)


@pytest.fixture
def target(target_dir):
    return load_model(target_dir, dtype="float32")  # the exact-arithmetic tests


@pytest.fixture
def head_dir(target, tmp_path):
    vocab = DraftVocab(torch.arange(40, 140), target.config.vocab_size)
    head = init_eagle3_from_target(target.model, vocab, [1, 3, 4])
    with torch.no_grad():
        head.fc.weight.normal_(0, 0.1)
    return save_eagle3(head, target.tokenizer, tmp_path / "head", {"target_fingerprint": target.fingerprint})


def test_export_matches_the_published_layout(head_dir, target):
    config = json.loads((head_dir / "config.json").read_text())
    assert set(PUBLISHED_CONFIG) <= set(config), f"missing {set(PUBLISHED_CONFIG) - set(config)}"
    for key, value in SAME_VALUE.items():
        assert config[key] == value, key
    for key, value in PUBLISHED_CONFIG.items():
        assert type(config[key]) is type(value), key
    tc = target.config
    assert config["vocab_size"] == tc.vocab_size and config["draft_vocab_size"] == 100
    assert config["target_hidden_size"] == tc.hidden_size
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    assert aux_layers_of(head_dir) == [1, 3, 4] and aux_layers_of(head_dir.parent) is None
    assert config["rope_theta"] == tc.rope_parameters["rope_theta"]

    width, target_width = config["hidden_size"], config["target_hidden_size"]
    n, kv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    size = {"H": width, "3T": 3 * target_width, "2H": 2 * width, "I": config["intermediate_size"], "n*d": n * d, "kv*d": kv * d,
            "N": config["draft_vocab_size"], "V": config["vocab_size"]}
    with safe_open(str(head_dir / "model.safetensors"), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    assert set(tensors) == set(PUBLISHED_TENSORS)
    for name, (shape, dtype) in PUBLISHED_TENSORS.items():
        assert tuple(tensors[name].shape) == tuple(size[s] for s in shape), name
        assert (tensors[name].dtype.is_floating_point if dtype == "float" else str(tensors[name].dtype) == f"torch.{dtype}"), name
    # d2t: target id = draft id + d2t[draft id]; t2d marks exactly those target ids
    ids = torch.arange(100) + tensors["d2t"]
    assert torch.equal(ids, torch.arange(40, 140)) and torch.equal(tensors["t2d"].nonzero().flatten(), ids)
    assert {vllm_name(name) for name in tensors} - {None} == VLLM_PARAMETERS
    from transformers import AutoConfig  # what vLLM and SGLang parse config.json with

    read = AutoConfig.from_pretrained(head_dir)
    assert read.model_type == "llama" and read.architectures == ["LlamaForCausalLMEagle3"] and not read.tie_word_embeddings
    assert read.eagle_config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4] and read.draft_vocab_size == 100


def test_load_back_drafts_identically(head_dir, target):
    tokens = torch.tensor([[5, 9, 2, 7]])
    features = torch.randn(1, 4, 3 * target.config.hidden_size)
    loaded = load_eagle3(head_dir, target.model)
    assert is_eagle3_dir(head_dir) and not loaded.transplanted
    assert loaded.head.embed_tokens is target.model.get_input_embeddings()  # embeddings come from the target
    again = save_eagle3(loaded.head, loaded.tokenizer, head_dir.parent / "again")
    reloaded = load_eagle3(again, target.model).head
    out = [h.logits(h(tokens, h.project(features), torch.arange(4)[None], Eagle3Cache())) for h in (loaded.head, reloaded)]
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=0)
    assert torch.equal(reloaded.draft_vocab.token_ids, torch.arange(40, 140))


def test_head_runs_in_the_target_dtype(head_dir, target_dir):
    bf16 = load_model(target_dir, dtype="bfloat16")
    head = load_eagle3(head_dir, bf16.model).head
    assert head.fc.weight.dtype == torch.bfloat16 and head.d2t.dtype == torch.long


@pytest.mark.parametrize("other, match", [
    (dict(layers=6, hidden=48), "target hidden size 48"),
    (dict(layers=4), r"head reads target layers \[1, 3, 4\], the target has 4"),
])
def test_head_for_another_target_shape_is_refused_before_any_weight_is_read(head_dir, tmp_path, monkeypatch, other, match):
    from tests.conftest import make_tiny_llama

    other_target = make_tiny_llama(vocab_size=len(train_bpe(300)), hidden=other.get("hidden", 32), layers=other["layers"])
    monkeypatch.setattr(eagle3_io, "load_file", lambda *a, **k: pytest.fail("weights read before the check"))
    with pytest.raises(Eagle3ShapeError, match=match):
        load_eagle3(head_dir, other_target)


def test_shapes_decide_whether_a_head_fits_not_the_target_version(head_dir, target, monkeypatch):
    meta = json.loads((head_dir / eagle3_io.META_FILE).read_text())
    (head_dir / eagle3_io.META_FILE).write_text(json.dumps({**meta, "target_fingerprint": "0123"}))
    assert load_eagle3(head_dir, target.model).meta["target_fingerprint"] == "0123"  # an earlier version: it fits
    (head_dir / eagle3_io.META_FILE).write_text(json.dumps(meta))
    monkeypatch.setattr(eagle3_io, "load_file", lambda *a, **k: pytest.fail("weights read before the check"))
    with pytest.raises(Eagle3ShapeError, match=r"reads target layers \[1, 3, 4\], the features given are of layers \[2, 3, 3\]"):
        load_eagle3(head_dir, target.model, feature_layers=[2, 3, 3])
    from tests.conftest import make_tiny_llama

    with pytest.raises(Eagle3ShapeError, match="target vocabulary 512, head built for"):
        load_eagle3(head_dir, make_tiny_llama(vocab_size=512, layers=6))


def test_corrupt_weights_name_the_file(head_dir, target):
    (head_dir / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(Eagle3ShapeError, match="cannot read EAGLE-3 weights .*model.safetensors"):
        load_eagle3(head_dir, target.model)


def test_load_model_recognises_a_head_and_needs_its_target(head_dir, target):
    with pytest.raises(ModelLoadError, match="is an EAGLE-3 head"):
        load_model(head_dir)
    loaded = load_model(head_dir, target=target)
    assert loaded.model.aux_layers == [1, 3, 4] and len(loaded.fingerprint) == 16


def test_tokenizer_change_carries_the_draft_vocabulary_over(head_dir, target, tmp_path):
    """A target update that adds tokens: d2t/t2d remapped by string, kept rows kept, embeddings the new target's."""
    from transformers import AutoTokenizer

    from tests.conftest import make_tiny_llama

    new_tok = AutoTokenizer.from_pretrained(head_dir)
    new_tok.add_tokens(["<|fin_tool|>", "QuantLibVega"])
    new_target = make_tiny_llama(vocab_size=len(new_tok), layers=6, seed=2)
    with pytest.raises(Eagle3ShapeError, match="target vocabulary"):
        load_eagle3(head_dir, new_target)
    loaded = load_eagle3(head_dir, new_target, target_tokenizer=new_tok)
    assert loaded.transplanted and "vocabulary sizes differ" in loaded.reason
    head, old = loaded.head, load_eagle3(head_dir, target.model).head
    added = new_tok.convert_tokens_to_ids(["<|fin_tool|>", "QuantLibVega"])
    kept = head.draft_vocab.token_ids.tolist()
    assert set(added) <= set(kept) and set(range(40, 140)) <= set(kept)
    assert head.t2d.numel() == len(new_tok) and head.embed_tokens is new_target.get_input_embeddings()
    row = kept.index(77)
    torch.testing.assert_close(head.lm_head.weight[row], old.lm_head.weight[77 - 40])
    torch.testing.assert_close(head.lm_head.weight[kept.index(added[0])], new_target.lm_head.weight[added[0]])


def test_draft_init_eagle3_cli(target_dir, tmp_path, capsys):
    from specdistill.cli import main

    traffic = tmp_path / "traffic.txt"
    traffic.write_text("hello world, the quick brown fox\ndef add(a, b): return a + b\n")
    out = tmp_path / "eagle"
    assert main(["draft", "init", "--kind", "eagle3", "--target", str(target_dir), "--draft-vocab", "64",
                 "--traffic", str(traffic), str(out), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["kind"] == "eagle3" and payload["layers"] == [2, 3, 3] and payload["draft_vocab"] == 64
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 64 and config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]
    assert main(["draft", "init", "--kind", "eagle3", "--target", str(target_dir), "--layers", "0,2,5",
                 str(tmp_path / "full"), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["layers"] == [0, 2, 5] and payload["draft_vocab"] == 300
    assert main(["draft", "init", "--kind", "eagle3", "--target", str(target_dir), "--layers", "0,9,5", str(tmp_path / "bad")]) != 0
    assert "feature layers must be three layer indices in 0..5, got [0, 9, 5]" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_llama_cpp_engine_refuses_a_head_for_another_target(head_dir):
    """serving.engine=llamacpp measures a head as a draft-eagle3 GGUF paired with the target's GGUF; a
    head built for another target fails the stage by name before any server starts (so before the
    registry or serving.json are touched), and nothing is left in the GGUF cache."""
    from specdistill import paths
    from specdistill.engines.llamacpp.gguf_export import GgufExportError
    from specdistill.pipeline.nightly_recipe import load_nightly_config
    from specdistill.pipeline.stages.engine_bench import engine_benchmark

    config = load_nightly_config(None, ["serving.engine=llamacpp"])
    window = eval_window("Hi")
    with pytest.raises(GgufExportError, match=re.escape(f"EAGLE-3 head {head_dir} does not fit this target: target hidden size 576")):
        engine_benchmark(config, window, {"challenger": DrafterSpec("draft_model", str(head_dir))})
    assert not list((paths.home() / "engines").rglob("*.gguf*"))
    assert not (paths.home() / "serving.json").exists()
