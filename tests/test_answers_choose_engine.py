"""`generation.backend: auto`: the engine that answers fastest here, measured (unit: the choice, what is
remembered, what the report says; e2e: both probes for real on the demo target, llama-server on loopback)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specdistill.pipeline.config import load_nightly_config
from specdistill.pipeline.stages.answers import choose_engine
from specdistill.pipeline.stages.answers.choose_engine import AnswerEngine, EngineSpeed, choose_answer_engine

TARGET = SimpleNamespace(fingerprint="f0")  # what the choice reads of the target when it does not probe


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
    choice = choose_answer_engine(config, TARGET, _prompts(4))
    assert choice.backend == "harness" and choice.speeds == []
    assert "llama.cpp not built (`make llama-server`" in choice.summary()
    assert choice.apply(config).generation.backend == "harness"
    tiny = load_nightly_config(None, ["generation.backend=auto", "target=/models/tiny"])
    assert "the target is no GGUF" in choose_answer_engine(tiny, TARGET, _prompts(4)).summary()


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
    choice = choose_answer_engine(config, TARGET, _prompts(40))
    assert probes == [choose_engine.PROBE_PROMPTS] * 2  # both on the same first prompts
    assert choice.backend == backend and (choice.engine == "llamacpp") == (backend == "openai")
    applied = choice.apply(config).generation
    assert applied.backend == backend and (backend == "harness" or applied.engine == "llamacpp")
    assert f"llamacpp Q4_1 {llama_speed:.1f}" in choice.summary() and "harness float32 100.0" in choice.summary()
    again = choose_answer_engine(config, TARGET, _prompts(40))  # a resumed run, the held-out answers, the next night
    assert probes == [choose_engine.PROBE_PROMPTS] * 2 and again == choice
    other = choose_answer_engine(config.model_copy(update={"dtype": "bfloat16"}), TARGET, _prompts(40))
    assert len(probes) == 4 and isinstance(other, AnswerEngine)  # another dtype is another measurement


def test_a_failed_llama_cpp_probe_leaves_the_harness_answering_and_says_why(monkeypatch):
    monkeypatch.setattr(choose_engine, "candidates", lambda config: (["harness", "llamacpp"], []))
    monkeypatch.setattr(choose_engine, "probe_harness", lambda *a: EngineSpeed("harness float32", 100, 1.0))

    def broken(*a):
        raise RuntimeError("llama-server exited with 1 before it listened\n(log tail)")

    monkeypatch.setattr(choose_engine, "probe_llamacpp", broken)
    choice = choose_answer_engine(load_nightly_config(None, ["generation.backend=auto"]), TARGET, _prompts(20))
    assert choice.backend == "harness" and [s.engine for s in choice.speeds] == ["harness float32"]
    assert "llama.cpp probe failed (RuntimeError: llama-server exited with 1 before it listened)" in choice.summary()


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
    layers = load_nightly_config(None, ["generation.backend=auto", "generation.teacher_top_k=8", "train.kind=layers",
                                        "generation.max_new_tokens=4"])
    assert choose_engine.probe_llamacpp(layers, demo_target, prompts).features_s == 0.0  # a layer draft reads none
