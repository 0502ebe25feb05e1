"""The benchmark's numbers are consistent with the decoding loop's stats and with the formulas of docs/metrics.md."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from specdistill.acceptance import DraftCounts, expected_tokens_per_round, ideal_speedup
from specdistill.ops.policy import evaluate
from specdistill.speculative import ModelDrafter, NgramDrafter, SelfSpecDrafter
from specdistill.speculative.harness_bench import (
    BenchConfig,
    BenchResult,
    Prompt,
    PromptFileError,
    SliceResult,
    load_prompts,
    percentile,
    run_bench,
    run_bench_many,
)
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


def test_draft_counts_give_every_acceptance_number_from_one_place():
    c = DraftCounts()
    for proposed, accepted in [(4, 4), (4, 1), (2, 0)]:
        c.record_round(proposed, accepted)
    assert (c.rounds, c.proposed, c.accepted) == (3, 10, 5)
    assert c.accepted_per_position == [2, 1, 1, 1] and c.proposed_per_position == [3, 3, 2, 2]
    assert c.acceptance_rate == 0.5 and c.accepted_length == pytest.approx(1 + 5 / 3)
    assert c.first_position_acceptance == pytest.approx(2 / 3) and c.per_position_acceptance[1] == pytest.approx(1 / 3)
    tree = DraftCounts(3, 10, 5, [2, 1, 1, 1], runner_ups_accepted=3)  # in τ, not in α
    assert tree.acceptance_rate == 0.5 and tree.accepted_length == pytest.approx(1 + 8 / 3)
    served = tree.served(2)  # what a chain-verifying engine's counters show: no runner-ups, γ positions
    assert served == DraftCounts(3, 10, 5, [2, 1]) and tree.over(6).accepted_per_position == [2, 1, 1, 1, 0, 0]
    assert c + DraftCounts(1, 2, 2, [1, 1, 0, 0, 0]) == DraftCounts(4, 12, 7, [3, 2, 1, 1, 0], [3, 3, 2, 2])
    empty = DraftCounts()  # nothing drafted: no acceptance, never a made-up 0
    assert (empty.acceptance_rate, empty.accepted_length, empty.first_position_acceptance) == (None, None, None)
    assert DraftCounts(2, 4, 1).first_position_acceptance is None  # no per-position counts (an engine without them)


def test_load_prompts_jsonl_text_and_spec_bench(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "hi", "slice": "chat"}\n\n{"prompt": "def f():"}\n'
                     '{"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]}\n')
    assert load_prompts(jsonl) == [Prompt("hi", "chat"), Prompt("def f():", "default"), Prompt("Write a poem.", "writing")]
    text = tmp_path / "p.txt"
    text.write_text("first line\nsecond line\n")
    assert [p.text for p in load_prompts(text)] == ["first line", "second line"]


@pytest.mark.parametrize(
    "content, message",
    [('{"prompt": "a"}\n{"prompt": \n', "p.jsonl:2: not valid JSON"),
     ('{"text": "a"}\n', "p.jsonl:1: expected"),
     ('{"prompt": ""}\n', "p.jsonl:1: key 'prompt'"),
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
    saved = json.loads(json.dumps(result.to_dict()))
    assert type(result).from_dict(saved) == result  # what the pipeline persists as JSON comes back whole
    assert saved["first_position_acceptance"] == result.per_position_acceptance[0]  # derived, written beside it
    assert result.dtype == "float64" and result.lossless_criterion == "exact" and result.lossless_exact == 3
    assert "lossless                          PASS — 3 exact, 0 differ from target-only (float64: exact equality)" in result.render()
    png = result.plot(tmp_path / "bench.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert evaluate(result).checks[0].passed  # the gate reads a bench result directly


def test_bench_catches_a_lossy_drafter():
    """A drafter whose drafts the decoding loop wrongly accepts must fail the lossless check."""
    target = lively(2)

    class Lossy(NgramDrafter):
        name = "lossy"

    import specdistill.speculative.decode as decode

    original = decode.verify
    try:
        decode.verify = lambda logits, ids, q, cfg, gen: (ids.numel(), logits[-1].argmax())
        result = run_bench(target, None, Lossy(), [Prompt("", ids=[4, 5, 4, 5, 4])],
                           BenchConfig(gamma=2, max_new_tokens=12, repeats=1, measure_cost=False), progress=False)
    finally:
        decode.verify = original
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
    import specdistill.speculative.harness_bench as bench

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


def test_bench_many_runs_each_drafter_at_its_own_gamma(monkeypatch):
    """`gammas` sets a drafter's γ in the shared run; the others keep `config.gamma`."""
    import specdistill.speculative.harness_bench as bench

    target = lively(5)
    drafters = {"self3": SelfSpecDrafter(target, 3), "ngram": NgramDrafter(2, 3)}
    prompts = [Prompt("", "chat", [5, 9, 14, 5, 9]), Prompt("", "code", [7, 7, 8, 7])]
    used = {}
    real = bench.generate
    monkeypatch.setattr(bench, "generate", lambda *a, **kw: used.setdefault(getattr(kw["drafter"], "name", None), set()).add(kw["gamma"])
                        or real(*a, **kw))
    out = run_bench_many(target, None, drafters, prompts, BenchConfig(gamma=3, max_new_tokens=12, repeats=1, measure_cost=False),
                         progress=False, gammas={"self3": 1})
    assert used[drafters["self3"].name] == {1} and used[drafters["ngram"].name] == {3}
    assert (out["self3"].gamma, out["ngram"].gamma) == (1, 3)
    assert len(out["self3"].per_position_acceptance) == 1 and out["self3"].lossless is True


def test_drafter_specs_build_the_drafters_the_pipeline_and_the_monitor_name(tmp_path):
    from specdistill.modeling.drafts import init_draft_from_target, save_draft
    from specdistill.speculative import drafter_from_spec
    from tests.conftest import train_bpe

    tok = train_bpe(300)
    target = make_tiny_llama(vocab_size=len(tok), layers=4, seed=2)
    draft_dir = save_draft(init_draft_from_target(target, [0, 3]), tok, tmp_path / "draft")

    drafter = drafter_from_spec(target, f"draft_model:{draft_dir}")
    assert isinstance(drafter, ModelDrafter) and drafter.model.config.num_hidden_layers == 2
    early = drafter_from_spec(target, "self-spec:2")
    assert isinstance(early, SelfSpecDrafter) and early.model.config.num_hidden_layers == 2
    assert (drafter_from_spec(target, "ngram").min_n, drafter_from_spec(target, "ngram").max_n) == (1, 3)
    assert (drafter_from_spec(target, "ngram:2,4").min_n, drafter_from_spec(target, "ngram:2,4").max_n) == (2, 4)
    for bad in ["draft_model:", "self-spec:x", "self-spec:", "ngram:2", "ngram:a,b", "medusa:3", ""]:
        with pytest.raises(ValueError, match="unknown drafter spec"):
            drafter_from_spec(target, bad)
    with pytest.raises(ValueError, match="exit layer"):
        drafter_from_spec(target, "self-spec:9")  # parsed, then refused by the drafter itself


# --------------------------------------------------------------------------------------------
# reduced precision: near-ties are not mismatches, a broken verifier still is


def bf16_target(seed: int = 1):
    """A tiny Llama in bf16 whose greedy output varies; in bf16 its k-token verifications and 1-token
    steps round differently, so speculative and target-only output part at near-ties now and then."""
    model = make_tiny_llama(vocab_size=96, hidden=64, layers=4, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.to(torch.bfloat16).eval()


def id_prompts(n: int = 8, vocab: int = 96) -> list[Prompt]:
    return [Prompt("", "chat" if s % 2 else "code", torch.randint(3, vocab, (6,), generator=torch.Generator().manual_seed(s)).tolist())
            for s in range(n)]


def near_tie_output(target, prompt_ids: list[int], length: int) -> tuple[list[int], float]:
    """A greedy output that takes the fp32 target's runner-up at its closest call and continues greedily
    from there: a near-tie divergence made on purpose, on any machine (bf16 rounding makes such
    divergences on some CPUs and not on others). Returns the output and that position's fp32 margin."""
    reference = copy.deepcopy(target).float()

    def step(ids):
        with torch.inference_mode():
            return reference(torch.tensor([ids])).logits[0, -1]

    ids, closest = list(prompt_ids), (float("inf"), 0, 0)
    for i in range(length):
        top2 = step(ids).topk(2)
        closest = min(closest, (float(top2.values[0] - top2.values[1]), i, int(top2.indices[1])))
        ids.append(int(top2.indices[0]))
    margin, at, runner_up = closest
    ids = [*prompt_ids, *ids[len(prompt_ids):len(prompt_ids) + at], runner_up]
    while len(ids) < len(prompt_ids) + length:
        ids.append(int(step(ids).argmax()))
    return ids[len(prompt_ids):], margin


def test_bf16_bench_passes_a_correct_engine_and_counts_near_ties_apart(monkeypatch):
    import specdistill.speculative.harness_bench as bench
    import specdistill.speculative.lossless as lossless

    target = bf16_target()
    references = []
    real = lossless.fp32_reference
    monkeypatch.setattr(lossless, "fp32_reference", lambda t: references.append(1) or real(t))
    prompts = id_prompts()
    max_new = 24
    made = {}  # prompt ids -> (constructed near-tie output, its fp32 margin), for the "tie" drafter's even prompts
    for p in prompts[::2]:
        made[tuple(p.ids)] = near_tie_output(target, p.ids, max_new)
    assert all(margin < 0.5 for _, margin in made.values())

    real_generate = bench.generate

    def generate(model, ids, *, drafter=None, **kwargs):  # the "tie" drafter parts from target-only at a near-tie
        result = real_generate(model, ids, drafter=drafter, **kwargs)
        if drafter is tie and tuple(ids) in made:
            result = dataclasses.replace(result, output_ids=made[tuple(ids)][0])
        return result

    monkeypatch.setattr(bench, "generate", generate)
    tie = NgramDrafter(1, 3)
    results = run_bench_many(target, None, {"self2": SelfSpecDrafter(target, 2), "ngram": NgramDrafter(1, 3), "tie": tie},
                             prompts, BenchConfig(gamma=4, max_new_tokens=max_new, repeats=2, measure_cost=False),
                             progress=False)
    for r in results.values():
        assert r.dtype == "bfloat16" and r.lossless_criterion == "near-tie" and r.lossless_tolerance == 0.5
        assert r.lossless is True and r.lossless_mismatches == 0, r.render_lossless()
        assert r.lossless_exact + r.lossless_near_ties == len(prompts)
        assert 0.0 <= r.lossless_max_margin <= 0.5
        assert f"PASS — {r.lossless_exact} exact, {r.lossless_near_ties} near-tie (max margin" in r.render()
        assert "dtype bfloat16" in r.render()
        assert BenchResult.from_dict(json.loads(json.dumps(r.to_dict()))) == r
        verdict = evaluate(r)
        assert verdict.checks[0].passed and "no real mismatch in bfloat16" in verdict.checks[0].reason
    # the constructed divergences are counted as near-ties, apart from the exact outputs (a prompt whose
    # bf16 target-only output already takes the runner-up there is exact: bf16 may round either way)
    tie_result = results["tie"]
    assert tie_result.lossless_near_ties >= 1 and tie_result.lossless_max_margin > 0
    assert tie_result.lossless_near_ties <= len(made) + results["ngram"].lossless_near_ties
    assert references == [1]  # one fp32 copy for the whole run, made because some output differed


def test_bf16_bench_fails_a_broken_verifier(monkeypatch):
    import specdistill.speculative.decode as decode
    from specdistill.speculative.sampling import verify

    def off_by_one(*args):  # also accepts the first rejected draft
        n, following = verify(*args)
        if n < args[1].numel():
            return n + 1, args[0][n + 1].argmax()
        return n, following

    target = bf16_target()
    monkeypatch.setattr(decode, "verify", off_by_one)
    result = run_bench(target, None, SelfSpecDrafter(target, 2), id_prompts(4),
                       BenchConfig(gamma=4, max_new_tokens=24, repeats=1, measure_cost=False), progress=False)
    assert result.lossless is False and result.lossless_mismatches > 0 and result.lossless_criterion == "near-tie"
    assert "FAIL" in result.render() and f"{result.lossless_mismatches} real mismatches" in result.render()
    check = evaluate(result).checks[0]
    assert not check.passed and "fp32 target trails by more than 0.5 logits" in check.reason


def test_fp32_bench_is_judged_by_exact_equality_without_a_reference(monkeypatch):
    import specdistill.speculative.lossless as lossless

    monkeypatch.setattr(lossless, "fp32_reference", lambda t: pytest.fail("fp32 needs no reference copy"))
    target = bf16_target().float()
    result = run_bench(target, None, NgramDrafter(1, 3), id_prompts(4),
                       BenchConfig(gamma=4, max_new_tokens=16, repeats=1, measure_cost=False), progress=False)
    assert (result.dtype, result.lossless_criterion, result.lossless_exact, result.lossless) == ("float32", "exact", 4, True)


def test_a_result_saved_before_the_criterion_still_loads_and_gates():
    old = {k: v for k, v in BenchResult(
        drafter="d", gamma=2, max_new_tokens=8, repeats=1, greedy=True, lossless=False, lossless_mismatches=2,
        acceptance_rate=0.5, accepted_length=2.0, per_position_acceptance=[0.5, 0.3], request_acceptance_p10=0.1,
        request_acceptance_p50=0.5, request_acceptance_p90=0.9, tokens_per_second_target_only=10.0,
        tokens_per_second_speculative=12.0, speedup=1.2, cost_ratio=None, ideal_speedup=None).to_dict().items()
        if not k.startswith("lossless_") or k == "lossless_mismatches"}
    del old["dtype"]
    result = BenchResult.from_dict(old)
    assert result.dtype == "float32" and result.lossless_criterion is None
    assert "lossless                          FAIL (2 outputs differ)" in result.render()
    assert "2 outputs differ from target-only" in evaluate(result).checks[0].reason


def test_slice_table_stays_aligned_for_long_names():
    long = "multilingual_translation_very_long_name"
    result = BenchResult(
        drafter="d", gamma=2, max_new_tokens=8, repeats=1, greedy=True, lossless=True, lossless_mismatches=0,
        acceptance_rate=0.5, accepted_length=2.0, per_position_acceptance=[0.5], request_acceptance_p10=0.1,
        request_acceptance_p50=0.5, request_acceptance_p90=0.9, tokens_per_second_target_only=10.0,
        tokens_per_second_speculative=12.0, speedup=1.2, cost_ratio=None, ideal_speedup=None,
        slices=[SliceResult("chat", 3, 0.5, 2.0, 10.0, 12.0, 1.2), SliceResult(long, 1, 0.25, 1.5, 9.0, 8.0, 0.89)])
    table = result.render().split("\n\n")[1].splitlines()
    assert len({len(line) for line in table}) == 1  # header and rows end in the same column
    assert table[2].startswith(long + " ")


# --------------------------------------------------------------------------------------------
# the bench command on a tiny saved target


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    from tests.conftest import save_tiny_target

    return save_tiny_target(tmp_path_factory.mktemp("target"))


SPEC_BENCH = [
    {"question_id": 1, "category": "writing", "turns": ["hello world, the quick brown fox", "def add(a, b): return a + b"]},
    {"question_id": 2, "category": "multilingual_translation_very_long_name", "turns": ["import torch as tt"]},
]


def bench_json(capsys, *argv: str) -> dict:
    from specdistill.cli import main

    assert main(["bench", "--ngram", "--max-new-tokens", "8", "--repeats", "1", "--threads", "1", "--json", *argv]) == 0
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1, out
    return json.loads(out)


def test_prompts_from_records_asks_each_turn_after_the_targets_own_answers(tiny_target_dir):
    from specdistill.data.prompt_files import PromptRecord
    from specdistill.data.prompts import encode_chat
    from specdistill.modeling.models import load_model
    from specdistill.speculative import generate
    from specdistill.speculative.harness_bench import prompts_from_records

    target = load_model(tiny_target_dir)
    records = [PromptRecord(r["turns"], r["category"]) for r in SPEC_BENCH]
    prompts = prompts_from_records(target.model, target.tokenizer, records, max_new_tokens=6)
    assert [(p.text, p.slice) for p in prompts] == [(t, r["category"]) for r in SPEC_BENCH for t in r["turns"]]
    first = [{"role": "user", "content": SPEC_BENCH[0]["turns"][0]}]
    assert prompts[0].ids == encode_chat(target.tokenizer, first)
    answer = target.tokenizer.decode(generate(target.model, prompts[0].ids, max_new_tokens=6).output_ids, skip_special_tokens=True)
    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": SPEC_BENCH[0]["turns"][1]}]
    assert prompts[1].ids == encode_chat(target.tokenizer, second)


@pytest.mark.parametrize("dtype, criterion", [("float32", "exact"), ("bfloat16", "near-tie")])
def test_bench_command_in_a_dtype_with_all_turns_and_the_gamma_curve(tiny_target_dir, tmp_path, capsys, dtype, criterion):
    questions = tmp_path / "question.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in SPEC_BENCH))
    out = bench_json(capsys, "--target", str(tiny_target_dir), "--prompts", str(questions), "--turns", "all", "--dtype", dtype)
    assert out["dtype"] == dtype and out["lossless_criterion"] == criterion and out["lossless"] is True
    assert {s["name"]: s["requests"] for s in out["slices"]} == {"writing": 2, "multilingual_translation_very_long_name": 1}
    assert sorted(out["predicted_speedups"], key=int) == [str(g) for g in range(1, 9)]
    assert sorted(out["verify_costs_measured"], key=int) == [str(k) for k in range(1, 10)] and out["verify_costs_measured"]["1"] == 1.0
    costs = [out["verify_costs"][str(k)] for k in range(1, 10)]
    assert costs == sorted(costs)
    # the smallest γ within 2% of the best (chosen on the undiluted curve; dilution by plain steps keeps
    # the order and only narrows the gaps): timing noise on a tiny model may move it, never past the tolerance
    predicted = out["predicted_speedups"]
    assert predicted[str(out["best_gamma"])] >= max(predicted.values()) * (1 - 0.02) - 1e-9


def test_bench_command_text_shows_dtype_curve_and_first_turns_only(tiny_target_dir, tmp_path, capsys):
    from specdistill.cli import main

    questions = tmp_path / "question.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in SPEC_BENCH))
    assert main(["bench", "--target", str(tiny_target_dir), "--ngram", "--prompts", str(questions), "--dtype", "float32",
                 "--max-new-tokens", "8", "--repeats", "1", "--threads", "1"]) == 0
    text = capsys.readouterr().out
    assert "dtype float32" in text and "lossless                          PASS — 2 exact" in text
    assert "predicted speedup by γ" in text and "best γ " in text and "v(k) measured in float32" in text
    rows = [line for line in text.splitlines() if line.startswith(("slice ", "writing ", "multilingual_"))]
    assert len(rows) == 3 and len({len(r) for r in rows}) == 1  # one row per category, first turns only, aligned


def test_bench_command_from_the_log_store(tiny_target_dir, tmp_path, capsys):
    from specdistill.cli import main
    from specdistill.data.logstore import LogStore
    from specdistill.data.readers import Conversation, Message

    db = f"sqlite:///{tmp_path / 'logs.db'}"
    with LogStore(db, eval_fraction=1.0) as store:
        run = store.begin_run("x", "jsonl", 0)
        store.add_batch(run, [Conversation([Message("user", f"hello {src} {i}"), Message("assistant", "ok")], src, f"{i}")
                              for src in ("chat.jsonl", "code.jsonl") for i in range(5)])
    out = bench_json(capsys, "--target", str(tiny_target_dir), "--from-logs", "eval", "--db", db, "--limit", "4",
                     "--dtype", "float32")
    assert {s["name"]: s["requests"] for s in out["slices"]} == {"chat.jsonl": 2, "code.jsonl": 2}
    assert main(["bench", "--target", str(tiny_target_dir), "--ngram", "--from-logs", "train", "--db", db]) == 2
    assert "no usable prompt in the train split" in capsys.readouterr().err
    assert main(["bench", "--target", str(tiny_target_dir), "--ngram", "--from-logs", "eval", "--turns", "all", "--db", db]) == 2
    assert "--turns applies to --prompts files" in capsys.readouterr().err


def test_bench_command_gates_its_result(tiny_target_dir, tmp_path, capsys):
    questions = tmp_path / "question.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in SPEC_BENCH))
    out = bench_json(capsys, "--target", str(tiny_target_dir), "--prompts", str(questions), "--dtype", "float32",
                     "--gate", "default")
    gate = out["gate"]
    assert gate["passed"] == (not gate["failures"]) and any("acceptance" in c["reason"] for c in gate["checks"])


def test_a_benchmark_past_its_deadline_keeps_what_it_measured():
    from specdistill.budget import Deadline
    from specdistill.speculative.harness_bench import MIN_MEASURED_PROMPTS

    target = bf16_target().float()
    prompts = id_prompts(5)
    cfg = BenchConfig(gamma=3, max_new_tokens=8, repeats=3, measure_cost=False)
    results = run_bench_many(target, None, {"ngram": NgramDrafter(1, 3)}, prompts, cfg, progress=False,
                             deadline=Deadline(0.0))  # expired from the start
    r = results["ngram"]
    assert r.repeats == 1 and sum(s.requests for s in r.slices) == MIN_MEASURED_PROMPTS and len(r.prompt_speedups) == MIN_MEASURED_PROMPTS
    assert r.lossless is True and r.lossless_exact == MIN_MEASURED_PROMPTS
    assert r.budget_note == f"time budget reached: {MIN_MEASURED_PROMPTS} of 5 prompts, 1 of 3 repeats measured"
    # a decision needs more prompts: they are measured however late it is
    needed = run_bench_many(target, None, {"ngram": NgramDrafter(1, 3)}, prompts, cfg, progress=False,
                            deadline=Deadline(0.0), min_prompts=4)["ngram"]
    assert len(needed.prompt_speedups) == 4 and needed.budget_note.startswith("time budget reached: 4 of 5 prompts")
    full = run_bench_many(target, None, {"ngram": NgramDrafter(1, 3)}, prompts, cfg, progress=False, deadline=Deadline(None))
    assert full["ngram"].repeats == 3 and full["ngram"].budget_note == "" and len(full["ngram"].prompt_speedups) == 5


def test_no_prompt_round_starts_that_the_longest_so_far_says_would_end_past_the_deadline(monkeypatch):
    import itertools

    from specdistill.budget import Deadline
    from specdistill.speculative import harness_bench
    from specdistill.speculative.harness_bench import MIN_MEASURED_PROMPTS

    clock = itertools.count(0.0, 100.0)  # every clock read 100 s later: each prompt round takes minutes
    monkeypatch.setattr(harness_bench.time, "perf_counter", lambda: next(clock))
    cfg = BenchConfig(gamma=3, max_new_tokens=8, repeats=3, measure_cost=False)
    r = run_bench_many(bf16_target().float(), None, {"ngram": NgramDrafter(1, 3)}, id_prompts(5), cfg, progress=False,
                       deadline=Deadline.after(1.0))["ngram"]  # a minute left, never expired while it runs
    assert len(r.prompt_speedups) == MIN_MEASURED_PROMPTS and r.repeats == 1
    assert r.budget_note == f"time budget reached: {MIN_MEASURED_PROMPTS} of 5 prompts, 1 of 3 repeats measured"


def test_a_benchmark_adds_prompts_only_until_its_decision_is_settled():
    target = bf16_target().float()
    prompts = id_prompts(5)
    cfg = BenchConfig(gamma=3, max_new_tokens=8, repeats=2, measure_cost=False)
    asked, rounds = [], []

    def settled(speedups: dict[str, list[float]]) -> bool:
        asked.append({name: len(xs) for name, xs in speedups.items()})
        assert all(x > 0 for xs in speedups.values() for x in xs)
        return len(speedups["ngram"]) == 3

    results = run_bench_many(target, None, {"ngram": NgramDrafter(1, 3), "self": SelfSpecDrafter(target, 1)}, prompts, cfg,
                             progress=False, min_prompts=2, settled=settled, between_rounds=lambda: rounds.append(1))
    assert asked == [{"ngram": 2, "self": 2}, {"ngram": 3, "self": 3}]  # from `min_prompts` on, after each prompt
    assert len(rounds) == 3  # before each prompt round measured
    for r in results.values():
        assert len(r.prompt_speedups) == 3 and r.repeats == 1 and r.budget_note == ""  # settled is no budget cut
        assert sum(s.requests for s in r.slices) == 3 and r.lossless_exact == 3
    never = run_bench_many(target, None, {"ngram": NgramDrafter(1, 3)}, prompts, cfg, progress=False, settled=lambda s: False)
    assert len(never["ngram"].prompt_speedups) == 5 and never["ngram"].repeats == 2


def test_a_drafter_that_can_no_longer_win_runs_on_no_further_prompts():
    target = bf16_target().float()
    calls = []

    def drop(speedups):
        calls.append(sorted(speedups))
        return {"self"} if len(speedups["ngram"]) == 2 else set()

    cfg = BenchConfig(gamma=3, max_new_tokens=8, repeats=1, measure_cost=False)
    drafters = {"ngram": NgramDrafter(1, 3), "self": SelfSpecDrafter(target, 1)}
    out = run_bench_many(target, None, drafters, id_prompts(5), cfg, progress=False, min_prompts=2, drop=drop,
                         settled=lambda speedups: (calls.append(("settled", sorted(speedups))), len(speedups["ngram"]) == 4)[1])
    assert calls == [["ngram", "self"], ("settled", ["ngram"]), ["ngram"], ("settled", ["ngram"]), ["ngram"], ("settled", ["ngram"])]
    assert len(out["ngram"].prompt_speedups) == 4 and out["ngram"].lossless_exact == 4
    assert len(out["self"].prompt_speedups) == 2 and out["self"].lossless_exact == 2 and out["self"].stats["requests"] == 2
    # never every drafter: the last one stays measured
    alone = run_bench_many(target, None, {"ngram": NgramDrafter(1, 3)}, id_prompts(3), cfg, progress=False, min_prompts=2,
                           drop=lambda speedups: set(speedups))
    assert len(alone["ngram"].prompt_speedups) == 3


def test_bench_plot_never_overwrites_a_file_it_did_not_write(tmp_path, capsys, monkeypatch):
    """`bench --plot FILE` replaced any existing file. Now: refused before any work unless FILE is a plot
    bench wrote (or --force); a format that cannot carry the mark is refused up front."""
    from specdistill.cli import main
    from specdistill.modeling import models
    from tests.conftest import save_tiny_target

    target = save_tiny_target(tmp_path / "target")
    capsys.readouterr()
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello world\n")
    mine = tmp_path / "figure.png"
    mine.write_bytes(b"\x89PNG my own figure")
    argv = ["bench", "--target", str(target), "--dtype", "float32", "--ngram", "--prompts", str(prompts), "--repeats", "1",
            "--max-new-tokens", "4", "--threads", "1"]
    real_load = models.load_model
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("refused before loading"))
    for plot in (mine, tmp_path / "figure.jpg", tmp_path):
        assert main([*argv, "--plot", str(plot)]) == 2
        err = capsys.readouterr().err
        assert str(plot) in err and err.count("\n") == 1, err
    assert mine.read_bytes() == b"\x89PNG my own figure"
    monkeypatch.setattr(models, "load_model", real_load)
    ours = tmp_path / "plots" / "bench.png"
    for _ in range(2):  # written, then replaced: a plot bench wrote is its own
        assert main([*argv, "--plot", str(ours), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["plot"] == str(ours) and ours.read_bytes()[:4] == b"\x89PNG"
    assert main([*argv, "--plot", str(mine), "--force", "--json"]) == 0  # --force: the user says so
    capsys.readouterr()
    assert mine.read_bytes()[:4] == b"\x89PNG" and mine.read_bytes() != b"\x89PNG my own figure"
    assert sorted(p.name for p in ours.parent.iterdir()) == ["bench.png"]  # no temporary file left beside it
