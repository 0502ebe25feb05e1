"""End to end: the drift scenario. A champion that drafts well for the demo target; the target is
updated (top layers fine-tuned on code, domain tokens added); the monitor notices, measures the
drop, falls back to the fastest mode, retrains with a vocab transplant, and returns to draft mode.
Once with a layer-extracted champion, once with the kind the nightly trains by default, an EAGLE-3 head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "deploy" / "nightly" / "tiny.yaml")


def _monitor_overrides(traffic: Path, *nightly: str) -> list[str]:
    sources = f'[{{path: "{traffic}", format: jsonl, slice: chat}}]'
    extra = "".join(f", '{o}'" for o in nightly)
    return [f"nightly_config={TINY}", f"nightly_overrides=['sources={sources}', 'bench.generic_draft=false', "
            f"'bench.self_spec_layers=[]', 'bench.ngram=false', 'serving.choose_gamma=false'{extra}]",
            "replay_prompts=6", "fallback_prompts=6", "max_new_tokens=16", "min_draft_tokens=16", "fallback_exit_layers=[6]",
            "fallback_min_tokens=16"]


@pytest.fixture(scope="module")
def updated_demo(tmp_path_factory) -> Path:
    """The demo target, updated: top layers tuned on code, domain tokens added. A strong update (lr 1e-3) so the drop
    is far below the red line on any CPU; the fluent default (2e-4) is measured by benchmarks/experiments/drift_acceptance.py.
    Made once for the module's scenarios (each registers it in its own state directory)."""
    from specdistill.ops.demo_update import make_target_update

    return make_target_update("demo", tmp_path_factory.mktemp("updated") / "target-v2", steps=40, examples=40, lr=1e-3,
                              progress=False)


def _code_traffic(tmp_path: Path) -> Path:
    """100 code prompts (HumanEval-like requests in ten phrasings), as a jsonl log."""
    traffic = tmp_path / "traffic.jsonl"
    tasks = ["returns the square of a number", "reverses a string", "checks whether a number is prime",
             "counts the vowels in a string", "merges two sorted lists", "computes a factorial",
             "finds the largest element of a list", "removes duplicates from a list", "parses a CSV line",
             "converts Celsius to Fahrenheit"]
    styles = ["Write a Python function that {}.", "Show me Python code that {}.", "In Python, implement a helper that {}.",
              "Explain briefly, then write a function that {}.", "Write a short, documented Python function that {}.",
              "Give a one-line Python expression or function that {}.", "Write a JavaScript function that {}.",
              "Write a Python class method that {}.", "How would you write code that {}?", "Write a recursive function that {}."]
    prompts = [style.format(task) for style in styles for task in tasks]
    traffic.write_text("".join(json.dumps({"prompt": p, "response": "..."}) + "\n" for p in prompts))
    return traffic


def test_drift_scenario_detect_fallback_retrain_recover(prefect_harness, demo_target, updated_demo, tmp_path, monkeypatch):
    from flows.monitor import monitor
    from specdistill.data.ingest import ingest
    from specdistill.data.logstore import LogStore
    from specdistill.modeling.drafts import init_draft_from_target, save_draft
    from specdistill.ops import registry
    from specdistill.ops.serving import ServingConfig, read_serving_config
    from specdistill.ops.targets import register_target

    monkeypatch.setenv("SPECDISTILL_HOME", str(tmp_path / "home"))
    traffic = _code_traffic(tmp_path)
    store = LogStore()
    ingest(traffic, "jsonl", store, progress=False)

    # A champion that drafts well for the current target: the target without two middle layers
    # (untrained layer subsets that drop more stay below 0.5 on this model).
    register_target("demo")
    strong = init_draft_from_target(demo_target.model, [i for i in range(30) if i not in (14, 15)])
    champion_dir = save_draft(strong, demo_target.tokenizer, tmp_path / "strong-draft")
    reg = registry.register_draft(champion_dir, target_name="SmolLM2-135M-Instruct",
                                  tags={"target_fingerprint": demo_target.fingerprint, "parent": ""})
    registry.promote(reg.name, reg.version, ServingConfig(mode="draft", draft_dir=str(champion_dir),
                                                         draft_version=reg.version), expected_champion=None)

    before = monitor(overrides=_monitor_overrides(traffic))
    assert before.decision == "keep" and not before.change.changed
    first_before = before.sample.first_position_acceptance  # the red line's quantity
    assert first_before >= 0.5

    register_target(updated_demo)  # the target is updated and registered (as `specdistill target register` does)

    after = monitor(overrides=_monitor_overrides(traffic))
    assert after.change.drifted and after.sample.ok
    first_after = after.sample.first_position_acceptance
    assert first_after < 0.5 and after.decision == "fallback"
    # the serving config switched to the fallback that measured fastest
    fallback = after.fallback
    assert fallback.decided
    assert after.serving.mode == fallback.mode
    speedups = {(c.mode, c.exit_layer): c.speedup for c in fallback.candidates}
    if fallback.mode != "off":
        assert fallback.speedup == max(speedups.values())
    # the drop and the decision are recorded with their numbers
    decisions = LogStore().decisions(kind="fallback")
    assert decisions and decisions[0]["target_fingerprint"] == after.change.current.fingerprint
    assert LogStore().acceptance(after.change.current.fingerprint, reg.version)["acceptance_rate"] < 0.5

    # incremental distillation ran on the new target, warm-started through a vocab transplant
    inc = after.incremental
    assert inc.warm_start.transplanted
    new_version = inc.registered.version
    mv = registry.client().get_model_version(reg.name, new_version)
    assert mv.tags["parent"] == reg.version and mv.tags["target_fingerprint"] == after.change.current.fingerprint
    # promoted only if it passed the gate; then serving is what the retrain measured fastest
    assert bool(inc.promoted) == inc.verdict.promote
    serving = read_serving_config()
    if inc.promoted:
        assert str(registry.version_by_alias(reg.name, "champion").version) == new_version
        assert serving.mode == inc.serving.mode
        if serving.mode == "draft":
            assert serving.draft_version == new_version
    else:
        assert str(registry.version_by_alias(reg.name, "champion").version) == reg.version
        assert serving.mode == fallback.mode
    print(json.dumps({"first_position_before": first_before, "first_position_after": first_after,
                      "fallback": fallback.mode, "promoted": bool(inc.promoted)}))


def test_drift_scenario_with_an_eagle3_champion_retrains_the_head_on_the_new_target(prefect_harness, demo_target,
                                                                                   updated_demo, tmp_path, monkeypatch):
    """The default kind's path: a head champion, a target update that adds tokens, and the monitor's incremental
    distillation warm-starting the head across the update (another fingerprint, its vocabulary carried over)."""
    from flows.monitor import monitor
    from specdistill.data.ingest import ingest
    from specdistill.data.logstore import LogStore
    from specdistill.modeling.eagle3_init import init_eagle3_from_target
    from specdistill.modeling.eagle3_io import META_FILE, is_eagle3_dir, save_eagle3
    from specdistill.modeling.vocab import build_draft_vocab, token_frequencies
    from specdistill.ops import registry
    from specdistill.ops.policy import FIRST_POSITION_TAG
    from specdistill.ops.serving import ServingConfig, read_serving_config
    from specdistill.ops.targets import register_target

    monkeypatch.setenv("SPECDISTILL_HOME", str(tmp_path / "home"))
    traffic = _code_traffic(tmp_path)
    ingest(traffic, "jsonl", LogStore(), progress=False)
    register_target("demo")
    tok, fp = demo_target.tokenizer, demo_target.fingerprint
    texts = [json.loads(line)["prompt"] for line in traffic.read_text().splitlines()]
    vocab = build_draft_vocab(token_frequencies(tok, texts), 2048, demo_target.config.vocab_size, [tok.eos_token_id])
    head = init_eagle3_from_target(demo_target.model, vocab)
    head_dir = save_eagle3(head, tok, tmp_path / "head", {"target_fingerprint": fp, "target": str(demo_target.path)})
    reg = registry.register_draft(head_dir, target_name="SmolLM2-135M-Instruct",
                                  tags={"target_fingerprint": fp, "parent": "", FIRST_POSITION_TAG: "0.6"})
    registry.promote(reg.name, reg.version, ServingConfig(mode="draft", draft_dir=str(head_dir), draft_kind="eagle3",
                                                         draft_version=reg.version), expected_champion=None)

    new_fp = register_target(updated_demo).fingerprint
    after = monitor(overrides=_monitor_overrides(traffic, "train.kind=eagle3", "train.draft_vocab=2048",
                                                 "train.optim.max_steps=6"))
    assert after.change.drifted and after.decision == "fallback" and after.sample.first_position_acceptance < 0.5
    assert after.fallback.decided and after.serving.mode == after.fallback.mode

    inc = after.incremental  # the retraining ran on the new target, from the champion carried over to it
    assert inc.warm_start.usable and inc.warm_start.transplanted and inc.warm_start.version == reg.version
    assert "trained for target " + fp in inc.report
    mv = registry.client().get_model_version(reg.name, inc.registered.version)
    assert mv.tags["draft_kind"] == "eagle3" and mv.tags["target_fingerprint"] == new_fp
    assert mv.tags["parent"] == reg.version and mv.tags["warm_start_target_fingerprint"] == fp
    local = registry.download_draft(inc.registered.model_uri)
    meta = json.loads((Path(local) / META_FILE).read_text())
    assert is_eagle3_dir(local) and meta["warm_start"]["target_fingerprint"] == fp
    assert meta["target_fingerprint"] == new_fp and meta["warm_start"]["vocab_carried_over"]
    # gated against the new target; promoted only if it passed, and serving is then what the retrain measured fastest
    assert bool(inc.promoted) == inc.verdict.promote
    serving = read_serving_config()
    if inc.promoted:
        assert str(registry.version_by_alias(reg.name, "champion").version) == inc.registered.version
        assert serving.mode == inc.serving.mode and serving.target_fingerprint == new_fp
    else:
        assert serving.mode == after.fallback.mode
