"""The nightly pipeline's library stages that need no real target: config, gate decision, report, alignment."""

import json
import re
import subprocess
import sys
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch

from specdistill.modeling.vocab import DraftVocab, remap_draft_vocab
from specdistill.ops.policy import Check, GateVerdict
from specdistill.ops.registry import RegisteredDraft
from specdistill.pipeline.nightly_recipe import load_nightly_config, run_root
from specdistill.pipeline.outputs import Champion, GeneratedData, Promoted, ServingDecision, Trained, Untrained, Window
from specdistill.pipeline.report import report_table
from specdistill.pipeline.stages import bench
from specdistill.pipeline.stages.align import align_champion
from specdistill.pipeline.stages.distill import distill_draft
from specdistill.pipeline.stages.target import describe_target
from specdistill.pipeline.stages.window import select_window
from specdistill.recipe import ConfigError
from specdistill.speculative.specs import DrafterSpec
from tests.conftest import bench_result, train_bpe, trained_result


def test_config_defaults_and_overrides(tmp_path):
    cfg = load_nightly_config(None, ["train.optim.max_minutes=1.5", "bench.self_spec_layers=[4,6]"])
    assert cfg.train.optim.max_minutes == 1.5 and cfg.bench.self_spec_layers == [4, 6]
    assert [s.format for s in cfg.sources] == ["sharegpt", "humaneval"]
    f = tmp_path / "n.yaml"
    f.write_text("window: {train_prompts: 5}\n")
    assert load_nightly_config(f).window.train_prompts == 5


@pytest.mark.parametrize("override, match", [("trian.lr=1", "trian"), ("window.train_prompts=zero", "train_prompts")])
def test_config_errors_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_nightly_config(None, [override])


def test_the_train_section_is_the_distillation_config_with_the_nightly_defaults():
    """`train:` is a DistillConfig (the keys of `specdistill distill --config`), no copies; the derived schedule is
    computed in one place, visible after load; the keys it had before fail naming their new place."""
    from specdistill.distill.distill_recipe import DistillConfig, derived_schedule
    from specdistill.pipeline.nightly_recipe import NightlyTrain

    assert issubclass(NightlyTrain, DistillConfig)
    assert set(NightlyTrain.model_fields) == {*DistillConfig.model_fields, "incremental_lr", "incremental_steps",
                                              "incremental_deep_share"}
    demo = load_nightly_config().train
    assert (demo.kind, demo.optim.max_minutes, demo.optim.bf16) == ("eagle3", 4.5, None)
    assert (demo.optim.warmup_steps, demo.checkpoint_every, demo.eval_every) == (20, 1000, 1000) == (*derived_schedule(4000), 1000)
    cfg = load_nightly_config(None, ["train.optim.lr=0.002", "train.optim.batch_size=2", "train.optim.max_steps=7",
                                     "train.loss.kind=jsd", "train.eagle3.steps=3", "train.layers=0,3", "train.draft_vocab=null"])
    t = cfg.train
    assert (t.optim.lr, t.optim.batch_size, t.optim.max_steps, t.loss.kind, t.eagle3.steps) == (0.002, 2, 7, "jsd", 3)
    assert (t.optim.warmup_steps, t.checkpoint_every, t.eval_every) == (0, 10, 10)  # derived from 7 steps
    with pytest.raises(ConfigError, match="train.optim.lr"):
        load_nightly_config(None, ["train.optim.lr=0"])  # the distillation config's bound (lr > 0)
    with pytest.raises(ConfigError, match="eagle3 takes a divergence loss"):
        load_nightly_config(None, ["train.loss.kind=ce"])  # the head trains against its cached teacher
    for old, new in [("train.max_steps=6", "train.optim.max_steps"), ("train.lr=0.1", "train.optim.lr"),
                     ("train.loss=jsd", "train.loss.kind"), ("train.eagle3_steps=3", "train.eagle3.steps"),
                     ("train.bf16=true", "train.optim.bf16"), ("train.max_minutes=2", "train.optim.max_minutes")]:
        with pytest.raises(ConfigError, match=f"`{old.split('=')[0]}` is now `{new}`"):
            load_nightly_config(None, [old])
    with pytest.raises(ConfigError, match="train.out_dir is set by each run"):
        load_nightly_config(None, ["train.out_dir=/x"])
    # the distillation config keeps its own defaults: the nightly's live in its section
    from specdistill.distill.distill_recipe import DataConfig

    plain = DistillConfig(data=DataConfig(path="x"), draft_vocab="/a/draft")
    assert plain.draft_vocab == "/a/draft" and (plain.optim.warmup_steps, plain.checkpoint_every, plain.eval_every) == (20, 100, 50)
    with pytest.raises(ValueError, match="optim.bf16 is null"):
        DistillConfig.model_validate({"data": {"path": "x"}, "optim": {"bf16": None}})


def test_the_bench_and_gate_sections_build_their_runtime_configs_and_refuse_unknown_thresholds_at_load():
    cfg = load_nightly_config(None, ["bench.gamma=3", "bench.max_new_tokens=9", "bench.repeats=2",
                                     "gate.profile=production", "gate.overrides.min_speedup=1.1"])
    harness, engine = cfg.bench.bench_config(), cfg.bench.engine_bench_config()
    assert (harness.gamma, harness.max_new_tokens, harness.repeats) == (engine.gamma, engine.max_new_tokens,
                                                                        engine.repeats) == (3, 9, 2)
    # one default per shared setting: the nightly's section, the harness's and an engine's configs agree
    from specdistill.data.results import BenchSettings
    from specdistill.engines.endpoint_bench import EngineBenchConfig
    from specdistill.speculative.harness_bench import BenchConfig

    shared = BenchSettings().model_dump()
    for made in (load_nightly_config().bench, BenchConfig(), EngineBenchConfig()):
        assert made.model_dump(include=set(shared)) == shared == {**shared, "max_new_tokens": 40, "repeats": 1}
    gate = cfg.gate.gate_config()
    assert gate.min_speedup == 1.1 and gate.min_accepted_length == 3.0  # the production profile, one override
    with pytest.raises(ConfigError, match="unknown key 'gate.overrides.min_speed'"):
        load_nightly_config(None, ["gate.overrides.min_speed=1"])


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_nightly_config(tmp_path / "nope.yaml")


def _result(alpha, tau, speedup=1.2, lossless=True, spec="x", **fields):
    return bench_result(spec, speedup, lossless, acceptance_rate=alpha, accepted_length=tau,
                        lossless_mismatches=0 if lossless else 1, cost_ratio=0.2, per_position_acceptance=[alpha],
                        tokens_per_second_target_only=37.5, **fields)


def test_demo_gate_holds_the_red_line_and_requires_beating_the_generic_draft():
    cfg = load_nightly_config()
    # the draft gate keeps the first-position bar (the red line); speed is the serving choice's job, not the draft gate's
    assert bench.gate(cfg, _result(0.6, 2.5, speedup=0.8), None, {"generic": _result(0.1, 1.2)}).promote
    low = bench.gate(cfg, _result(0.2, 1.5, speedup=1.5), None, {"generic": _result(0.1, 1.2)})
    assert not low.passed and any("acceptance" in f for f in low.failures)
    lost = bench.gate(cfg, _result(0.6, 2.5), None, {"generic": _result(0.65, 2.6)})
    assert not lost.passed and any("generic" in f for f in lost.failures)


def test_gate_promotes_only_a_real_improvement():
    cfg = load_nightly_config(None, ["gate.overrides={}", "gate.must_beat=[]"])
    assert bench.gate(cfg, _result(0.6, 2.5), None).promote  # no champion: a pass promotes
    better = bench.gate(cfg, _result(0.62, 2.6), _result(0.6, 2.5))
    assert better.passed and better.promote
    same = bench.gate(cfg, _result(0.6, 2.5), _result(0.6, 2.5))
    assert same.passed and not same.promote and any("champion stays" in r for r in same.reasons)
    noise = bench.gate(cfg, _result(0.61, 2.51), _result(0.6, 2.5))  # below the default margin, 0.02
    assert noise.passed and not noise.promote and "min_accepted_length_gain 0.020" in noise.reasons[-1]
    wide = load_nightly_config(None, ["gate.overrides={min_accepted_length_gain: 0.2}", "gate.must_beat=[]"])
    widened = bench.gate(wide, _result(0.62, 2.6), _result(0.6, 2.5))
    assert widened.passed and not widened.promote
    low = bench.gate(cfg, _result(0.3, 1.9), None)
    assert not low.passed and not low.promote
    lossy = bench.gate(cfg, _result(0.9, 4.0, lossless=False), None)
    assert not lossy.promote


def test_report_table_lists_every_drafter_and_the_decision():
    results = {"challenger": _result(0.55, 2.4), "ngram": _result(0.1, 1.2, speedup=0.9)}
    verdict = GateVerdict(True, [Check("acceptance rate", True, 0.55, 0.5, "acceptance rate 0.550 >= 0.500")])
    text = report_table(results, verdict, RegisteredDraft("draft-t", "3", "r", "models:/draft-t/3"), Promoted("3", "/s.json"))
    assert "| challenger | 0.550 | 0.550 | 2.40 | 4 | 1.20x" in text  # first-position, then α
    assert "- challenger: `x`" in text  # the spec, below the table
    assert "| d |" in report_table({"d": _result(0.5, 2.0, spec="draft_model:/long/path")})
    assert "| no speculation |" in text and "**gate (champion draft): PASS**" in text
    assert "version 3 (alias `champion`)" in text and "/s.json" in text
    assert "unchanged" in report_table(results, verdict, RegisteredDraft("d", "4", "r", "models:/d/4"), None)


def test_report_table_names_drafters_short_and_lists_their_paths_below():
    """The specs carry long corpus and draft paths: in the first column they made the demo's table
    unreadable in a terminal, so the table names each drafter and the paths follow it."""
    corpus = "/home/me/.specdistill/runs/nightly/20261201-2008/answers/suffix_corpus.safetensors"
    head = "/home/me/.specdistill/runs/nightly/20261201-2008/challenger/draft"
    specs = {"challenger": f"draft_model:{head}", "ngram": "ngram", "self-spec:8": "self-spec:8",
             "suffix": f"suffix:{corpus}", "hybrid": f"hybrid:{head},{corpus}"}
    text = report_table({name: _result(0.4, 1.8, spec=spec) for name, spec in specs.items()})
    lines = text.splitlines()
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| drafter")]
    assert [row.split(" | ")[0][2:] for row in rows] == [*specs, "no speculation"]
    below = lines[lines.index("| no speculation | – | – | 1.00 | – | 1.00x | – | yes |") + 1:]
    for name, spec in specs.items():
        assert (f"- {name}: `{spec}`" in below) == (spec != name)  # a spec that is its own name is not repeated
    assert not any(corpus in row or head in row for row in rows)
    engine = report_table({}, speeds={"suffix": _result(0.4, 1.8, spec=f"suffix:{corpus}", engine="vllm")})
    assert "| suffix | 0.400 | 1.80 |" in engine and f"- suffix: `suffix:{corpus}`" in engine.splitlines()


def test_the_report_tells_each_slice_s_first_position_acceptance_apart():
    from dataclasses import replace

    from specdistill.data.results import SliceResult

    def sliced(code: float, chat: float | None):
        return [SliceResult("code", 5, 0.5, 2.0, 10.0, 12.0, 1.2, code), SliceResult("chat", 5, 0.4, 1.8, 10.0, 11.0, 1.1, chat)]

    results = {"challenger": replace(_result(0.49, 1.7), slices=sliced(0.561, 0.424)),
               "ngram": replace(_result(0.3, 1.5), slices=sliced(0.3, None))}  # a slice without per-position counts
    lines = report_table(results).splitlines()
    at = lines.index("first-position acceptance by slice:")
    assert lines[at + 2:at + 6] == ["| slice | prompts | challenger |", "|---|---:|---:|",
                                    "| code | 5 | 0.561 |", "| chat | 5 | 0.424 |"]
    one_slice = {"challenger": replace(_result(0.49, 1.7), slices=sliced(0.561, 0.424)[:1])}
    assert "by slice" not in report_table(one_slice)  # the table's own row says it



def test_the_report_shows_each_drafter_s_acceptance_by_draft_position():
    from dataclasses import replace

    results = {"challenger": replace(_result(0.4, 2.1), per_position_acceptance=[0.6, 0.3, 0.12]),
               "ngram": replace(_result(0.3, 1.5), per_position_acceptance=[0.4, 0.2]),
               "generic": _result(0.1, 1.1)}  # one position: its table row says it all
    lines = report_table(results).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("acceptance by draft position"))
    assert lines[at + 2:at + 6] == ["| drafter | pos 1 | pos 2 | pos 3 |", "|---|---:|---:|---:|",
                                    "| challenger | 0.600 | 0.300 (0.50) | 0.120 (0.40) |",
                                    "| ngram | 0.400 | 0.200 (0.50) | – |"]
    assert "acceptance by draft position" not in report_table({"generic": _result(0.1, 1.1)})

def test_the_gamma_note_tells_a_confirmation_that_lost_from_one_that_did_not_run():
    from dataclasses import replace

    from specdistill.data.results import GammaSearch
    from specdistill.pipeline.serving import gamma_note

    curve = {2: 1.3, 4: 1.2, 7: 1.5}
    ran = replace(_result(0.4, 2.0), gamma=4, gamma_search=GammaSearch(curve, 7, {}, {4: 1.43, 7: 1.42}))
    assert gamma_note(ran) == "γ=7 predicted best (1.50x), slower when measured, γ=4 kept: measured 1.43x at γ=4, 1.42x at γ=7"
    cut = replace(ran, gamma_search=GammaSearch(curve, 7, {}, {4: 1.43}))
    assert gamma_note(cut) == "γ=7 predicted best (1.50x), not measured, γ=4 kept: measured 1.43x at γ=4"
    won = replace(ran, gamma=7)
    assert gamma_note(won).startswith("γ=7 predicted best (1.50x), confirmed: ")


def test_report_says_when_the_best_draft_is_not_what_is_served():
    results = {"challenger": _result(0.6, 2.5, speedup=0.74, spec="draft_model:/c", dtype="bfloat16",
                                     lossless_exact=7, lossless_near_ties=3, lossless_max_margin=0.21),
               "ngram": _result(0.32, 1.6, speedup=1.33, spec="ngram", lossless_exact=10)}
    verdict = GateVerdict(True, [Check("acceptance rate", True, 0.6, 0.5, "acceptance rate 0.600 >= 0.500")])
    serving = ServingDecision(mode="ngram", name="ngram", spec=DrafterSpec("ngram"), gamma=3, speedup=1.36,
                              reason="ngram measured fastest at 1.33x (ngram 1.33x, challenger 0.74x)",
                              measured={"ngram": 1.33, "challenger": 0.74}, measured_on="PyTorch harness, bfloat16",
                              predicted_speedups={1: 1.2, 2: 1.3, 3: 1.36}, gamma_note="γ=3 confirmed")
    text = report_table(results, verdict, serving=serving)
    assert "| challenger | 0.600 | 0.600 | 2.50 | 4 | 0.74x | 0.200 | yes: 7 exact, 3 near-tie (≤ 0.21) |" in text
    assert "in bfloat16" in text and "**serving: ngram (ngram), γ=3, 1.36x measured" in text
    assert "the challenger draft runs at 0.74x here, so ngram is served instead" in text
    lossy = report_table({"challenger": _result(0.6, 2.5, lossless=False, lossless_exact=8)})
    assert "NO: 1 real mismatch" in lossy
    off = report_table(results, verdict, serving=replace(serving, mode="off", name=None, reason="nothing beats it"))
    assert "**serving: no speculation** (measured: PyTorch harness, bfloat16): nothing beats it" in off


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


@pytest.mark.e2e
def test_library_never_imports_prefect():
    code = ("import pkgutil, importlib, sys, specdistill\n"
            "for m in pkgutil.walk_packages(specdistill.__path__, 'specdistill.'):\n"
            "    if m.name not in ('specdistill.cli', 'specdistill.ops.mlflow_draft') and '.migrations' not in m.name:\n"
            "        importlib.import_module(m.name)\n"
            "print('prefect' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


# --------------------------------------------------------------------------------------------
# Stages on a tiny target: the data window, the distill cache keys, the champion's alignment


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    """An HF directory the stages load like the real target: a 4-layer Llama over a small BPE tokenizer."""
    from tests.conftest import make_tiny_llama

    path = tmp_path_factory.mktemp("target")
    tok = train_bpe(300)
    make_tiny_llama(vocab_size=len(tok), layers=4, seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


NOW = datetime(2025, 6, 1, tzinfo=timezone.utc)


def _store_with_traffic(tmp_path, url: str | None = None) -> tuple[str, Path, Path]:
    """A SQLite log store filled through the ingest API: chat traffic from long ago and from the last
    hour (OpenAI records with `created`), code prompts that arrive now, and conversations that are
    no prompt (too long, or the assistant speaks first)."""
    import json

    from specdistill.data.formats import Message
    from specdistill.data.ingest import ingest
    from specdistill.data.logstore import LogStore
    from specdistill.data.readers import Conversation

    def chat(i, created, user=None):
        turns = [{"role": "user", "content": user or f"question {i}: the quick brown fox"}, {"role": "assistant", "content": f"answer {i}"}]
        return {"messages": turns, "created": created}

    recent = NOW.timestamp() - 3600
    records = [chat(i, recent if i % 2 else datetime(2020, 1, 1, tzinfo=timezone.utc).timestamp() + i) for i in range(40)]
    records += [chat(100 + i, recent, user="def add(a, b): return a + b " * 40) for i in range(6)]  # over max_prompt_tokens
    chat_file, code_file = tmp_path / "chat.jsonl", tmp_path / "code.jsonl"
    chat_file.write_text("".join(json.dumps(r) + "\n" for r in records))
    code_file.write_text("".join(json.dumps({"prompt": f"def f{i}(x): return x + {i}", "response": "ok"}) + "\n" for i in range(30)))
    url = url or f"sqlite:///{tmp_path / 'logs.db'}"
    with LogStore(url, eval_fraction=0.3) as store:
        ingest(chat_file, "openai", store, progress=False)
        ingest(code_file, "jsonl", store, progress=False)
        # stored as logged (ingest's normalization would drop the leading answer): no user turn before the first answer
        run = store.begin_run(str(chat_file.resolve()), "openai", 0)
        store.add_batch(run, [Conversation([Message("system", f"be brief {i}"), Message("assistant", "hi"), Message("user", "late")],
                                           str(chat_file.resolve()), f"late:{i}", timestamp=recent) for i in range(6)])
    return url, chat_file.resolve(), code_file.resolve()


def _window_config(tiny_target_dir, url, chat_file, code_file, *overrides):
    sources = f"sources=[{{path: '{chat_file}', format: openai, slice: chat}}, {{path: '{code_file}', format: jsonl, slice: code}}]"
    return load_nightly_config(None, [f"target={tiny_target_dir}", f"log_db={url}", sources, "window.train_prompts=10",
                                      "window.eval_prompts=4", "window.max_prompt_tokens=64", *overrides])


def test_select_window_takes_usable_prompts_evenly_from_each_source_and_split(tiny_target_dir, tmp_path):
    from collections import Counter

    from specdistill.data.logstore import LogStore
    from specdistill.data.prompts import encode_chat

    url, chat_file, code_file = _store_with_traffic(tmp_path)
    config = _window_config(tiny_target_dir, url, chat_file, code_file)
    window = select_window(config, now=NOW)
    assert Counter(p.slice for p in window.train) == {"chat": 5, "code": 5}
    assert Counter(p.slice for p in window.eval) == {"chat": 2, "code": 2}
    # slices take turns, so a benchmark its budget cuts to the first prompts still measures each of them
    assert [p.slice for p in window.eval] in (["code", "chat"] * 2, ["chat", "code"] * 2)
    assert window.since is None and window.replayed == 0
    tok = train_bpe(300)
    with LogStore(url) as store:
        splits = {p.id: c.split for p, c in zip(window.train + window.eval,
                                                    store.by_ids(int(p.id) for p in window.train + window.eval))}
    assert {splits[p.id] for p in window.train} == {"train"} and {splits[p.id] for p in window.eval} == {"eval"}
    for p in window.train + window.eval:
        assert p.messages[-1]["role"] == "user" and p.messages[0]["role"] != "assistant"
        assert "def add" not in p.messages[-1]["content"] and len(encode_chat(tok, p.messages)) <= 64
    everything = select_window(_window_config(tiny_target_dir, url, chat_file, code_file, "window.train_prompts=500",
                                                      "window.eval_prompts=500"), now=NOW)
    with LogStore(url) as store:
        usable = {str(c.id) for c in store.window() if c.messages[0].role == "user" and "def add" not in c.messages[0].content}
    assert len(usable) == 40 + 30
    assert {p.id for p in everything.train + everything.eval} == usable  # every usable prompt, and only those
    # a source too small for its even share (HumanEval in the demo): the larger source makes up the rest
    with LogStore(url) as store:
        code_train = store.count(source=str(code_file), split="train")
    short = select_window(_window_config(tiny_target_dir, url, chat_file, code_file,
                                                  f"window.train_prompts={2 * code_train + 2}"), now=NOW)
    assert Counter(p.slice for p in short.train) == {"code": code_train, "chat": code_train + 2}
    again = select_window(config, now=NOW)
    assert again.key == window.key and again.train == window.train  # deterministic for a store and seed
    other = select_window(_window_config(tiny_target_dir, url, chat_file, code_file, "window.seed=1"), now=NOW)
    assert other.key != window.key


def test_select_window_replays_older_traffic_and_fails_on_an_empty_window(tiny_target_dir, tmp_path):
    from specdistill.data.logstore import LogStore

    url, chat_file, code_file = _store_with_traffic(tmp_path)
    config = _window_config(tiny_target_dir, url, chat_file, code_file, "window.days=1", "window.replay_share=0.2")
    window = select_window(config, now=NOW)
    since = NOW - timedelta(days=1)
    assert window.since == since.isoformat() and window.replayed == 2 and len(window.train) == 10
    with LogStore(url) as store:
        arrived = [c.arrived_at for c in store.by_ids(int(p.id) for p in window.train)]
    assert sum(a < since for a in arrived) == 2  # the replay share, from before the window
    later = _window_config(tiny_target_dir, url, chat_file, code_file, "window.since=2100-01-01T00:00:00")
    with pytest.raises(ValueError, match="empty data window"):
        select_window(later, now=NOW)


def test_describe_target_hashes_the_target_in_full_once_per_run(tmp_path, monkeypatch, capsys):
    """The nightly's first stage checks every byte of the target's weights (a load checks a sample)."""
    from specdistill.modeling import models
    from tests.conftest import save_tiny_target

    target_dir = save_tiny_target(tmp_path / "target")
    models.load_model(target_dir, dtype="float32")  # its fingerprint record: what the full check reads
    checks = []
    real = models.verify_model_files
    monkeypatch.setattr(models, "verify_model_files", lambda ref: checks.append(ref) or real(ref))
    describe_target(str(target_dir), "float32", "cpu")
    assert checks == [str(target_dir)]
    size = (target_dir / "model.safetensors").stat().st_size
    assert f"target weights verified: {size / 1e6:.0f} MB hashed in" in capsys.readouterr().err


def test_distill_output_dir_depends_on_the_train_config_data_and_warm_start_only(monkeypatch):
    calls = []

    def fake_distill(dcfg, deadline=None):
        calls.append(dcfg)
        return trained_result(f"{dcfg.out_dir}/draft")

    monkeypatch.setattr("specdistill.distill.train.distill", fake_distill)
    train, heldout = GeneratedData("/data/a/train.jsonl", "/data/a/tc", 1, 1), GeneratedData("/data/a/eval.jsonl", None, 1, 1)

    def out_dir(config, train_data=train, warm=None):
        distill_draft(config, train_data, heldout, warm)
        return calls[-1].out_dir

    layers = ["train.kind=draft_model"]  # warm starts below are layer drafts (a head would ignore them)
    base = load_nightly_config(None, layers)
    first = out_dir(base)
    assert out_dir(base) == first
    unrelated = load_nightly_config(None, [*layers, "bench.gamma=7", "window.train_prompts=3", "gate.must_beat=[]",
                                           "generation.max_new_tokens=5", "log_db=sqlite:////elsewhere.db"])
    assert out_dir(unrelated) == first
    keys = {first, out_dir(load_nightly_config(None, [*layers, "train.optim.max_steps=7"])),
            out_dir(base, replace(train, path="/data/b/train.jsonl")), out_dir(base, warm="/champion/v1"),
            out_dir(base, warm="/champion/v2")}
    assert len(keys) == 5
    assert calls[-1].optim.lr == base.train.incremental_lr and calls[-1].draft_vocab is None  # a warm start keeps its vocab

    Path(first).mkdir(parents=True)
    (Path(first) / "result.json").write_text(json.dumps(trained_result("finished")))
    n = len(calls)
    assert distill_draft(base, train, heldout).draft_dir == "finished" and len(calls) == n  # reused
    assert Path(first).parent == run_root() / "distill"



def test_a_warm_started_head_trains_one_step_deeper_up_to_the_incremental_depth():
    """A night after the first starts from a head whose first position the nights before trained: it spends its
    minutes on depth, one unroll step past its head's up to `train.incremental_steps` (at
    `train.incremental_deep_share`); night one keeps `eagle3.steps`."""
    from specdistill.distill.distill_recipe import DataConfig, TeacherConfig

    cfg = load_nightly_config(None, ["train.eagle3.steps=1", "train.incremental_steps=3", "train.incremental_deep_share=0.5"])
    args = dict(data=DataConfig(path="/d/train.jsonl", kind="generated"), out_dir="/o",
                teacher=TeacherConfig(mode="cache", cache_dir="/d/tc"), feature_dir="/d/features")
    fresh, warm = cfg.train.for_run(cfg, **args), cfg.train.for_run(cfg, **args, warm_start="/champion")
    assert (fresh.eagle3.steps, fresh.eagle3.deep_share) == (1, 1.0)
    assert (warm.eagle3.steps, warm.eagle3.deep_share, warm.optim.lr) == (2, 0.5, cfg.train.incremental_lr)
    by_night = [cfg.train.for_run(cfg, **args, warm_start="/champion", warm_depth=k).eagle3.steps for k in (1, 2, 3, 5)]
    assert by_night == [2, 3, 3, 5]  # a curriculum: one step a night to the cap; a deeper head is never cut back
    # a head trained for the target before an update retrains its first position first, as night one does
    updated = cfg.train.for_run(cfg, **args, warm_start="/champion-of-v1", deepen=False)
    assert (updated.eagle3.steps, updated.eagle3.deep_share, updated.optim.lr) == (1, 1.0, cfg.train.incremental_lr)

def test_train_kind_eagle3_trains_a_head_from_features_beside_the_teacher_cache(monkeypatch):
    calls = []
    monkeypatch.setattr("specdistill.distill.train.distill", lambda dcfg, deadline=None: calls.append(dcfg) or trained_result())
    train, heldout = GeneratedData("/data/a/train.jsonl", "/data/a/tc", 1, 1), GeneratedData("/data/a/eval.jsonl", None, 1, 1)
    config = load_nightly_config(None, ["train.kind=eagle3", "train.eagle3.steps=3"])
    distill_draft(config, train, heldout, "/champion/layers-v1")
    dcfg = calls[-1]
    assert dcfg.kind == "eagle3" and dcfg.eagle3.steps == 3 and dcfg.eagle3.feature_dir == "/data/a/features"
    assert dcfg.draft is None and dcfg.teacher.cache_dir == "/data/a/tc"  # a layer-draft champion is no warm start for a head
    assert load_nightly_config().train.kind == "eagle3"  # the demo trains the better kind per CPU-minute


def test_the_answer_pass_records_the_heads_features_so_training_needs_no_second_target_pass(tiny_target_dir, tmp_path,
                                                                                             monkeypatch):
    import specdistill.distill.features as features
    from specdistill.pipeline.layout import features_dir
    from specdistill.pipeline.stages.answers.stage import generate_responses

    built = []
    real_build = features.build_feature_cache
    monkeypatch.setattr(features, "build_feature_cache", lambda target, seqs, directory, **kw: (
        built.append((Path(directory).name, len(seqs))) or real_build(target, seqs, directory, **kw)))
    url, chat_file, code_file = _store_with_traffic(tmp_path)
    config = _window_config(tiny_target_dir, url, chat_file, code_file, "train.kind=eagle3", "train.optim.max_steps=4",
                            "train.draft_vocab=null", "generation.max_new_tokens=6", "dtype=float32")
    window = select_window(config, now=NOW)
    train = generate_responses(config, window, "train", record_teacher=True)
    heldout = generate_responses(config, window, "eval", record_teacher=False)
    shards = sorted(p.name for p in features_dir(train.teacher_cache).glob("shard-*"))
    assert shards and all(name.startswith(("shard-gen-", "shard-log-")) for name in shards)  # decoded, or labelled by prefill
    result = distill_draft(config, train, heldout)
    assert result.steps == 4 and built == [("features-heldout", 4)]  # the held-out answers only: whole prompts
    assert sorted(p.name for p in features_dir(train.teacher_cache).glob("shard-*")) == shards


def test_an_automatic_answer_engine_says_what_answered_and_why(tiny_target_dir, tmp_path):
    from specdistill.pipeline.stages.answers.stage import generate_responses

    url, chat_file, code_file = _store_with_traffic(tmp_path)
    config = _window_config(tiny_target_dir, url, chat_file, code_file, "generation.backend=auto",
                            "generation.max_new_tokens=4", "dtype=float32", "train.kind=draft_model")
    window = select_window(config, now=NOW)
    train = generate_responses(config, window, "train", record_teacher=True)
    assert train.answers == len(window.train) and train.answered_by == "float32"
    assert train.engine_choice.startswith("**answer engine:** harness") and "the target is no GGUF" in train.engine_choice
    plain = generate_responses(_window_config(tiny_target_dir, url, chat_file, code_file, "generation.max_new_tokens=4",
                                              "dtype=float32", "train.kind=draft_model"), window, "train", record_teacher=True)
    assert plain.path == train.path and plain.engine_choice is None  # the harness chosen: the harness's answers, reused


def test_a_head_reading_other_layers_gets_features_of_its_own(tmp_path):
    from specdistill.distill.features import FeatureCache
    from specdistill.pipeline.layout import features_dir

    teacher = tmp_path / "data" / "teacher_cache"
    assert features_dir(teacher, [1, 2, 3]) == tmp_path / "data" / "features"  # nothing written yet
    FeatureCache.create(tmp_path / "data" / "features", fingerprint="fp", layers=[2, 15, 27], data="d", prompt_context=0)
    assert features_dir(teacher) == features_dir(teacher, [2, 15, 27]) == tmp_path / "data" / "features"
    assert features_dir(teacher, [1, 2, 3]) == tmp_path / "data" / "features-layers-1-2-3"


@pytest.mark.parametrize("pays", [True, False])
def test_training_autocasts_to_bf16_when_the_run_is_bf16_and_the_cpu_measures_it_faster(monkeypatch, pays):
    from specdistill.distill import autocast

    calls, probes = [], []
    monkeypatch.setattr("specdistill.distill.train.distill", lambda dcfg, deadline=None: calls.append(dcfg) or trained_result())
    monkeypatch.setattr(autocast, "measure_autocast", lambda: probes.append(1) or autocast.AutocastProbe(
        pays, 10.0, 5.0 if pays else 20.0, "cpu", "torch", 1))
    monkeypatch.setattr(autocast, "others_busy", lambda *a: 0.0)  # the load it was measured under holds
    train, heldout = GeneratedData("/data/a/train.jsonl", "/data/a/tc", 1, 1), GeneratedData("/data/a/eval.jsonl", None, 1, 1)
    for overrides, want in ((["dtype=bfloat16"], pays), (["dtype=float32"], False), (["dtype=bfloat16"], pays),
                            (["dtype=bfloat16", "train.optim.bf16=false"], False), (["dtype=float32", "train.optim.bf16=true"], True)):
        distill_draft(load_nightly_config(None, overrides), train, heldout)
        assert calls[-1].optim.bf16 is want, overrides
    assert len(probes) == 1  # measured once, then read from the state directory


def test_generic_baseline_dir_depends_on_the_window_and_the_train_config(monkeypatch):
    calls = []
    monkeypatch.setattr("specdistill.distill.train.distill", lambda dcfg, deadline=None: calls.append(dcfg) or trained_result())
    heldout = GeneratedData("/data/a/eval.jsonl", None, 1, 1)

    def out_dir(config, key):
        conversations = run_root() / "generic" / f"{key}-conversations.jsonl"
        conversations.parent.mkdir(parents=True, exist_ok=True)
        conversations.write_text("")  # written before: the log store is not read again
        distill_draft(config, None, heldout, generic=True, window=Window([], [], key, None, 0))
        assert calls[-1].data.kind == "conversations" and calls[-1].loss.kind == "ce"
        return calls[-1].out_dir

    base = load_nightly_config()
    first = out_dir(base, "w1")
    assert out_dir(load_nightly_config(None, ["bench.gamma=7"]), "w1") == first
    assert len({first, out_dir(base, "w2"), out_dir(load_nightly_config(None, ["train.optim.lr=0.5"]), "w1")}) == 3


def _champion(path, version="1"):
    return Champion("draft-tiny", version, str(path))


def test_align_champion_keeps_a_champion_of_the_same_vocabulary(tiny_target_dir, tmp_path):
    from specdistill.modeling.drafts import init_draft_from_target, save_draft
    from specdistill.modeling.models import load_model

    target = load_model(tiny_target_dir)
    champion_dir = save_draft(init_draft_from_target(target.model, [0, 3]), target.tokenizer, tmp_path / "champion")
    config = load_nightly_config(None, [f"target={tiny_target_dir}"])
    assert align_champion(config, None) is None
    warm = align_champion(config, _champion(champion_dir))
    assert warm.dir == str(champion_dir) and not warm.transplanted and warm.vocab_report["identical"]
    assert not (run_root() / "aligned").exists()


def test_align_champion_transplants_a_champion_of_an_older_vocabulary_once(tiny_target_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from specdistill.modeling import drafts
    from specdistill.modeling.drafts import init_draft_from_target, load_draft_meta, save_draft
    from specdistill.modeling.models import load_model
    from tests.conftest import make_tiny_llama

    old = load_model(tiny_target_dir)
    old_vocab = DraftVocab(torch.arange(0, 120), len(old.tokenizer))
    champion_dir = save_draft(init_draft_from_target(old.model, [0, 3]), old.tokenizer, tmp_path / "champion",
                              draft_vocab=old_vocab, meta={"layers": [0, 3]})
    new_tok = train_bpe(300)
    new_tok.add_tokens(["CalcBlackScholesVega"])
    new_target = tmp_path / "target-v2"
    make_tiny_llama(vocab_size=len(new_tok), layers=4, seed=1).save_pretrained(new_target)
    new_tok.save_pretrained(new_target)

    config = load_nightly_config(None, [f"target={new_target}"])
    warm = align_champion(config, _champion(champion_dir))
    assert warm.transplanted and warm.dir != str(champion_dir)
    assert warm.dir.startswith(str(run_root() / "aligned"))
    aligned = load_model(warm.dir)
    assert aligned.config.vocab_size == len(new_tok)
    assert AutoTokenizer.from_pretrained(warm.dir).get_vocab() == new_tok.get_vocab()
    assert new_tok.convert_tokens_to_ids("CalcBlackScholesVega") in DraftVocab.load(warm.dir).token_ids.tolist()
    assert load_draft_meta(warm.dir) == {"layers": [0, 3], "transplanted_from": str(champion_dir)}
    assert load_model(champion_dir).config.vocab_size == len(old.tokenizer)  # the champion itself is untouched

    monkeypatch.setattr(drafts, "save_draft", lambda *a, **k: pytest.fail("a transplant already on disk is reused"))
    assert align_champion(config, _champion(champion_dir)) == warm


def _bench_entry(spec="draft_model:/d"):
    from specdistill.speculative.harness_bench import BenchResult, SliceResult

    result = BenchResult(drafter="d", gamma=2, max_new_tokens=8, repeats=1, greedy=True, lossless=True, lossless_mismatches=0,
                         acceptance_rate=0.5, accepted_length=2.0, per_position_acceptance=[0.6, 0.4],
                         request_acceptance_p10=0.3, request_acceptance_p50=0.5, request_acceptance_p90=0.7,
                         tokens_per_second_target_only=10.0, tokens_per_second_speculative=12.0, speedup=1.2,
                         cost_ratio=0.1, ideal_speedup=1.5, slices=[SliceResult("chat", 2, 0.5, 2.0, 10.0, 12.0, 1.2)])
    return replace(result, spec=spec)


def test_registration_records_metrics_and_artifacts_and_a_missing_plot_library_only_costs_the_plot(tmp_path, monkeypatch, caplog):
    from specdistill.pipeline.report import registration_artifacts, registration_metrics
    from specdistill.speculative.harness_bench import BenchResult

    draft_dir = tmp_path / "run" / "draft"
    draft_dir.mkdir(parents=True)
    trained = Trained.from_dict(trained_result(str(draft_dir)))
    results = {"challenger": _bench_entry(), "self-spec:4": replace(_bench_entry("self-spec:4"), acceptance_rate=0.3)}
    verdict = GateVerdict(True)
    metrics = registration_metrics(results, trained)
    assert metrics["acceptance_pos_1"] == 0.4 and metrics["baseline_self-spec_4_acceptance_rate"] == 0.3
    report = tmp_path / "report.md"
    report.write_text("# r")

    secret = load_nightly_config(None, ["log_db=postgresql+psycopg://u:hunter22@db/logs?password=hunter33"])
    artifacts = registration_artifacts(secret, results, verdict, trained, str(report))
    assert [a.name for a in artifacts] == ["benchmark.json", "nightly_config.json", "gate.json", "acceptance.png", "report.md"]
    assert artifacts[3].read_bytes()[:4] == b"\x89PNG"
    # the run's config goes to MLflow without its credentials, and is the owner's only
    logged = json.loads(artifacts[1].read_text())
    assert logged["log_db"] == "postgresql+psycopg://u:***@db/logs?password=***"
    assert all(a.stat().st_mode & 0o077 == 0 for a in artifacts[:3])

    def no_matplotlib(self, path):
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(BenchResult, "plot", no_matplotlib)
    with caplog.at_level("WARNING"):
        artifacts = registration_artifacts(load_nightly_config(), results, verdict, trained, None)
    assert [a.name for a in artifacts] == ["benchmark.json", "nightly_config.json", "gate.json"]
    assert "without the acceptance plot" in caplog.text and "matplotlib" in caplog.text

    # measured in llama.cpp: the engine's numbers and the challenger's GGUF go with the version
    speeds = {"challenger": replace(_bench_entry(), stats={"llamacpp_args": ["-m", "/t.gguf", "-md", str(tmp_path / "c.gguf")]})}
    artifacts = registration_artifacts(load_nightly_config(), results, verdict, trained, None, speeds)
    assert [a.name for a in artifacts][-2:] == ["engine_benchmark.json", "c.gguf"]
    assert '"llamacpp_args"' in artifacts[-2].read_text()

    def broken(self, path):
        raise KeyError("a bug, not a missing plot library")

    monkeypatch.setattr(BenchResult, "plot", broken)
    with pytest.raises(KeyError):  # anything else is not swallowed
        registration_artifacts(load_nightly_config(), results, verdict, trained, None)


BF16_CPU = "avx2 fma avx512f avx512bw avx512vl avx512dq avx512_bf16"  # a CPU on which `auto` is bf16


def test_the_run_dtype_reaches_every_model_load_and_the_feature_pass(tmp_path, monkeypatch):
    """dtype=float32 (on a bf16 CPU too, where `auto` is bf16): the target, the champion, the exported
    early exits and the EAGLE-3 feature pass all run in float32."""
    from specdistill.distill import train as train_module
    from specdistill.modeling import models
    from specdistill.modeling.drafts import init_draft_from_target, save_draft
    from specdistill.pipeline.serving import serving_config
    from specdistill.pipeline.stages import engine_bench
    from tests.conftest import save_tiny_target

    monkeypatch.setenv("SPECDISTILL_CPU_FLAGS", BF16_CPU)  # `auto` would be bf16 here
    target_dir = save_tiny_target(tmp_path / "target")
    seen: list = []
    real = models.load_model
    monkeypatch.setattr(models, "load_model", lambda ref, **kw: seen.append((str(ref), kw.get("dtype"), kw.get("device")))
                        or real(ref, **kw))
    config = load_nightly_config(None, [f"target={target_dir}", "dtype=float32", "train.kind=eagle3"])
    info = describe_target(config.target, config.dtype, config.device)
    assert info.dtype == "float32"
    loaded = real(target_dir, dtype="float32")
    champion = save_draft(init_draft_from_target(loaded.model, [0, 3]), loaded.tokenizer, tmp_path / "champion")
    align_champion(config, Champion("d", "1", str(champion)))
    engine_bench.llamacpp_spec(config, DrafterSpec.parse("self-spec:2"))
    decision = ServingDecision(mode="self-spec", name="self-spec:2", spec=DrafterSpec.parse("self-spec:2"), gamma=2, speedup=1.2,
                               reason="r", measured={}, measured_on="")
    serving_config(decision, info)
    # the target read once (describe; the early-exit exports reuse it: `models.shared_model`), the champion once
    assert [Path(ref).name for ref, _, _ in seen] == ["target", "champion"], seen
    assert all(dtype == "float32" for _, dtype, _ in seen), seen
    # the run's device reaches the loads that run (the serving export copies weights on the CPU)
    assert all(device == "auto" for ref, _, device in seen[:3]), seen

    captured = {}
    monkeypatch.setattr(train_module, "distill", lambda dcfg, deadline=None: captured.setdefault("config", dcfg) and trained_result())
    distill_draft(config, GeneratedData(str(tmp_path / "a.jsonl"), str(tmp_path / "teacher"), 1, 1),
                           GeneratedData(str(tmp_path / "h.jsonl"), None, 1, 1))
    dcfg = captured["config"]
    assert dcfg.eagle3.feature_dtype == "float32" and dcfg.device == config.device == "auto"


def test_a_float32_run_on_a_bf16_cpu_loads_every_model_and_runs_the_feature_pass_in_float32(tiny_target_dir, tmp_path,
                                                                                            monkeypatch):
    """The stages as the nightly and the monitor run them, on tiny models: each model that is loaded
    (target, EAGLE-3 head, drafts, the training's target) and the target in the feature pass is fp32
    and on the run's device, on a CPU where `auto` (and so a forgotten setting) would be bf16."""
    import specdistill.distill.features as features
    from specdistill.hardware import FLAGS_ENV
    from specdistill.modeling import models
    from specdistill.ops.targets import TargetVersion
    from specdistill.pipeline.monitor_recipe import MonitorConfig
    from specdistill.pipeline.stages import monitor as monitor_stage
    from specdistill.pipeline.stages.answers.stage import generate_responses

    monkeypatch.setenv(FLAGS_ENV, BF16_CPU)
    assert models.resolve_dtype("auto") == torch.bfloat16 or torch.cuda.is_available()
    loads, passes = [], []
    real_load, real_build = models.load_model, features.build_feature_cache

    def load(ref, **kw):
        loaded = real_load(ref, **kw)
        weights = next(loaded.model.parameters())
        loads.append((Path(ref).name, weights.dtype, weights.device))
        return loaded

    def build(target, seqs, directory, **kw):
        weights = next(target.parameters())
        passes.append((Path(directory).name, weights.dtype, weights.device))
        return real_build(target, seqs, directory, **kw)

    monkeypatch.setattr(models, "load_model", load)
    monkeypatch.setattr(features, "build_feature_cache", build)
    url, chat_file, code_file = _store_with_traffic(tmp_path)
    overrides = ["dtype=float32", "train.kind=eagle3", "train.optim.max_steps=2", "train.draft_vocab=null",
                 "generation.max_new_tokens=6", "bench.max_new_tokens=4", "bench.self_spec_layers=[2]",
                 "serving.choose_gamma=false", "bench.gamma=2"]
    config = _window_config(tiny_target_dir, url, chat_file, code_file, *overrides)
    device = models.resolve_device(config.device)

    info = describe_target(config.target, config.dtype, config.device)
    window = select_window(config, now=NOW)
    train = generate_responses(config, window, "train", record_teacher=True)
    heldout = generate_responses(config, window, "eval", record_teacher=False)
    trained = distill_draft(config, train, heldout)
    bench.benchmark(config, window, {"challenger": DrafterSpec("draft_model", trained.draft_dir),
                                         "self-spec:2": DrafterSpec.parse("self-spec:2")})
    monitor = MonitorConfig(target=str(tiny_target_dir), nightly_overrides=[f"log_db={url}", *overrides], gamma=2,
                            replay_prompts=2, max_new_tokens=4, min_draft_tokens=1, fallback_exit_layers=[2],
                            fallback_min_tokens=1)
    target = TargetVersion(info.fingerprint, info.path, info.ref, "2024-06-01T00:00:00+00:00")
    monitor_stage.sample_acceptance(monitor, Champion("d", "1", trained.draft_dir), target)
    monitor_stage.measure_fallback(monitor, target)

    # the target is read twice: once for every stage that decodes with it (describe, both answer passes, the
    # benchmark, the monitor's replay and fallback share it: `models.shared_model`), once by the trainer
    assert [name for name, _, _ in loads] == [Path(tiny_target_dir).name] * 2, loads
    assert all(dtype == torch.float32 and d.type == device.type for _, dtype, d in loads), loads
    assert passes == [("features-heldout", torch.float32, passes[0][2])] and passes[0][2].type == device.type


def test_a_device_the_machine_lacks_fails_at_config_load_naming_the_key(monkeypatch):
    import torch

    from specdistill.recipe import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="device.*'cuda:1' but torch sees no CUDA device"):
        load_nightly_config(None, ["device=cuda:1"])
    with pytest.raises(ConfigError, match="device.*unknown device 'gpu'"):
        load_nightly_config(None, ["device=gpu"])
    assert load_nightly_config(None, ["device=cpu"]).device == "cpu"


def test_stage_deadlines_share_what_the_run_has_left():
    from specdistill.pipeline.stage_budgets import stage_budgets, stage_deadline

    config = load_nightly_config(None, ["generation.max_minutes=8", "train.optim.max_minutes=3", "bench.max_minutes=4",
                                        "bench.generic_minutes=null"])  # null: the baseline gets the draft's minutes
    assert stage_budgets(config) == {"answers": 8, "distill": 3, "generic": 3, "benchmark": 4}
    assert stage_budgets(load_nightly_config(None, ["train.optim.max_minutes=3"]))["generic"] == 1.0  # its own, by default
    now = 1000.0
    assert stage_deadline(config, "answers", now + 60 * 36, now=now).at == now + 8 * 60  # enough time: its own budget
    assert stage_deadline(config, "answers", now + 60 * 9, now=now).at == pytest.approx(now + 9 * 60 * 8 / 18)
    assert stage_deadline(config, "benchmark", now + 60 * 2, now=now).at == pytest.approx(now + 2 * 60)
    assert stage_deadline(config, "distill", None, now=now).at == now + 3 * 60
    no_generic = load_nightly_config(None, ["bench.generic_draft=false"])
    assert "generic" not in stage_budgets(no_generic)
    with pytest.raises(ValueError, match="not a budgeted stage"):
        stage_deadline(no_generic, "generic", None)
    # a serving engine's benchmark takes the harness benchmark's budget and its share of the run
    engine = load_nightly_config(None, ["train.optim.max_minutes=3", "bench.max_minutes=4", "serving.engine=vllm",
                                        "generation.max_minutes=8", "bench.generic_minutes=null"])
    assert stage_budgets(engine) == {"answers": 8, "distill": 3, "generic": 3, "benchmark": 4, "engine benchmark": 4}
    assert stage_deadline(engine, "benchmark", now + 60 * 4, now=now).at == pytest.approx(now + 2 * 60)
    assert stage_deadline(engine, "engine benchmark", now + 60 * 3, now=now).at == pytest.approx(now + 3 * 60)
    assert "engine benchmark" not in stage_budgets(config)


def test_the_budgeted_stages_leave_the_closing_stages_their_minutes_inside_the_run_s_deadline():
    from specdistill.pipeline.stage_budgets import CLOSING_MINUTES, run_deadline

    now = 1000.0
    assert run_deadline(load_nightly_config(None, ["deadline_minutes=18"]), now=now) == now + 60 * (18 - CLOSING_MINUTES)
    assert run_deadline(load_nightly_config(None, ["deadline_minutes=0.1"]), now=now) == now  # never before the start
    assert run_deadline(load_nightly_config(None, ["deadline_minutes=null"]), now=now) is None


def test_a_training_share_too_small_to_train_stops_the_run(monkeypatch):
    import time

    calls = []
    deadlines = []
    monkeypatch.setattr("specdistill.distill.train.distill",
                        lambda dcfg, deadline: calls.append(dcfg) or deadlines.append(deadline) or trained_result("d"))
    config = load_nightly_config(None, ["train.kind=draft_model", "train.optim.max_minutes=3"])
    train, heldout = GeneratedData("/data/c/train.jsonl", "/data/c/tc", 1, 1), GeneratedData("/data/c/eval.jsonl", None, 1, 1)
    untrained = distill_draft(config, train, heldout, deadline_at=time.time() + 5)  # said, not raised: no traceback
    assert isinstance(untrained, Untrained) and not calls
    assert re.fullmatch(r"the run's deadline \(deadline_minutes=18.0\) leaves [0-5] s to train the draft, under the 15 s it "
                        r"needs: nothing was trained; the champion and serving.json are unchanged", untrained.reason)
    distill_draft(config, train, heldout, deadline_at=time.time() + 60 * 60)
    assert calls[-1].optim.max_minutes == 3  # the run has time: the stage's own budget
    distill_draft(config, train, heldout, deadline_at=time.time() + 60 * 10)  # 10 of 3+3+4 budgeted minutes
    assert 2.5 < calls[-1].optim.max_minutes <= 3
    # the share bounds the stage's wall time too (loading and evaluations included), not its training alone
    assert deadlines[-1].minutes() == pytest.approx(calls[-1].optim.max_minutes, abs=0.05)


def test_train_answers_cut_to_nothing_stop_before_training(tiny_target_dir, tmp_path, monkeypatch):
    from specdistill.pipeline.stages.answers import stage as answers

    monkeypatch.setenv("SPECDISTILL_HOME", str(tmp_path / "home"))
    url, chat_file, code_file = _store_with_traffic(tmp_path)
    config = _window_config(tiny_target_dir, url, chat_file, code_file, "generation.max_minutes=0",
                            "generation.max_new_tokens=4", "train.kind=draft_model")
    window = select_window(config, now=NOW)
    with pytest.raises(ValueError, match="left no time to answer any of the 10 train prompts"):
        answers.generate_responses(config, window, "train", record_teacher=True)
    held = answers.generate_responses(config, window, "eval", record_teacher=False)  # not budgeted
    assert held.answers == len(window.eval)


def test_the_answer_engine_probe_is_timed_inside_the_answer_stage_s_share(tiny_target_dir, tmp_path, monkeypatch):
    from specdistill import budget
    from specdistill.pipeline.stages.answers import stage as answers

    monkeypatch.setenv("SPECDISTILL_HOME", str(tmp_path / "home"))
    url, chat_file, code_file = _store_with_traffic(tmp_path)
    config = _window_config(tiny_target_dir, url, chat_file, code_file, "generation.backend=auto")
    window = select_window(config, now=NOW)
    order = []
    monkeypatch.setattr(answers, "stage_deadline", lambda *a, **k: order.append("deadline") or budget.Deadline(None))

    def probe(*_, **__):
        order.append("probe")
        raise RuntimeError("probed")

    monkeypatch.setattr(answers, "choose_answer_engine", probe)
    with pytest.raises(RuntimeError, match="probed"):
        answers.generate_responses(config, window, "train", record_teacher=True)
    assert order == ["deadline", "probe"]  # the share is fixed before the probe spends any of it


def test_a_finished_runs_state_keeps_traffic_and_answers_to_its_owner(tiny_target_dir, tmp_path):
    """The state of a run (log store, window, the target's answers and teacher cache, the suffix corpus
    and its SGLang export, the generic baseline's conversations, a trained draft registered in MLflow,
    its local copy, serving.json), walked: nobody but the owner can read anything under the state
    directory, except what a serving engine must read (serving.json and the registered draft it names)."""
    import os
    import stat

    from specdistill import paths
    from specdistill.ops import registry
    from specdistill.ops.serving import ServingConfig, write_serving_config
    from specdistill.pipeline.stages.answers.stage import generate_responses
    from specdistill.pipeline.stages.corpus import nightly_corpus

    home = paths.home()
    url, chat_file, code_file = _store_with_traffic(tmp_path, url=f"sqlite:///{home / 'logs.db'}")
    config = _window_config(tiny_target_dir, url, chat_file, code_file, "generation.max_new_tokens=6", "dtype=float32",
                            "train.kind=draft_model", "train.layers=0,3", "train.draft_vocab=null", "train.optim.max_steps=2",
                            "bench.threads=1")
    window = select_window(config, now=NOW)
    train = generate_responses(config, window, "train", record_teacher=True)
    heldout = generate_responses(config, window, "eval", record_teacher=False)
    target = describe_target(config.target, dtype="float32")
    nightly_corpus(config, train, target.fingerprint)
    generic = distill_draft(config, None, heldout, generic=True, window=window)
    trained = distill_draft(config, train, heldout)
    assert generic.steps == trained.steps == 2
    reg = registry.register_draft(trained.draft_dir, target_name=config.target_name)
    served_copy = registry.download_draft(reg.model_uri)
    write_serving_config(ServingConfig("draft", draft_dir=str(served_copy), draft_version=reg.version))

    def mode(path: Path) -> int:
        return path.stat().st_mode & 0o777

    # the files the review found world-readable, and the directories that hold them
    named = [*(run_root() / "generic").glob("*-conversations.jsonl"), Path(train.path), Path(heldout.path),
             Path(train.path).parent / "suffix_corpus.safetensors", Path(train.path).parent / "suffix_corpus.sglang.jsonl",
             home / "suffix_corpus.safetensors", home / "logs.db", home / "mlflow.db"]
    assert len(named) == 8 and {p.name for p in named} >= {"train_generated.jsonl", "eval_generated.jsonl"}
    assert {str(p): oct(mode(p)) for p in named} == {str(p): oct(0o600) for p in named}
    for directory in (run_root(), run_root() / "generic", Path(train.path).parent, paths.registry_artifacts_dir()):
        assert mode(directory) == 0o700, directory
    assert mode(home) == 0o711  # nobody else lists it; a serving engine can still open what serving.json names

    # the walk: a reader who is not the owner reaches only the serving engine's files
    version_root = paths.registry_copies_dir() / reg.name / reg.version
    assert version_root in served_copy.parents
    readable = []
    for root, dirs, files in os.walk(home):
        for name in dirs + files:
            path = Path(root) / name
            chain = [path, *[p for p in path.parents if home in p.parents]]  # the path and its directories below home
            others_reach = all(p.lstat().st_mode & (stat.S_IROTH | (stat.S_IXOTH if p.is_dir() else 0)) for p in chain[:1]) \
                and all(p.stat().st_mode & stat.S_IXOTH for p in chain[1:])
            if others_reach and not path.is_symlink():
                readable.append(path)
    allowed = [p for p in readable if p == home / "serving.json" or p == paths.registry_copies_dir()
               or version_root == p or version_root in p.parents or p in version_root.parents]
    assert readable and sorted(set(readable) - set(allowed)) == []
    assert home / "serving.json" in readable and served_copy / "model.safetensors" in readable
    assert all((p.stat().st_mode & 0o066) == 0 for p in named)  # no group bits on traffic either


def test_a_head_is_first_measured_no_deeper_than_the_positions_it_was_trained_to_draft(tmp_path):
    import json

    from specdistill.modeling.eagle3 import EAGLE3_ARCHITECTURE
    from specdistill.modeling.eagle3_io import META_FILE
    from specdistill.pipeline.stages.bench import first_gamma
    from specdistill.speculative.specs import DrafterSpec

    head, layer_draft = tmp_path / "head", tmp_path / "layers"
    for d, arch in ((head, EAGLE3_ARCHITECTURE), (layer_draft, "LlamaForCausalLM")):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"architectures": [arch]}))
        (d / META_FILE).write_text(json.dumps({"kind": "eagle3", "unroll_steps": 1}))
    assert first_gamma(DrafterSpec.parse(f"draft_model:{head}"), 4) == 1  # a 1-step head: its 2nd position is untrained
    (head / META_FILE).write_text(json.dumps({"kind": "eagle3", "unroll_steps": 3}))
    assert first_gamma(DrafterSpec.parse(f"draft_model:{head}"), 4) == 3
    assert first_gamma(DrafterSpec.parse(f"draft_model:{head}"), 2) == 2
    (head / META_FILE).write_text(json.dumps({"kind": "eagle3"}))  # a head from before the key: the benchmark's γ
    assert first_gamma(DrafterSpec.parse(f"draft_model:{head}"), 4) == 4
    assert first_gamma(DrafterSpec.parse(f"draft_model:{layer_draft}"), 4) == 4  # a layer draft drafts every position
    assert first_gamma(DrafterSpec.parse("ngram"), 4) == 4
