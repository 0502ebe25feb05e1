import json
import os

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
    a = load_model(tiny_dir, dtype="float32")  # the weights as stored: what the fingerprint hashes
    b = load_model(tiny_dir, dtype="float32")
    assert a.fingerprint == b.fingerprint == load_model(tiny_dir, dtype="bfloat16").fingerprint
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


# --------------------------------------------------------------------------------------------
# content integrity: the GGUF cache and the fingerprint record


def _overwrite_keeping_stat(path, offset: int, length: int) -> None:
    """Bytes overwritten in place with size and modification time kept (what a stat check misses)."""
    import os

    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\x00" * length)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """convert_gguf over a tiny model: the GGUF reader replaced, counting conversions."""
    import transformers

    from specdistill.modeling import models

    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    tok = train_bpe(300)
    conversions = []

    def from_pretrained(*args, **kwargs):
        conversions.append(args)
        return make_tiny_llama(vocab_size=len(tok), seed=5)

    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", lambda *a, **k: tok)
    assert transformers  # the real loader is restored after the test
    return gguf, conversions


def test_a_corrupted_model_cache_is_rebuilt_from_the_gguf(fake_gguf, tmp_path, capsys):
    from safetensors.torch import load_file

    from specdistill.modeling.models import check_model_cache

    gguf, conversions = fake_gguf
    cache = convert_gguf(gguf, tmp_path / "cache")
    weights = cache / "model.safetensors"
    good = {k: t.clone() for k, t in load_file(str(weights)).items()}
    assert convert_gguf(gguf, cache) == cache and len(conversions) == 1  # a sound cache is reused
    _overwrite_keeping_stat(weights, weights.stat().st_size // 2, 4096)
    from specdistill.modeling.fingerprints import WeightsIntegrityError

    with pytest.raises(WeightsIntegrityError, match="model.safetensors: content differs"):
        check_model_cache(cache)
    assert convert_gguf(gguf, cache) == cache and len(conversions) == 2  # rebuilt, not trusted
    assert "rebuilding the model cache" in capsys.readouterr().err
    rebuilt = load_file(str(weights))
    assert all(torch.equal(rebuilt[k], good[k]) for k in good)
    weights.touch()  # a new mtime, the same content: a full hash says so, no rebuild
    assert convert_gguf(gguf, cache) == cache and len(conversions) == 2
    source = cache / "specdistill_source.json"
    record = json.loads(source.read_text())
    record["weights"]["model.safetensors"]["sha256"] = "0" * 64  # an edited record is no record
    source.write_text(json.dumps(record))
    assert convert_gguf(gguf, cache) == cache and len(conversions) == 3


def _edit_keeping_stat(path, old: str, new: str) -> None:
    """A same-length text edit with size and modification time kept."""
    assert len(old) == len(new)
    st = path.stat()
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def _swap_two_vocab_entries(path) -> None:
    """tokenizer.json with two tokens' ids exchanged (same size), mtime kept."""
    st = path.stat()
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    a, b = [t for t in vocab if len(t) == 2][:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_every_file_of_a_model_cache_is_checked_like_its_weights(fake_gguf, tmp_path, capsys):
    """An rms_norm_eps edit in the cache's config.json (mtime kept) changed what generate wrote, with
    exit 0 and the same fingerprint; a tokenizer.json with two entries swapped changed the fingerprint silently."""
    from specdistill.modeling.fingerprints import WeightsIntegrityError
    from specdistill.modeling.models import check_model_cache

    gguf, conversions = fake_gguf
    cache = convert_gguf(gguf, tmp_path / "cache")
    config = cache / "config.json"
    eps = json.loads(config.read_text())["rms_norm_eps"]
    _edit_keeping_stat(config, f'"rms_norm_eps": {eps}', f'"rms_norm_eps": {str(eps).replace("1", "9")}')
    with pytest.raises(WeightsIntegrityError, match="config.json: content differs"):
        check_model_cache(cache)
    assert convert_gguf(gguf, cache) == cache and len(conversions) == 2  # rebuilt from the GGUF, not trusted
    assert json.loads(config.read_text())["rms_norm_eps"] == eps
    assert "config.json: content differs" in capsys.readouterr().err
    _swap_two_vocab_entries(cache / "tokenizer.json")
    with pytest.raises(WeightsIntegrityError, match="tokenizer.json: content differs"):
        check_model_cache(cache)
    (cache / "generation_config.json").unlink()
    with pytest.raises(WeightsIntegrityError, match="generation_config.json is missing"):
        check_model_cache(cache)
    assert convert_gguf(gguf, cache) == cache and len(conversions) == 3
    (cache / "special_tokens_map.json").write_text("{}")
    with pytest.raises(WeightsIntegrityError, match="special_tokens_map.json is new"):
        check_model_cache(cache)


def test_a_cache_recorded_before_files_were_gets_them_recorded_then_checked(fake_gguf, tmp_path):
    from specdistill.modeling.fingerprints import WeightsIntegrityError, sealed
    from specdistill.modeling.models import SOURCE_FILE, check_model_cache

    gguf, conversions = fake_gguf
    cache = convert_gguf(gguf, tmp_path / "cache")
    record = json.loads((cache / SOURCE_FILE).read_text())
    old = {k: v for k, v in record.items() if k not in ("check", "files")}
    old["weights"] = {n: e for n, e in old["weights"].items() if n.endswith(".safetensors")}
    (cache / SOURCE_FILE).write_text(json.dumps(sealed(old)))  # as an older version wrote it
    check_model_cache(cache)  # the weights verified, the other files recorded now
    assert "config.json" in json.loads((cache / SOURCE_FILE).read_text())["weights"]
    _edit_keeping_stat(cache / "config.json", '"rms_norm_eps"', '"rms_norm_ePs"')
    with pytest.raises(WeightsIntegrityError, match="config.json: content differs"):
        check_model_cache(cache)


def test_a_target_directory_whose_files_changed_says_so_when_its_fingerprint_is_taken_again(tiny_dir, capsys):
    first = load_model(tiny_dir).fingerprint
    capsys.readouterr()
    _swap_two_vocab_entries(tiny_dir / "tokenizer.json")
    second = load_model(tiny_dir).fingerprint
    err = capsys.readouterr().err
    assert second != first and "tokenizer.json" in err and "changed since its fingerprint was recorded" in err
    assert load_model(tiny_dir).fingerprint == second and "changed since" not in capsys.readouterr().err  # once
    _edit_keeping_stat(tiny_dir / "config.json", '"rms_norm_eps": 1e-06', '"rms_norm_eps": 9e-06')
    assert load_model(tiny_dir).fingerprint == second  # the fingerprint covers architecture, weights, tokenizer
    assert "config.json" in capsys.readouterr().err


def test_an_edited_fingerprint_is_not_accepted(tiny_dir):
    true = load_model(tiny_dir).fingerprint
    record_path = tiny_dir / "specdistill_fingerprint.json"
    record = json.loads(record_path.read_text())
    record["fingerprint"] = "0123456789abcdef"
    record_path.write_text(json.dumps(record))
    assert load_model(tiny_dir).fingerprint == true
    assert json.loads(record_path.read_text())["fingerprint"] == true  # and the record is written again


def test_weights_rewritten_with_size_and_mtime_kept_get_a_new_fingerprint(tiny_dir):
    first = load_model(tiny_dir).fingerprint
    weights = tiny_dir / "model.safetensors"
    header = 8 + int.from_bytes(weights.read_bytes()[:8], "little")
    _overwrite_keeping_stat(weights, header + 64, 256)  # tensor bytes, not the header
    assert load_model(tiny_dir).fingerprint != first


def _reseal_stat(record_path, weights) -> None:
    """The record told the file's current stat: a write the stat cannot show (below the file system)."""
    from specdistill.modeling.fingerprints import _stat, sealed

    record = json.loads(record_path.read_text())
    record["weights"][weights.name]["stat"] = _stat(weights)
    record_path.write_text(json.dumps(sealed(record)))


@pytest.fixture
def few_samples(monkeypatch):
    """A sampling stride of a third of a tiny file: an overwrite between two sampled blocks, as in the
    finding's 200 KB between the demo cache's blocks."""
    from specdistill.modeling import fingerprints as integrity

    monkeypatch.setattr(integrity, "SAMPLE_BLOCKS", 4)
    monkeypatch.setattr(integrity, "SAMPLE_BYTES", 256)


def test_an_overwrite_between_sampled_blocks_is_caught_at_the_next_load(fake_gguf, tmp_path, few_samples):
    """Size and mtime kept, the sampled blocks untouched: the per-load check passed; ctime says it was written."""
    from specdistill.modeling.fingerprints import WeightsIntegrityError, sample_digest
    from specdistill.modeling.models import check_model_cache

    gguf, conversions = fake_gguf
    cache = convert_gguf(gguf, tmp_path / "cache")
    weights = cache / "model.safetensors"
    sampled = sample_digest(weights)
    _overwrite_keeping_stat(weights, weights.stat().st_size // 6, 2048)
    assert sample_digest(weights) == sampled  # between the sampled blocks
    with pytest.raises(WeightsIntegrityError, match="model.safetensors: content differs"):
        check_model_cache(cache)
    assert convert_gguf(gguf, cache) == cache and len(conversions) == 2  # rebuilt


def test_the_full_check_finds_what_the_sampled_one_cannot(fake_gguf, tmp_path, monkeypatch, few_samples, capsys):
    from specdistill.modeling import models
    from specdistill.modeling.models import check_model_cache, verify_model_files

    monkeypatch.setenv("SPECDISTILL_MODEL_CACHE", str(tmp_path / "models"))
    gguf, conversions = fake_gguf
    check = verify_model_files(gguf)
    weights = check.path / "model.safetensors"
    files = sum(p.stat().st_size for p in check.path.iterdir() if p.name in ("model.safetensors", "config.json", "tokenizer.json"))
    assert check.outcome == "verified" and check.bytes > files and len(conversions) == 1  # every file, not only the weights
    good = weights.read_bytes()
    _overwrite_keeping_stat(weights, weights.stat().st_size // 6, 2048)
    _reseal_stat(check.path / models.SOURCE_FILE, weights)
    check_model_cache(check.path)  # the per-load check cannot see it
    again = verify_model_files(gguf)
    assert again.outcome == "rebuilt" and "model.safetensors: content differs" in again.detail
    assert len(conversions) == 2 and weights.read_bytes() == good
    assert "rebuilding the model cache" in capsys.readouterr().err


def test_the_full_check_of_a_target_directory_drops_a_stale_fingerprint(tiny_dir, few_samples):
    from specdistill.modeling.models import FINGERPRINT_FILE, verify_model_files

    first = load_model(tiny_dir).fingerprint
    assert verify_model_files(tiny_dir).outcome == "verified"
    weights = tiny_dir / "model.safetensors"
    header = 8 + int.from_bytes(weights.read_bytes()[:8], "little")
    _overwrite_keeping_stat(weights, header + 64, 256)
    _reseal_stat(tiny_dir / FINGERPRINT_FILE, weights)
    assert load_model(tiny_dir).fingerprint == first  # the sampled check missed it: the old identity
    assert verify_model_files(tiny_dir).outcome == "fingerprint dropped"
    assert load_model(tiny_dir).fingerprint != first  # a new target version, as the content says


@pytest.mark.e2e
def test_four_megabytes_overwritten_in_the_demo_cache_are_detected(tmp_path):
    """The finding: 4 MB zeroed inside the demo cache's model.safetensors, size and mtime kept, gave
    `generate` exit 0 with output_ids all 0 and the old fingerprint."""
    import shutil

    from specdistill.modeling.fingerprints import WeightsIntegrityError
    from specdistill.modeling.models import check_model_cache

    cache = tmp_path / "demo-cache"
    shutil.copytree(resolve_model_dir("demo"), cache)
    check_model_cache(cache)
    weights = cache / "model.safetensors"
    _overwrite_keeping_stat(weights, weights.stat().st_size // 3, 4 << 20)
    with pytest.raises(WeightsIntegrityError, match="model.safetensors"):
        check_model_cache(cache)


@pytest.mark.parametrize("flags, want", [("avx2 avx512f avx512_bf16", torch.bfloat16), ("avx2 fma", torch.float32)])
def test_load_model_defaults_to_auto_as_every_config_does(tiny_dir, monkeypatch, flags, want):
    from specdistill.hardware import FLAGS_ENV
    from specdistill.modeling.models import resolve_dtype

    monkeypatch.setenv(FLAGS_ENV, flags)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # the flags are emulated: no oneDNN packing (an AVX2-only CPU would refuse its bf16 reorder)
    monkeypatch.setattr("specdistill.modeling.models.packing_available", lambda: False)
    assert resolve_dtype("auto") == want
    assert load_model(tiny_dir).model.dtype == want
    assert load_model(tiny_dir, dtype="float32").model.dtype == torch.float32


def test_a_shared_target_is_loaded_once_per_process_and_again_when_its_files_change(tmp_path, monkeypatch):
    """The nightly's stages each ask for the target; it is read once, frozen, and a target updated on disk
    (new weights, same directory) is read afresh rather than served stale."""
    from specdistill.modeling import models

    target_dir = save_tiny_target(tmp_path / "target")
    loads = []
    real = models.load_model
    monkeypatch.setattr(models, "load_model", lambda ref, **kw: (loads.append((str(ref), kw)), real(ref, **kw))[1])
    first = models.shared_model(target_dir, dtype="float32")
    assert models.shared_model(target_dir, dtype="float32") is first and len(loads) == 1
    assert not any(p.requires_grad for p in first.model.parameters())
    other = models.shared_model(target_dir, dtype="bfloat16")  # another dtype is another model
    assert other is not first and other.model.dtype == torch.bfloat16 and len(loads) == 2
    weights = next(target_dir.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # the target updated
    assert models.shared_model(target_dir, dtype="float32") is not first and len(loads) == 3
    assert len(models._SHARED) == models.SHARED_MODELS  # the oldest dropped
    assert models.load_model(target_dir, dtype="float32") is not first  # load_model: always a private copy


@pytest.mark.parametrize("template, says", [
    ("{{ messages.__class__.__mro__[1].__subclasses__() }}", "blocked by the Jinja sandbox"),
    ("{% for m in messages %}{{ m['content'] }", "does not render"),
])
def test_a_chat_template_that_cannot_run_is_refused_at_load_in_one_line(tmp_path, capsys, template, says):
    from specdistill.cli import main

    tok = train_bpe(300)
    tok.chat_template = template
    target = save_tiny_target(tmp_path / "target", tokenizer=tok)
    with pytest.raises(ModelLoadError, match=says) as caught:
        load_model(target)
    assert str(target) in str(caught.value)
    assert main(["generate", "--target", str(target), "--prompt", "hi", "--max-new-tokens", "2", "--ngram"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"specdistill: error: {target}") and says in err[-1] and "Traceback" not in "".join(err)
