"""Cache shards carry checksums: a bad teacher or feature shard is named, quarantined and answered
again on the next run; a corrupt cache key file names its path."""

from __future__ import annotations

import json

import pytest
import torch

from specdistill.data.prompts import Prompt
from specdistill.distill import shards
from specdistill.distill.examples import read_done
from specdistill.distill.features import FeatureCache
from specdistill.distill.shards import CorruptShardError
from specdistill.distill.teacher import TeacherCache
from specdistill.pipeline.stages.answers.harness import generate_answers
from tests.conftest import make_tiny_llama, train_bpe

FP = "f" * 16


def _entries(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"e{i}": {"input_ids": torch.arange(5, dtype=torch.int32), "logprobs": torch.randn(4, 8, generator=g),
                      "indices": torch.randint(0, 90, (4, 8), dtype=torch.int32, generator=g),
                      "residual": torch.rand(4, generator=g)} for i in range(n)}


def _scramble(path):
    """Values overwritten in place, the file's size kept: a valid safetensors file with other numbers."""
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    for i in range(header, len(data), 7):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def test_a_scrambled_shard_is_named_and_quarantined_not_trained_on(tmp_path):
    cache = TeacherCache.create(tmp_path / "c", fingerprint=FP, k=8, temperature=1.0, vocab="full")
    cache.write_shard("0000000", _entries())
    good = cache.write_shard("0000001", _entries(seed=1))
    assert set(TeacherCache.open(tmp_path / "c", fingerprint=FP).load_all()) == {"e0", "e1", "e2"}
    bad = tmp_path / "c" / "shard-0000000.safetensors"
    _scramble(bad)
    with pytest.raises(CorruptShardError, match=r"shard-0000000.safetensors is checksum mismatch") as err:
        cache.load_all()
    assert "the next run answers its examples again" in str(err.value)
    assert not bad.exists() and good.exists()
    (moved,) = (tmp_path / "c" / "quarantine").glob("shard-0000000.safetensors.*[0-9]")
    assert "checksum mismatch" in moved.with_name(moved.name + ".reason").read_text()


def test_a_truncated_shard_names_its_file_instead_of_a_bare_safetensor_error(tmp_path):
    cache = FeatureCache.create(tmp_path / "f", fingerprint=FP, layers=[0, 1, 2], data="d", prompt_context=None)
    path = cache.write_shard("0000000", {"e0": {"input_ids": torch.arange(4, dtype=torch.int32),
                                                "start": torch.tensor(0), "features": torch.randn(3, 6).bfloat16()}})
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(CorruptShardError, match=r"shard-0000000.safetensors is unreadable"):
        cache.load_all()
    assert cache.verified_ids() == (set(), [])  # quarantined: the resume check sees it missing


def test_verified_ids_quarantine_bad_shards_and_list_them(tmp_path):
    cache = TeacherCache.create(tmp_path / "c", fingerprint=FP, k=8, temperature=1.0, vocab="full")
    cache.write_shard("a", _entries(2))
    cache.write_shard("b", {"x0": _entries(1)["e0"]})
    _scramble(tmp_path / "c" / "shard-b.safetensors")
    ids, bad = cache.verified_ids()
    assert ids == {"e0", "e1"} and len(bad) == 1 and "shard-b.safetensors: checksum mismatch" in bad[0]
    assert len(cache) == 2


def test_shards_are_private_files_in_a_private_directory(tmp_path):
    cache = TeacherCache.create(tmp_path / "c", fingerprint=FP, k=8, temperature=1.0, vocab="full")
    path = cache.write_shard("a", _entries(1))
    assert (tmp_path / "c").stat().st_mode & 0o777 == 0o700 and path.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("cls, meta, kwargs", [
    (TeacherCache, "teacher_cache.json", {}),
    (FeatureCache, "feature_cache.json", {"layers": [0, 1, 2]}),
])
def test_a_corrupt_cache_key_file_names_its_path(tmp_path, cls, meta, kwargs):
    (tmp_path / meta).write_text('{"fingerprint": "ff",\n')
    with pytest.raises(ValueError, match=f"corrupt cache file {tmp_path / meta}"):
        cls.open(tmp_path, fingerprint=FP, **kwargs)


def test_a_bad_shard_is_answered_again_on_the_next_run(tmp_path):
    """Resume was keyed on the answers JSONL alone: a bad shard failed every later nightly the same way."""
    tok = train_bpe(120)
    target = make_tiny_llama(vocab_size=len(tok), hidden=32, layers=2, seed=3, tie=False)
    prompts = [Prompt(id=f"q{i}", messages=[{"role": "user", "content": text}])
               for i, text in enumerate(["hello world", "def add(a, b):", "the quick brown fox", "import torch"])]
    cache = TeacherCache.create(tmp_path / "c", fingerprint=FP, k=4, temperature=1.0, vocab="full", data="gen")
    out = tmp_path / "train_generated.jsonl"
    first = generate_answers(target, tok, prompts, out, batch_size=2, max_new_tokens=5, teacher_cache=cache,
                             progress=False)
    rows = {i: {k: t.clone() for k, t in e.items()} for i, e in cache.load_all().items()}
    victim = sorted((tmp_path / "c").glob("shard-*.safetensors"))[0]
    _scramble(victim)
    with pytest.raises(CorruptShardError, match=victim.name):  # what the training stage meets
        TeacherCache.open(tmp_path / "c", fingerprint=FP).load_all()

    again = generate_answers(target, tok, prompts, out, batch_size=2, max_new_tokens=5, teacher_cache=cache,
                             progress=False)
    assert {i: r["response_ids"] for i, r in again.items()} == {i: r["response_ids"] for i, r in first.items()}
    lines = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(lines) == sorted(p.id for p in prompts)  # one record per answer, none lost, none twice
    healed = TeacherCache.open(tmp_path / "c", fingerprint=FP).load_all()
    assert set(healed) == set(rows)
    for ex_id, entry in rows.items():
        torch.testing.assert_close(healed[ex_id]["logprobs"], entry["logprobs"])
    assert sorted(read_done(out)) == sorted(first)
    assert list((tmp_path / "c" / "quarantine").glob("*.reason"))


def test_a_shard_without_its_checksum_is_quarantined_not_trusted(tmp_path):
    """A shard whose checksum metadata was removed read as a legacy shard: forged top-k indices trained."""
    from safetensors.torch import save_file

    (tmp_path / "teacher_cache.json").write_text(json.dumps({"fingerprint": FP, "k": 8}))
    cache = TeacherCache.open(tmp_path, fingerprint=FP)
    cache.write_shard("good", _entries(1, seed=1))
    forged = {f"e0/{k}": v for k, v in _entries(1)["e0"].items()}
    forged["e0/indices"] = torch.zeros_like(forged["e0/indices"])
    save_file(forged, str(tmp_path / "shard-stripped.safetensors"))  # as write_shard, without the metadata
    with pytest.raises(CorruptShardError, match=r"shard-stripped.safetensors is without a checksum"):
        cache.load_all()
    assert not (tmp_path / "shard-stripped.safetensors").exists()
    assert set(cache.load_all()) == {"e0"} and cache.load_all()["e0"]["indices"].any()  # the good shard's row
    save_file(forged, str(tmp_path / "shard-stripped2.safetensors"))
    ids, bad = shards.verified_keys(tmp_path, "input_ids")
    assert ids == {"e0"} and len(bad) == 1 and "shard-stripped2.safetensors: without a checksum" in bad[0]
    assert len(list((tmp_path / "quarantine").glob("*.reason"))) == 2
