"""The answers stage watches the rate it gets and drops an engine whose live rate collapses (issue 60): the
sliding window, and the switch mid-stage with fake engines on an injected clock (unit, no model)."""

from __future__ import annotations

import functools
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from specdistill import paths
from specdistill.data.prompts import Prompt
from specdistill.pipeline.nightly_recipe import load_nightly_config
from specdistill.pipeline.stages.answers import choose_engine, rate_watch, stage
from specdistill.pipeline.stages.answers.answer_file import append_records, resume
from specdistill.pipeline.stages.answers.choose_engine import AnswerEngine, EngineSpeed
from specdistill.pipeline.stages.answers.rate_watch import RateWatch

TARGET = SimpleNamespace(fingerprint="f0", model=SimpleNamespace(dtype=torch.float32), tokenizer=None)


def test_the_window_reads_a_sustained_rate_not_one_slow_batch():
    clock = [0.0]
    watch = RateWatch(floor=20.0, window_s=60.0, clock=lambda: clock[0])
    for _ in range(5):  # 10 s per 500 tokens: 50 tokens/s, under a minute so far: no verdict
        clock[0] += 10.0
        assert watch.observe(500) is False
    assert watch.rate is None
    clock[0] += 40.0  # one slow batch: 500 tokens in 40 s, but the minute before it was fast
    assert watch.observe(500) is False and watch.rate == pytest.approx(1500 / 60.0)  # from the answer at 30 s
    for _ in range(2):  # slow for more than a window: 10 tokens/s
        clock[0] += 50.0
        tripped = watch.observe(500)
    assert tripped and watch.rate == pytest.approx(10.0) and watch.tripped
    assert len(watch.seen) <= 3  # what no window reads again is dropped


def test_a_batch_longer_than_the_window_is_read_over_its_own_span():
    clock = [0.0]
    watch = RateWatch(floor=20.0, window_s=60.0, clock=lambda: clock[0])
    clock[0] = 540.0  # the harness's 2-thread batch beside a busy core: 5,000 tokens in 9 minutes
    assert watch.observe(5000) is True and watch.rate == pytest.approx(5000 / 540.0)


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(id=f"q{i}", messages=[{"role": "user", "content": f"question {i}"}]) for i in range(n)]


def _record(p: Prompt, engine: str) -> dict:
    return {"id": p.id, "prompt": p.messages, "prompt_ids": [1, 2], "response_ids": [7] * 50, "response": engine,
            "finish": "length", "temperature": 0.0}


@pytest.fixture
def fake_engines(tmp_path, monkeypatch):
    """llama.cpp that answers 50 tokens every 10 s (5 tokens/s: collapsed beside a neighbour), the harness at
    once; both write the stage's answers file as the real ones do. Returns what each engine was asked."""
    clock, calls = [0.0], {"llamacpp": [], "harness": []}
    out_path = tmp_path / "answers" / "train_generated.jsonl"

    def served(stack, config, target, prompts, engine, force_llamacpp=False):
        return SimpleNamespace(top_k=32), "llamacpp:Q4_1"

    def openai(served, tokenizer, prompts, path, *, after_answer=None, **kw):
        done, todo = resume(path, prompts, [])
        calls["llamacpp"].append(len(todo))
        with open(path, "a") as out:
            for p in todo:
                clock[0] += 10.0
                append_records(out, [_record(p, "llamacpp")], done)
                if after_answer is not None and after_answer(50):
                    break
        return done

    def harness(model, tokenizer, prompts, path, *, after_batch=None, **kw):
        done, todo = resume(path, prompts, [])
        calls["harness"].append(len(todo))
        with open(path, "a") as out:
            append_records(out, [_record(p, "harness") for p in todo], done)
        return done

    monkeypatch.setattr(stage, "_serve", served)
    monkeypatch.setattr(stage, "generate_answers_openai", openai)
    monkeypatch.setattr(stage, "generate_answers", harness)
    monkeypatch.setattr(stage, "answer_threads", lambda *a: nullcontext(None))
    monkeypatch.setattr(stage, "answer_batch", lambda *a: 4)
    monkeypatch.setattr(stage, "_outputs", lambda *a: (out_path, None))
    monkeypatch.setattr(stage, "_label_logged", lambda *a: None)
    monkeypatch.setattr(stage, "RateWatch", functools.partial(RateWatch, clock=lambda: clock[0]))
    monkeypatch.setattr(choose_engine, "candidates", lambda config: (["harness", "llamacpp"], []))
    return calls, out_path


def test_a_stored_engine_choice_whose_live_rate_collapses_is_replaced_mid_stage(fake_engines):
    calls, out_path = fake_engines
    config = load_nightly_config(None, ["generation.backend=auto", "remeasure.window_s=60", "remeasure.switch_below=0.6"])
    # the kept choice: llama.cpp probed at 37.9 beside the neighbour, the harness (2 threads) at 9.8 ... and 30 quiet
    engine = AnswerEngine("openai", "llamacpp", [EngineSpeed("harness float32", 300, 10.0), EngineSpeed("llamacpp Q4_1", 379, 10.0)])
    kept = choose_engine.choice_path(config, TARGET, ["harness", "llamacpp"])
    paths.atomic_write_json(kept, engine.to_dict())
    prompts = _prompts(20)
    records, source, path, _, _, switch = stage._answer(engine.apply(config), TARGET, None, "train", prompts, True, None, engine)
    # 5 tokens/s live, under 0.6 x the harness's 30: switched once a minute of answers read it (6 answers, 60 s)
    assert switch is not None and (switch.switched_from, switch.to, switch.after_answers) == ("llamacpp", "harness", 6)
    assert switch.live_tokens_per_s == pytest.approx(5.0) and switch.other_probe_tokens_per_s == pytest.approx(30.0)
    assert calls == {"llamacpp": [20], "harness": [14]}  # the harness answered only what was left
    assert path == out_path and sorted(records) == sorted(p.id for p in prompts)
    assert [r["response"] for r in records.values()].count("llamacpp") == 6  # the answers before the switch kept
    assert "llamacpp answered at 5.0 answer tokens/s over 60 s, under 0.6x of harness's probe (30.0); harness " \
           "answered from prompt 7 on, the 6 answers before kept" in switch.describe()
    assert rate_watch.read_switch(out_path.parent) == switch
    assert "the stage dropped it: llamacpp at 5.0" in AnswerEngine.from_dict(paths.read_json(kept, "kept")).superseded
    # a resumed run (or the held-out answers beside them) starts with the engine switched to
    more = _prompts(24)
    stage._answer(engine.apply(config), TARGET, None, "train", more, True, None, engine)
    assert calls == {"llamacpp": [20], "harness": [14, 4]}


def test_an_engine_that_holds_its_rate_is_kept(fake_engines):
    calls, _ = fake_engines
    config = load_nightly_config(None, ["generation.backend=auto"])
    engine = AnswerEngine("openai", "llamacpp", [EngineSpeed("harness float32", 60, 10.0), EngineSpeed("llamacpp Q4_1", 379, 10.0)])
    *_, switch = stage._answer(engine.apply(config), TARGET, None, "train", _prompts(20), True, None, engine)
    assert switch is None and calls == {"llamacpp": [20], "harness": []}  # 5 tokens/s is not under 0.6 x 6
