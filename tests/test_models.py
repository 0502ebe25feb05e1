import json

import pytest
import torch

from specdistill.modeling.models import (
    ModelLoadError,
    convert_gguf,
    fingerprint,
    load_model,
    resolve_model_dir,
)
from tests.conftest import make_tiny_llama, save_tiny_target, train_bpe


@pytest.fixture
def tiny_dir(tmp_path):
    return save_tiny_target(tmp_path / "tiny")


def test_fingerprint_stable_across_loads(tiny_dir):
    a = load_model(tiny_dir)
    b = load_model(tiny_dir)
    assert a.fingerprint == b.fingerprint
    assert fingerprint(a.model, a.tokenizer) == fingerprint(b.model, b.tokenizer) == a.fingerprint


def test_fingerprint_changes_when_one_weight_changes(tiny_dir, tmp_path):
    a = load_model(tiny_dir)
    with torch.no_grad():
        a.model.model.layers[1].mlp.up_proj.weight[3, 5] += 1e-3
    assert fingerprint(a.model, a.tokenizer) != load_model(tiny_dir).fingerprint
    # and on disk: a re-saved checkpoint with that one change gets a new fingerprint
    changed = tmp_path / "changed"
    a.model.save_pretrained(changed)
    a.tokenizer.save_pretrained(changed)
    assert load_model(changed).fingerprint != load_model(tiny_dir).fingerprint


def test_fingerprint_changes_with_tokenizer(tiny_dir):
    a = load_model(tiny_dir)
    other = train_bpe(300, extra_corpus=["QuantLib QuantLib QuantLib"] * 50)
    assert fingerprint(a.model, other) != a.fingerprint


def test_fingerprint_cache_invalidated_when_weights_rewritten(tiny_dir):
    first = load_model(tiny_dir).fingerprint
    model = make_tiny_llama(vocab_size=300, seed=1)
    model.save_pretrained(tiny_dir)
    assert load_model(tiny_dir).fingerprint != first


def test_missing_and_corrupt_inputs_name_the_file(tmp_path):
    with pytest.raises(ModelLoadError, match="nothere.gguf"):
        convert_gguf(tmp_path / "nothere.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        load_model(bad)
    with pytest.raises(ModelLoadError, match="model not found"):
        load_model(tmp_path / "missing-dir")


def test_pickled_checkpoint_is_refused(tmp_path):
    d = tmp_path / "pickled"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (d / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelLoadError, match="pytorch_model.bin"):
        resolve_model_dir(d)


def test_corrupt_safetensors_names_the_directory(tiny_dir):
    (tiny_dir / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ModelLoadError, match=str(tiny_dir.name)):
        load_model(tiny_dir)
