"""`generation.backend: auto`: the engine that answers fastest here, measured (unit: the choice, what is
remembered, what the report says; e2e: both probes for real on the demo target, llama-server on loopback)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdistill.pipeline.nightly_recipe import load_nightly_config
from specdistill.pipeline.stages.answers import choose_engine
from specdistill.pipeline.stages.answers.choose_engine import AnswerEngine, EngineSpeed, choose_answer_engine

# what the choice reads of the target when it does not probe: its version and dtype (the stage's batch by dtype)
TARGET = SimpleNamespace(fingerprint="f0", model=SimpleNamespace(dtype=torch.float32))
FP32_BATCH = 32  # the harness's answer batch in fp32: the probe's shape


def _prompts(n: int):
    from specdistill.data.prompts import Prompt

    texts = ["Name three colors.", "Say hi.", "What is 2+2?", "Name a dog breed.", "Give me a fruit."]
    return [Prompt(id=f"q{i}", messages=[{"role": "user", "content": texts[i % len(texts)]}]) for i in range(n)]


def test_an_engines_answers_pay_for_the_feature_pass_over_them():
    assert EngineSpeed("llamacpp Q4_1", tokens=100, answer_s=1.0, features_s=1.0).tokens_per_s == 50.0
    assert EngineSpeed("harness float32", tokens=100, answer_s=2.0).to_dict()["tokens_per_s"] == 50.0


def test_without_a_llama_cpp_build_the_harness_answers_unprobed_and_the_report_says_why(monkeypatch):
    from specdistill.engines.llamacpp import build

    monkeypatch.setattr(build, "cached", lambda *a: None)
    monkeypatch.setattr(choose_engine, "probe_harness", lambda *a: pytest.fail("nothing to compare: no probe"))
    config = load_nightly_config(None, ["generation.backend=auto"])
    choice = choose_answer_engine(config, TARGET, _prompts(4), others_busy=0.0)
    assert choice.backend == "harness" and choice.speeds == []
    assert "llama.cpp not built (`make llama-server`" in choice.summary()
    assert choice.apply(config).generation.backend == "harness"
    tiny = load_nightly_config(None, ["generation.backend=auto", "target=/models/tiny"])
    assert "the target is no GGUF" in choose_answer_engine(tiny, TARGET, _prompts(4), others_busy=0.0).summary()


@pytest.mark.parametrize("llama_speed, backend", [(300.0, "openai"), (50.0, "harness")])
def test_the_faster_engine_answers_and_the_measurement_is_kept_for_the_next_run(monkeypatch, llama_speed, backend):
    probes = []
    monkeypatch.setattr(choose_engine, "candidates", lambda config: (["harness", "llamacpp"], []))
    monkeypatch.setattr(choose_engine, "probe_harness",
                        lambda config, target, prompts: probes.append(len(prompts)) or EngineSpeed("harness float32", 100, 1.0))
    monkeypatch.setattr(choose_engine, "probe_llamacpp",
                        lambda config, target, prompts: probes.append(len(prompts)) or
                        EngineSpeed("llamacpp Q4_1", 100, 100 / llama_speed / 2, 100 / llama_speed / 2))
    config = load_nightly_config(None, ["generation.backend=auto"])
    choice = choose_answer_engine(config, TARGET, _prompts(40), others_busy=0.0)
    assert probes == [FP32_BATCH] * 2  # both on the same first prompts, one batch of the stage's size
    assert choice.backend == backend and (choice.engine == "llamacpp") == (backend == "openai")
    applied = choice.apply(config).generation
    assert applied.backend == backend and (backend == "harness" or applied.engine == "llamacpp")
    assert f"llamacpp Q4_1 {llama_speed:.1f}" in choice.summary() and "harness float32 100.0" in choice.summary()
    again = choose_answer_engine(config, TARGET, _prompts(40), others_busy=0.2)  # a resumed run, the next night
    assert probes == [FP32_BATCH] * 2 and again.speeds == choice.speeds and again.measured_under.uses == 1
    other = choose_answer_engine(config.model_copy(update={"dtype": "bfloat16"}), TARGET, _prompts(40), others_busy=0.0)
    assert len(probes) == 4 and isinstance(other, AnswerEngine)  # another dtype is another measurement


def test_a_failed_llama_cpp_probe_leaves_the_harness_answering_and_says_why(monkeypatch):
    monkeypatch.setattr(choose_engine, "candidates", lambda config: (["harness", "llamacpp"], []))
    monkeypatch.setattr(choose_engine, "probe_harness", lambda *a: EngineSpeed("harness float32", 100, 1.0))

    def broken(*a):
        raise RuntimeError("llama-server exited with 1 before it listened\n(log tail)")

    monkeypatch.setattr(choose_engine, "probe_llamacpp", broken)
    choice = choose_answer_engine(load_nightly_config(None, ["generation.backend=auto"]), TARGET, _prompts(20), others_busy=0.0)
    assert choice.backend == "harness" and [s.engine for s in choice.speeds] == ["harness float32"]
    assert "llama.cpp probe failed (RuntimeError: llama-server exited with 1 before it listened)" in choice.summary()


def test_a_kept_choice_measured_under_other_load_is_measured_again(monkeypatch):
    """Issue 60: a probe beside a neighbour chose llama.cpp, and every later night reused it unmeasured."""
    rates = {"harness": 10.0, "llamacpp": 38.0}  # the harness collapsed beside a neighbour at probe time
    probes = []
    monkeypatch.setattr(choose_engine, "candidates", lambda config: (["harness", "llamacpp"], []))
    monkeypatch.setattr(choose_engine, "probe_harness",
                        lambda config, target, prompts: probes.append("h") or EngineSpeed("harness float32", int(rates["harness"]), 1.0))
    monkeypatch.setattr(choose_engine, "probe_llamacpp",
                        lambda config, target, prompts: probes.append("l") or EngineSpeed("llamacpp Q4_1", int(rates["llamacpp"]), 1.0,
                                                                                          thread_count=1, poll=0))
    config = load_nightly_config(None, ["generation.backend=auto", "remeasure.max_runs=3"])
    busy = choose_answer_engine(config, TARGET, _prompts(8), others_busy=1.0)
    assert busy.engine == "llamacpp" and busy.measured_under.others_busy == 1.0 and len(probes) == 2
    assert (busy.llamacpp_threads, busy.llamacpp_poll) == (1, 0)  # the server answers at what its probe chose
    rates.update(harness=90.0, llamacpp=56.0)  # the neighbour is gone
    assert choose_answer_engine(config, TARGET, _prompts(8), others_busy=1.3).engine == "llamacpp"  # 0.3 cores: kept
    assert len(probes) == 2
    quiet = choose_answer_engine(config, TARGET, _prompts(8), others_busy=0.1)
    assert len(probes) == 4 and quiet.backend == "harness"
    assert quiet.remeasured == "other work busy on 1.0 cores when measured, 0.1 cores now"
    assert "measured again: other work busy on 1.0 cores when measured, 0.1 cores now" in quiet.summary()
    assert choose_answer_engine(config, TARGET, _prompts(8), others_busy=1.5, recheck=False) == quiet  # held-out: as kept
    for uses in (1, 2, 3):  # reused by `remeasure.max_runs` runs, then measured again
        assert choose_answer_engine(config, TARGET, _prompts(8), others_busy=0.1).measured_under.uses == uses
    assert len(probes) == 4
    assert choose_answer_engine(config, TARGET, _prompts(8), others_busy=0.1).remeasured == "reused by 3 runs (measured again after 3)"
    assert len(probes) == 6
    choose_engine.supersede(config, TARGET, "the stage dropped it")  # a live rate that collapsed
    assert choose_answer_engine(config, TARGET, _prompts(8), others_busy=0.1).remeasured == "the stage dropped it"
    assert len(probes) == 8


def test_a_measurement_is_stale_by_load_age_uses_and_candidates():
    from specdistill.hardware import MeasuredUnder

    kept = MeasuredUnder(0.2, at=1_000_000.0, candidates=["harness", "llamacpp"], uses=2)
    rules = dict(load_shift=0.75, max_uses=7, max_days=7.0)
    assert kept.stale(0.9, ["harness", "llamacpp"], now=1_000_000.0 + 86400, **rules) is None
    assert "1.0 cores now" in kept.stale(0.96, ["harness", "llamacpp"], now=1_000_000.0, **rules)
    assert "unread now" in kept.stale(None, ["harness", "llamacpp"], now=1_000_000.0, **rules)
    assert kept.stale(0.2, ["harness"], now=1_000_000.0, **rules).startswith("the candidates changed")
    assert kept.stale(0.2, ["harness", "llamacpp"], now=1_000_000.0 + 8 * 86400, **rules) == \
        "measured 8.0 days ago (measured again after 7)"
    assert MeasuredUnder.from_dict(kept.to_dict()) == kept


@pytest.mark.e2e
def test_both_probes_answer_with_the_teacher_and_the_engine_pays_for_the_heads_features(llama_cpp, demo_target):
    config = load_nightly_config(None, ["generation.backend=auto", "dtype=float32", "generation.teacher_top_k=8",
                                        "generation.max_new_tokens=4",
                                        "generation.parallel=2", "train.kind=eagle3"])
    prompts = _prompts(3)
    harness = choose_engine.probe_harness(config, demo_target, prompts)
    llama = choose_engine.probe_llamacpp(config, demo_target, prompts)
    assert harness.engine == "harness float32" and 3 <= harness.tokens <= 12 and harness.features_s == 0.0
    assert llama.engine == "llamacpp Q4_1" and 3 <= llama.tokens <= 12 and llama.features_s > 0.0
    layers = load_nightly_config(None, ["generation.backend=auto", "generation.teacher_top_k=8", "train.kind=draft_model",
                                        "generation.max_new_tokens=4"])
    assert choose_engine.probe_llamacpp(layers, demo_target, prompts).features_s == 0.0  # a layer draft reads none
