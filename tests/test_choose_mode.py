"""The nightly's serving choice on recorded results: the fastest lossless mode is written, never a
slowdown, and the `champion` alias still follows the draft gate."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from specdistill.ops import registry
from specdistill.ops.policy import Check, GateVerdict
from specdistill.ops.serving import read_serving_config
from specdistill.pipeline.nightly_recipe import load_nightly_config
from specdistill.pipeline.outputs import ServingDecision, TargetInfo
from specdistill.pipeline.serving import serving_config
from specdistill.pipeline.stages import bench
from specdistill.pipeline.stages.choose_mode import serving_candidates
from specdistill.pipeline.stages.promote import promote
from specdistill.pipeline.stages.write_serving import write_serving
from specdistill.speculative.specs import DrafterSpec
from tests.conftest import bench_result

# recorded from a demo run: the distilled draft slows decoding, n-gram speeds it up
RECORDED = {
    "challenger": bench_result("draft_model:/d/challenger", 0.74),
    "generic": bench_result("draft_model:/d/generic", 0.71),
    "self-spec:8": bench_result("self-spec:8", 0.93),
    "ngram": bench_result("ngram", 1.33),
}
TARGET = TargetInfo("demo", "/t", "fp-t", num_layers=30, vocab_size=64, dtype="bfloat16")
PROMOTE, KEEP = GateVerdict(True), GateVerdict(False)


def decision(mode, name, spec, gamma=3, speedup=1.36):
    return ServingDecision(mode=mode, name=name, spec=spec and DrafterSpec.parse(spec), gamma=gamma, speedup=speedup,
                           reason=f"{name} measured fastest",
                           measured={k: v.speedup for k, v in RECORDED.items()}, measured_on="PyTorch harness, bfloat16")


def test_candidates_follow_the_gate_and_never_include_the_generic_baseline():
    assert set(serving_candidates(RECORDED, PROMOTE)) == {"challenger", "self-spec:8", "ngram"}
    with_champion = {**RECORDED, "champion": bench_result("draft_model:/d/champion", 0.8)}
    assert set(serving_candidates(with_champion, KEEP)) == {"champion", "self-spec:8", "ngram"}
    assert [DrafterSpec.parse(r.spec).mode for r in RECORDED.values()] == ["draft", "draft", "self-spec", "ngram"]


def test_a_decision_round_trips_through_its_json():
    d = replace(decision("ngram", "ngram", "ngram"), predicted_speedups={2: 1.3, 3: 1.36})
    assert ServingDecision.from_dict(json.loads(json.dumps(d.to_dict()))) == d
    assert d.to_dict()["spec"] == "ngram"  # a spec is written as its text


def test_ngram_serving_config_carries_the_measured_sizes_and_speedups():
    cfg = serving_config(decision("ngram", "ngram", "ngram"), TARGET)
    assert cfg.mode == "ngram" and cfg.num_speculative_tokens == 3
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (1, 3)  # what `ngram` measured, not vLLM's defaults
    assert cfg.measured["challenger"] == 0.74 and cfg.measured_on.endswith("bfloat16")
    assert cfg.vllm()["method"] == "ngram"


@pytest.mark.parametrize("mode", ["off"])
def test_off_writes_no_speculation(mode):
    cfg = serving_config(replace(decision(mode, None, None), gamma=4), TARGET)
    assert cfg.vllm() is None and cfg.sglang() == []


def test_a_passing_draft_becomes_champion_while_ngram_is_served(tmp_path, monkeypatch):
    from specdistill.modeling.drafts import save_draft
    from tests.conftest import make_tiny_llama, train_bpe

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    tok = train_bpe(300)
    draft = save_draft(make_tiny_llama(vocab_size=len(tok)), tok, tmp_path / "challenger")
    reg = registry.register_draft(draft, target_name="tiny-target", params={}, metrics={"acceptance_rate": 0.6},
                                  curves={}, tags={"target_fingerprint": "fp-t", "parent": ""})
    config = load_nightly_config(None, [f"serving_path={tmp_path / 'serving.json'}", "target_name=tiny-target"])
    promoted = promote(config, reg, TARGET, None, decision("ngram", "ngram", "ngram"))
    assert promoted.version == reg.version
    assert str(registry.version_by_alias(reg.name, registry.CHAMPION).version) == reg.version
    served = read_serving_config(tmp_path / "serving.json")
    assert served.mode == "ngram" and served.draft_dir is None and served.measured["ngram"] == 1.33

    # the draft itself wins when it is the fastest: its registered checkpoint is what gets served
    write_serving(config, TARGET, decision("draft", "challenger", f"draft_model:{draft}"), None)
    assert read_serving_config(tmp_path / "serving.json").mode == "draft"


# --------------------------------------------------------------------------------------------
# serving.engine: the choice reads the serving engine's measurements


def engine_entry(spec: str, speedup: float, args: list[str], lossless: bool = True):
    return bench_result(spec, speedup, lossless, dtype="Q4_1", engine="llamacpp", stats={"llamacpp_args": args})


TARGET_ARGS = ["-m", "/g/t.gguf", "-t", "2"]
ENGINE_SPEEDS = {
    "challenger": engine_entry("draft_model:/d/challenger", 0.20, [*TARGET_ARGS, "-md", "/g/c.gguf", "--spec-type", "draft-simple",
                                                             "--spec-draft-n-max", "4"]),
    "ngram": engine_entry("ngram", 1.12, [*TARGET_ARGS, "--spec-type", "ngram-simple", "--spec-draft-n-max", "4"]),
}


def test_engine_choice_uses_engine_speeds_and_writes_the_llama_cpp_command():
    from specdistill.pipeline.stages.choose_mode import choose_serving

    config = load_nightly_config(None, ["serving.engine=llamacpp"])
    # the harness measured the challenger fastest; llama.cpp did not: llama.cpp's numbers decide
    harness = {"challenger": bench_result("draft_model:/d/challenger", 1.5)}
    chosen = choose_serving(config, {}, harness, PROMOTE, ENGINE_SPEEDS)
    assert (chosen.mode, chosen.name, chosen.engine) == ("ngram", "ngram", "llamacpp")
    assert chosen.measured == {"challenger": 0.20, "ngram": 1.12} and chosen.measured_on == "llamacpp, Q4_1, 2 threads"
    cfg = serving_config(chosen, TARGET)
    out = cfg.to_dict()
    assert out["engine"] == "llamacpp"
    assert out["llamacpp"]["command"] == ("llama-server -m /g/t.gguf -t 2 --spec-type ngram-simple --spec-draft-n-max 4 --metrics")
    assert "llama.cpp       llama-server -m /g/t.gguf" in cfg.render()

    with pytest.raises(ValueError, match="engine's measurements are missing"):
        choose_serving(config, {}, harness, PROMOTE, None)


def test_engine_choice_is_off_when_nothing_beats_target_only_there():
    from specdistill.pipeline.stages.choose_mode import choose_serving

    config = load_nightly_config(None, ["serving.engine=llamacpp"])
    slow = {**ENGINE_SPEEDS, "ngram": engine_entry("ngram", 0.93, [*TARGET_ARGS, "--spec-type", "ngram-simple"])}
    chosen = choose_serving(config, {}, {}, PROMOTE, slow)
    assert chosen.mode == "off" and "0.93x" in chosen.reason
    cfg = serving_config(chosen, TARGET)
    assert cfg.llamacpp()["args"] == TARGET_ARGS and cfg.vllm() is None  # target-only, as measured


def test_gate_speed_bar_reads_the_engine_speedup():
    config = load_nightly_config(None, ["serving.engine=llamacpp", "gate.overrides.min_speedup=1.0"])
    challenger = bench_result("draft_model:/d/c", 1.5, acceptance_rate=0.7, accepted_length=3.0, per_position_acceptance=[0.8, 0.7])
    assert bench.gate(config, challenger, None, {}).passed
    verdict = bench.gate(config, challenger, None, {}, speeds=ENGINE_SPEEDS)
    assert not verdict.passed and any("0.20" in r for r in verdict.reasons)


def test_harness_choice_serves_the_winner_at_the_gamma_it_was_benchmarked_at(monkeypatch):
    """Every entry arrives at its own best γ (the benchmark stage searched it): the choice reads it and
    runs nothing again."""
    from specdistill.modeling import models
    from specdistill.pipeline.report import report_table
    from specdistill.pipeline.stages.choose_mode import choose_serving

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the choice measures nothing"))
    search = {"predicted_speedups": {"1": 1.30, "2": 1.38, "3": 1.33}, "predicted_best": 2,
              "verify_costs": {"2": 1.03, "3": 1.06}, "measured": {"4": 1.07, "2": 1.41}}
    # as benchmark.json has them: JSON keys are strings, read back as γ
    recorded = {**{n: r.to_dict() for n, r in RECORDED.items()},
                "challenger": {**RECORDED["challenger"].to_dict(), "speedup": 1.41, "gamma": 2, "gamma_search": search},
                "ngram": {**RECORDED["ngram"].to_dict(), "gamma_search": {**search, "predicted_speedups": {"3": 1.35, "4": 1.37},
                                                                         "predicted_best": 4, "measured": {"4": 1.33}}}}
    results = {name: bench_result(**{**r, "dtype": "bfloat16", "cost_ratio": 0.07}) for name, r in recorded.items()}
    config = load_nightly_config()
    chosen = choose_serving(config, {}, results, PROMOTE)
    assert (chosen.name, chosen.gamma, chosen.speedup) == ("challenger", 2, 1.41)
    assert chosen.gamma_note == "γ=2 predicted best (1.38x), confirmed: measured 1.41x at γ=2, 1.07x at γ=4"
    assert chosen.predicted_speedups == {1: 1.30, 2: 1.38, 3: 1.33} and chosen.measured_on.endswith("bfloat16")
    assert serving_config(chosen, TARGET).num_speculative_tokens == 2
    # the table shows each drafter's γ and says how it was chosen
    table = report_table(results, serving=chosen)
    assert "- ngram: γ=4 predicted best (1.37x) and measured 1.33x at γ=4" in table
    assert "| challenger | – | 0.300 | 1.60 | 2 | 1.41x |" in table  # no per-position counts recorded: "–"
    first = report_table({"challenger": replace(results["challenger"], per_position_acceptance=[0.48, 0.2])})
    assert "| challenger | 0.480 | 0.300 | 1.60 | 2 | 1.41x |" in first


def test_a_faster_challenger_that_failed_the_gate_is_named_but_not_served():
    """The demo's case: the head (a tree) beats n-gram on speed but its α is under the red line."""
    from specdistill.pipeline.stages.choose_mode import choose_serving

    results = {name: replace(r, gamma=2, dtype="bfloat16") for name, r in RECORDED.items()}
    results["challenger"].speedup = 1.35
    verdict = GateVerdict(False, [Check("acceptance rate", False, 0.295, 0.5, "acceptance rate 0.295 < 0.500")])
    chosen = choose_serving(load_nightly_config(), {}, results, verdict)
    assert chosen.name == "ngram"
    assert chosen.reason.endswith("the challenger measured faster (1.35x) but is not served: it did not pass the "
                                  "gate (acceptance rate 0.295 < 0.500)")
    slower = {**results, "challenger": replace(results["challenger"], speedup=1.2)}
    assert "challenger" not in choose_serving(load_nightly_config(), {}, slower, verdict).reason


def test_a_mean_gain_carried_by_a_few_prompts_is_not_written_and_the_report_states_the_bound(monkeypatch):
    """Per-prompt speeds travel with each entry: n-gram's 1.33x mean comes from 3 of 12 prompts, so it is
    not served; self-speculation's steadier 1.12x is, and the report says how sure that is."""
    from specdistill.pipeline.report import report_table
    from specdistill.pipeline.stages.choose_mode import choose_serving

    few = [3.2, 2.9, 2.6, 0.9, 0.85, 0.8, 0.8, 0.75, 0.7, 0.65, 0.5, 0.3]  # mean 1.33
    steady = [1.1, 1.12, 1.15, 1.09, 1.13, 1.1, 1.14, 1.11, 1.12, 1.13, 1.1, 1.15]
    results = {**RECORDED, "ngram": replace(RECORDED["ngram"], prompt_speedups=few),
               "self-spec:8": replace(RECORDED["self-spec:8"], speedup=1.12, prompt_speedups=steady)}
    results = {name: replace(r, dtype="bfloat16") for name, r in results.items()}
    config = load_nightly_config()
    chosen = choose_serving(config, {}, results, KEEP)
    assert chosen.mode == "self-spec" and chosen.name == "self-spec:8"
    assert 1.05 < chosen.speedup_lower_bound < 1.12 and chosen.confidence == 0.95
    assert "ngram 1.33x (≥" in chosen.reason  # the unsteady mean is listed with its bound
    line = report_table(results, serving=chosen)
    assert f"lower bound of {chosen.speedup_lower_bound:.2f}x at 95% confidence" in line
    only_few = choose_serving(config, {}, {"ngram": results["ngram"]}, KEEP)
    assert only_few.mode == "off" and "no mode's gain holds over the prompts" in only_few.reason


def test_a_head_served_as_a_tree_gives_chain_engines_the_chain_depth_its_own_chain_predicts(tmp_path):
    """SGLang runs the measured tree (steps, top-k, draft tokens); vLLM and llama.cpp verify chains, so serving.json
    gives them the depth the head's top-1 chain predicts fastest, not the tree's depth."""
    from specdistill.data.results import GammaSearch
    from specdistill.modeling.eagle3_init import init_eagle3_from_target
    from specdistill.modeling.eagle3_io import save_eagle3
    from specdistill.modeling.vocab import DraftVocab
    from specdistill.pipeline.stages.choose_mode import chain_gamma
    from tests.conftest import make_tiny_llama, train_bpe

    tok = train_bpe(300)
    target = make_tiny_llama(vocab_size=len(tok), layers=6)
    head = save_eagle3(init_eagle3_from_target(target, DraftVocab(torch.arange(50), len(tok))), tok, tmp_path / "head")
    flat = {k: 1.0 for k in range(1, 10)}  # verification as cheap as a step, as bf16 measures up to 8 tokens
    tree = replace(bench_result(f"draft_model:{head}", 1.6), tree_width=4, gamma=4, cost_ratio=0.05,
                   per_position_acceptance=[0.6, 0.12, 0.02, 0.0],  # the chain stops after its second position
                   gamma_search=GammaSearch(predicted_speedups={4: 1.5}, predicted_best=4, verify_costs=flat,
                                            measured={4: 1.6}))
    assert chain_gamma(tree) == 2 and chain_gamma(replace(tree, tree_width=1)) is None
    d = replace(decision("draft", "challenger", f"draft_model:{head}", gamma=4), tree_width=4, chain_gamma=2)
    cfg = serving_config(d, TARGET, "3", str(head))
    assert cfg.draft_kind == "eagle3" and cfg.tree_width == 4 and cfg.chain_speculative_tokens == 2
    assert cfg.vllm()["num_speculative_tokens"] == 2  # vLLM: the chain
    flags = cfg.sglang()
    assert [flags[flags.index(f) + 1] for f in ("--speculative-num-steps", "--speculative-eagle-topk",
                                                 "--speculative-num-draft-tokens")] == ["4", "4", "8"]
