"""The suffix drafter in operations: its serving config for each engine, the nightly's serving choice,
and the monitor's fallback, which measures it only while its corpus is of the served target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdistill.data.prompts import Prompt
from specdistill.modeling.models import LoadedModel
from specdistill.ops import replay
from specdistill.ops.policy import GateVerdict
from specdistill.ops.serving import ServingConfig, read_serving_config, write_serving_config
from specdistill.pipeline.layout import sglang_corpus_path
from specdistill.pipeline.outputs import ServingDecision, TargetInfo
from specdistill.pipeline.serving import serving_config
from specdistill.pipeline.stages.choose_mode import serving_candidates
from specdistill.pipeline.stages.corpus import export_sglang_corpus
from specdistill.speculative.specs import DrafterSpec
from specdistill.speculative.suffix_corpus import CorpusMeta, save_corpus
from tests.conftest import bench_result, make_tiny_llama, train_bpe


def _corpus(tmp_path: Path, fingerprint: str = "fp-now", tokenizer: str = "tok") -> Path:
    return save_corpus(tmp_path / "suffix_corpus.safetensors", [[1, 2, 3, 4], [5, 6, 7]],
                       CorpusMeta(target_fingerprint=fingerprint, tokenizer=tokenizer))


def test_suffix_mode_gives_vllm_suffix_and_sglang_ngram_with_the_corpus(tmp_path):
    cfg = ServingConfig(mode="suffix", suffix_corpus="/c/suffix_corpus.safetensors", suffix_corpus_tokens=7,
                        suffix_corpus_sglang="/c/suffix_corpus.sglang.jsonl", num_speculative_tokens=8)
    assert cfg.vllm() == {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 24,
                          "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1,
                          "suffix_decoding_max_cached_requests": 10000}
    flags = cfg.sglang()
    assert flags[:2] == ["--speculative-algorithm", "NGRAM"]
    assert flags[flags.index("--speculative-ngram-external-corpus-path") + 1] == "/c/suffix_corpus.sglang.jsonl"
    assert int(flags[flags.index("--speculative-ngram-external-sam-budget") + 1]) > 0
    assert int(flags[flags.index("--speculative-ngram-external-corpus-max-tokens") + 1]) >= 7
    assert read_serving_config(write_serving_config(cfg, tmp_path / "serving.json")) == cfg
    assert "suffix corpus" in cfg.render()
    plain = ServingConfig(mode="suffix", suffix_corpus="/c/x.safetensors")
    assert "--speculative-ngram-external-corpus-path" not in plain.sglang()  # no export: SGLang's own trie only
    with pytest.raises(ValueError, match="needs its corpus"):
        ServingConfig(mode="suffix")


def test_sglang_export_is_one_json_string_per_answer_of_its_own_tokenizer(tmp_path):
    from specdistill.modeling.fingerprints import tokenizer_digest
    from specdistill.speculative.suffix_corpus import CorpusError

    tok = train_bpe(300)
    corpus = _corpus(tmp_path, tokenizer=tokenizer_digest(tok))
    out = export_sglang_corpus(corpus, tok)
    assert out == sglang_corpus_path(corpus)
    assert [json.loads(line) for line in out.read_text().splitlines()] == [
        tok.decode(ids, skip_special_tokens=True) for ids in ([1, 2, 3, 4], [5, 6, 7])]
    with pytest.raises(CorpusError, match="another tokenizer"):  # its ids would decode to other text
        export_sglang_corpus(corpus, train_bpe(120))


def _entry(spec: str, speedup: float):
    return bench_result(spec, speedup, gamma=8)


def test_the_nightly_serves_the_suffix_drafter_and_never_the_hybrid(tmp_path):
    from specdistill.modeling.fingerprints import tokenizer_digest

    tok = train_bpe(300)
    corpus = _corpus(tmp_path, tokenizer=tokenizer_digest(tok))
    export_sglang_corpus(corpus, tok)
    results = {"ngram": _entry("ngram", 1.2), "suffix": _entry(f"suffix:{corpus}", 1.5),
               "hybrid": _entry(f"hybrid:/d,{corpus}", 1.9), "generic": _entry("draft_model:/g", 2.0)}
    assert set(serving_candidates(results, GateVerdict(False))) == {"ngram", "suffix"}
    decision = ServingDecision(mode="suffix", name="suffix", spec=DrafterSpec("suffix", str(corpus)), gamma=8, speedup=1.5,
                               reason="suffix measured fastest", measured={}, measured_on="harness")
    cfg = serving_config(decision, TargetInfo("demo", "/t", "fp-now", num_layers=2, vocab_size=32, dtype="float32"))
    assert cfg.mode == "suffix" and cfg.suffix_corpus == str(corpus) and cfg.suffix_corpus_tokens == 7
    assert cfg.suffix_corpus_sglang == str(sglang_corpus_path(corpus))
    assert cfg.vllm()["num_speculative_tokens"] == 8


def test_the_monitor_measures_the_suffix_fallback_only_for_the_target_its_corpus_is_of(tmp_path, monkeypatch):
    target = LoadedModel(make_tiny_llama(vocab_size=32, hidden=16, layers=2, seed=0), train_bpe(300), tmp_path, "fp-now")
    seen = {}

    def fake_bench(model, tokenizer, drafters, prompts, config, progress=True, **kw):
        seen["drafters"] = dict(drafters)
        from specdistill.speculative.harness_bench import BenchResult

        return {name: BenchResult(name, 4, 8, 1, True, True, 0, 0.5, 2.0, [0.5], 0, 0, 0, 10.0, 15.0,
                                  1.5 if name == "suffix" else 1.1, None, None, stats={"generated_tokens": 100})
                for name in drafters}

    monkeypatch.setattr(replay, "run_bench_many", fake_bench)
    prompts = [Prompt("", ids=[1, 2, 3])]
    current = replay.choose_fallback(target, prompts, exit_layers=(),
                                          suffix_corpus=_corpus(tmp_path, tokenizer=target.tokenizer_digest),
                                          min_tokens=1, progress=False)
    assert "suffix" in seen["drafters"] and current.mode == "suffix" and current.suffix_corpus
    stale_dir = tmp_path / "old"
    stale_dir.mkdir()
    stale = replay.choose_fallback(target, prompts, exit_layers=(), suffix_corpus=_corpus(stale_dir, "fp-old"),
                                        min_tokens=1, progress=False)
    assert "suffix" not in seen["drafters"] and stale.mode == "ngram"
    assert "stale" in stale.reason and "fp-old" in stale.reason and stale.suffix_corpus is None
    other_dir = tmp_path / "other-tokenizer"  # ids of another tokenizer (an edited digest): skipped, and why
    other_dir.mkdir()
    other = replay.choose_fallback(target, prompts, exit_layers=(), suffix_corpus=_corpus(other_dir),
                                        min_tokens=1, progress=False)
    assert "suffix" not in seen["drafters"] and other.mode == "ngram" and "another tokenizer" in other.reason
