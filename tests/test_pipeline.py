"""The nightly pipeline's library stages that need no target: config, gate decision, report, alignment."""

import subprocess
import sys

import pytest
import torch

from specdistill.config import ConfigError
from specdistill.modeling.vocab import DraftVocab, remap_draft_vocab
from specdistill.pipeline import nightly as pipeline
from tests.tokenizers_util import train_bpe


def test_config_defaults_and_overrides(tmp_path):
    cfg = pipeline.load_nightly_config(None, ["train.max_minutes=1.5", "bench.self_spec_layers=[4,6]"])
    assert cfg.train.max_minutes == 1.5 and cfg.bench.self_spec_layers == [4, 6]
    assert [s.format for s in cfg.sources] == ["sharegpt", "humaneval"]
    f = tmp_path / "n.yaml"
    f.write_text("window: {train_prompts: 5}\n")
    assert pipeline.load_nightly_config(f).window.train_prompts == 5


@pytest.mark.parametrize("override, match", [("trian.lr=1", "trian"), ("window.train_prompts=zero", "train_prompts")])
def test_config_errors_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        pipeline.load_nightly_config(None, [override])


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml"):
        pipeline.load_nightly_config(tmp_path / "nope.yaml")


def _result(alpha, tau, speedup=1.2, lossless=True):
    return {"acceptance_rate": alpha, "accepted_length": tau, "speedup": speedup, "lossless": lossless,
            "lossless_mismatches": 0, "cost_ratio": 0.2, "per_position_acceptance": [alpha], "spec": "x"}


def test_demo_gate_requires_beating_the_generic_draft():
    cfg = pipeline.load_nightly_config()
    assert pipeline.gate(cfg, _result(0.2, 1.5, speedup=0.8), None, {"generic": _result(0.1, 1.2)})["promote"]
    lost = pipeline.gate(cfg, _result(0.2, 1.5), None, {"generic": _result(0.25, 1.6)})
    assert not lost["passed"] and any("generic" in f for f in lost["failures"])


def test_gate_promotes_only_a_real_improvement():
    cfg = pipeline.load_nightly_config(None, ["gate.overrides={}", "gate.must_beat=[]"])
    assert pipeline.gate(cfg, _result(0.6, 2.5), None)["promote"]  # no champion: a pass promotes
    better = pipeline.gate(cfg, _result(0.62, 2.6), _result(0.6, 2.5))
    assert better["passed"] and better["promote"]
    same = pipeline.gate(cfg, _result(0.6, 2.5), _result(0.6, 2.5))
    assert same["passed"] and not same["promote"] and any("champion stays" in r for r in same["reasons"])
    low = pipeline.gate(cfg, _result(0.3, 1.9), None)
    assert not low["passed"] and not low["promote"]
    lossy = pipeline.gate(cfg, _result(0.9, 4.0, lossless=False), None)
    assert not lossy["promote"]


def test_report_table_lists_every_drafter_and_the_decision():
    results = {"challenger": _result(0.55, 2.4), "ngram": _result(0.1, 1.2, speedup=0.9)}
    verdict = {"passed": True, "reasons": ["acceptance rate 0.550 >= 0.500"]}
    text = pipeline.report_table(results, verdict, {"name": "draft-t", "version": "3"}, {"serving_config": "/s.json"})
    assert "| challenger (x) | 0.550 | 2.40 | 1.20x" in text
    assert "| d |" in pipeline.report_table({"d": {**_result(0.5, 2.0), "spec": "draft:/long/path"}})
    assert "| no speculation |" in text and "**gate: PASS**" in text
    assert "version 3 (alias `champion`)" in text and "/s.json" in text
    assert "unchanged" in pipeline.report_table(results, verdict, {"name": "d", "version": "4"}, None)


def test_remap_draft_vocab_follows_token_strings():
    old = train_bpe(300)
    new = train_bpe(360, extra_corpus=["QuantLib QuantLib"] * 100)
    new.add_tokens(["CalcBlackScholesVega"])
    kept_old = torch.arange(0, 300, 2)
    remapped = remap_draft_vocab(DraftVocab(kept_old, 300), old, new)
    new_vocab = new.get_vocab()
    for old_id in kept_old.tolist():
        token = old.convert_ids_to_tokens(old_id)
        if token in new_vocab:
            assert new_vocab[token] in remapped.token_ids.tolist()
    assert new_vocab["CalcBlackScholesVega"] in remapped.token_ids.tolist()
    assert new.eos_token_id in remapped.token_ids.tolist()
    assert remapped.target_vocab_size == len(new)


def test_library_never_imports_prefect():
    code = ("import pkgutil, importlib, sys, specdistill\n"
            "for m in pkgutil.walk_packages(specdistill.__path__, 'specdistill.'):\n"
            "    if m.name not in ('specdistill.cli', 'specdistill.ops.mlflow_draft') and '.migrations' not in m.name:\n"
            "        importlib.import_module(m.name)\n"
            "print('prefect' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
