"""The benchmark's numbers are consistent with the engine's stats and with the formulas of docs/metrics.md."""

from __future__ import annotations

import json

import pytest
import torch

from specdistill.acceptance import expected_tokens_per_round, ideal_speedup
from specdistill.speculative import ModelDrafter, NgramDrafter, SelfSpecDrafter
from specdistill.speculative.bench import (
    BenchConfig,
    Prompt,
    PromptFileError,
    load_prompts,
    percentile,
    run_bench,
    run_bench_many,
)
from specdistill.speculative.gate import evaluate
from tests.conftest import make_tiny_llama


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def lively(seed: int, layers: int = 4):
    model = make_tiny_llama(layers=layers, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return model.double().eval()


def test_formulas():
    assert expected_tokens_per_round(0.0, 4) == 1.0
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)
    assert ideal_speedup(0.5, 2, 0.25) == pytest.approx(1.75 / 1.5)
    assert percentile([0.0, 1.0], 0.5) == 0.5 and percentile([3.0], 0.9) == 3.0 and percentile([], 0.1) == 0.0


def test_load_prompts_jsonl_and_text(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "hi", "slice": "chat"}\n\n{"prompt": "def f():"}\n')
    assert load_prompts(jsonl) == [Prompt("hi", "chat"), Prompt("def f():", "default")]
    text = tmp_path / "p.txt"
    text.write_text("first line\nsecond line\n")
    assert [p.text for p in load_prompts(text)] == ["first line", "second line"]


@pytest.mark.parametrize(
    "content, message",
    [('{"prompt": "a"}\n{"prompt": \n', "p.jsonl:2: not valid JSON"),
     ('{"text": "a"}\n', "p.jsonl:1: key 'prompt'"),
     ('{"prompt": "a", "slice": 3}\n', "p.jsonl:1: key 'slice'"),
     ("\n\n", "no prompts")],
)
def test_load_prompts_errors_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(PromptFileError, match=message):
        load_prompts(path)


def test_bench_on_tiny_models_is_consistent(tmp_path):
    target = lively(1)
    drafter = SelfSpecDrafter(target, 3)
    prompts = [Prompt("", "chat", [5, 9, 14, 5, 9]), Prompt("", "chat", [1, 2, 3]), Prompt("", "code", [7, 7, 8, 7, 7, 8])]
    result = run_bench(target, None, drafter, prompts, BenchConfig(gamma=3, max_new_tokens=16, repeats=2), progress=False)
    assert result.lossless is True and result.lossless_mismatches == 0
    s = result.stats
    assert result.acceptance_rate == pytest.approx(s["accepted"] / s["proposed"])
    assert result.accepted_length == pytest.approx(1 + s["accepted"] / s["rounds"])
    assert len(result.per_position_acceptance) == 3
    assert result.request_acceptance_p10 <= result.request_acceptance_p50 <= result.request_acceptance_p90
    assert [x.name for x in result.slices] == ["chat", "code"] and [x.requests for x in result.slices] == [2, 1]
    assert result.tokens_per_second_target_only > 0 and result.speedup > 0
    assert result.cost_ratio > 0
    assert result.ideal_speedup == pytest.approx(ideal_speedup(result.acceptance_rate, 3, result.cost_ratio))
    back = type(result).from_dict({**json.loads(json.dumps(result.to_dict())), "spec": "self_spec:3"})
    assert back == result  # what the pipeline persists as JSON comes back whole (the plot in `register` needs it)
    assert "lossless (greedy == target-only)  PASS" in result.render()
    png = result.plot(tmp_path / "bench.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert evaluate(result).checks[0].passed  # the gate reads a bench result directly


def test_bench_catches_a_lossy_drafter():
    """A drafter whose drafts the engine wrongly accepts must fail the lossless check."""
    target = lively(2)

    class Lossy(NgramDrafter):
        name = "lossy"

    import specdistill.speculative.engine as engine

    original = engine.verify
    try:
        engine.verify = lambda logits, ids, q, cfg, gen: (ids.numel(), logits[-1].argmax())
        result = run_bench(target, None, Lossy(), [Prompt("", ids=[4, 5, 4, 5, 4])],
                           BenchConfig(gamma=2, max_new_tokens=12, repeats=1, measure_cost=False), progress=False)
    finally:
        engine.verify = original
    assert result.lossless is False and result.lossless_mismatches == 1
    assert result.cost_ratio is None and result.ideal_speedup is None


def test_sampling_bench_has_no_lossless_verdict():
    target = lively(3)
    drafter = ModelDrafter(lively(4, layers=1), 96)
    result = run_bench(target, None, drafter, [Prompt("", ids=[1, 2, 3])],
                       BenchConfig(gamma=2, max_new_tokens=8, repeats=1, temperature=1.0, measure_cost=False), progress=False)
    assert result.lossless is None and not result.greedy


def test_bench_many_shares_one_target_only_run_and_matches_single_runs(monkeypatch):
    """One target-only run per prompt serves every drafter; acceptance is what each drafter gets alone."""
    import specdistill.speculative.bench as bench

    target = lively(5)
    drafters = {"self3": SelfSpecDrafter(target, 3), "ngram": NgramDrafter(2, 3)}
    prompts = [Prompt("", "chat", [5, 9, 14, 5, 9]), Prompt("", "chat", [1, 2, 3]), Prompt("", "code", [7, 7, 8, 7])]
    config = BenchConfig(gamma=3, max_new_tokens=12, repeats=2, measure_cost=False)
    calls = []
    real = bench.generate
    monkeypatch.setattr(bench, "generate", lambda *a, **kw: calls.append(kw["drafter"]) or real(*a, **kw))
    many = run_bench_many(target, None, drafters, prompts, config, progress=False)
    warmup = 3
    assert len(calls) == warmup + 2 * len(prompts) * 3  # target-only + 2 drafters per prompt and repeat
    orders = [tuple(getattr(d, "name", None) for d in calls[warmup + 3 * k: warmup + 3 * k + 3]) for k in range(6)]
    assert len({o[0] for o in orders}) == 3  # each method (target-only included) gets to go first
    for name, drafter in drafters.items():
        alone = run_bench(target, None, drafter, prompts, config, progress=False)
        assert many[name].lossless is True
        counts = ("proposed", "accepted", "rounds", "generated_tokens")
        assert {k: many[name].stats[k] for k in counts} == {k: alone.stats[k] for k in counts}
        assert many[name].per_position_acceptance == alone.per_position_acceptance
        assert many[name].speedup > 0 and many[name].tokens_per_second_target_only > 0


def test_drafter_specs_build_the_drafters_the_pipeline_and_the_monitor_name(tmp_path):
    from specdistill.modeling.drafts import init_draft_from_target, save_draft
    from specdistill.speculative import drafter_from_spec
    from tests.conftest import train_bpe

    tok = train_bpe(300)
    target = make_tiny_llama(vocab_size=len(tok), layers=4, seed=2)
    draft_dir = save_draft(init_draft_from_target(target, [0, 3]), tok, tmp_path / "draft")

    drafter = drafter_from_spec(target, f"draft:{draft_dir}")
    assert isinstance(drafter, ModelDrafter) and drafter.model.config.num_hidden_layers == 2
    early = drafter_from_spec(target, "self_spec:2")
    assert isinstance(early, SelfSpecDrafter) and early.model.config.num_hidden_layers == 2
    assert (drafter_from_spec(target, "ngram").min_n, drafter_from_spec(target, "ngram").max_n) == (1, 3)
    assert (drafter_from_spec(target, "ngram:2,4").min_n, drafter_from_spec(target, "ngram:2,4").max_n) == (2, 4)
    for bad in ["draft:", "self_spec:x", "self_spec:", "ngram:2", "ngram:a,b", "medusa:3", ""]:
        with pytest.raises(ValueError, match="unknown drafter spec"):
            drafter_from_spec(target, bad)
    with pytest.raises(ValueError, match="exit layer"):
        drafter_from_spec(target, "self_spec:9")  # parsed, then refused by the drafter itself
