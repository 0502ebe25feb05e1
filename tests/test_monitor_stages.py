"""The monitoring flow's stages without Prefect: the incremental run it starts, the fallback it
writes into the serving config, and the prompt window it replays (the nightly's)."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from specdistill.data.logstore import LogStore
from specdistill.modeling.drafts import early_exit_dir
from specdistill.modeling.models import load_model
from specdistill.ops.policy import Decision
from specdistill.ops.replay import FallbackDecision
from specdistill.ops.serving import read_serving_config
from specdistill.ops.targets import TargetChange, TargetVersion
from specdistill.pipeline import monitor_stage as mc
from specdistill.pipeline.config import MonitorConfig, load_nightly_config
from specdistill.pipeline.outputs import AppliedFallback, Champion
from tests.conftest import save_tiny_target

UPDATED_AT = "2024-06-01T00:00:00+00:00"


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("target"), tie=False)


def _store(tmp_path, created: list[float], prompts: list[str] | None = None) -> str:
    """A log store with one OpenAI-format conversation per timestamp, ingested as production logs are."""
    from specdistill.data.ingest import ingest

    prompts = prompts or [f"question {i}: the quick brown fox" for i in range(len(created))]
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": "ok"}],
                                           "created": t}) + "\n" for p, t in zip(prompts, created)))
    url = f"sqlite:///{tmp_path / 'logs.db'}"
    with LogStore(url, eval_fraction=0.0) as store:  # all train: the monitor counts fresh train traffic
        ingest(traffic, "openai", store, progress=False)
    return url


def _change(drifted: bool) -> TargetChange:
    current = TargetVersion("fp-new", "/models/target-v2", "/models/target-v2", UPDATED_AT)
    return TargetChange(changed=drifted, drifted=drifted, champion_target="fp-old", current=current)


def test_incremental_run_takes_traffic_since_the_update_when_there_is_some(tmp_path):
    updated = datetime.fromisoformat(UPDATED_AT).timestamp()
    url = _store(tmp_path, [updated - 86400 * 30, updated - 60, updated + 3600, updated + 7200])
    config = MonitorConfig(target="demo", nightly_overrides=[f"log_db={url}"], replay_share=0.3)
    overrides = mc.incremental_overrides(config, _change(drifted=True))
    assert overrides == ["target=/models/target-v2", f"log_db={url}", "window.replay_share=0.3",
                         "pool.reanswer_from=fp-old", f"window.since={UPDATED_AT}"]
    nightly = load_nightly_config(None, overrides)  # what the monitor hands the nightly flow is a valid run
    assert nightly.pool.reanswer_from == "fp-old"  # the new version's pool starts from the old pool's prompts
    assert nightly.window.since == datetime(2024, 6, 1, tzinfo=timezone.utc) and nightly.window.replay_share == 0.3
    assert nightly.target == "/models/target-v2"
    # no drift: all traffic, no window start
    assert not any(o.startswith("window.since") for o in mc.incremental_overrides(config, _change(drifted=False)))


def test_incremental_run_takes_all_traffic_when_nothing_arrived_since_the_update(tmp_path):
    updated = datetime.fromisoformat(UPDATED_AT).timestamp()
    url = _store(tmp_path, [updated - 86400, updated - 60])
    config = MonitorConfig(target="demo", nightly_overrides=[f"log_db={url}"])
    overrides = mc.incremental_overrides(config, _change(drifted=True))
    assert overrides == ["target=/models/target-v2", f"log_db={url}", "window.replay_share=0.25",
                         "pool.reanswer_from=fp-old"]


def test_apply_fallback_writes_the_chosen_mode_into_the_serving_config(tiny_target, tmp_path):
    serving_file = tmp_path / "serving.json"
    config = MonitorConfig(target=str(tiny_target), gamma=3, nightly_overrides=[f"serving_path={serving_file}"])
    target = TargetVersion("fp-t", str(tiny_target), str(tiny_target), UPDATED_AT)

    undecided = FallbackDecision(False, None, None, None, "no decision: only 3 tokens")
    assert mc.apply_fallback(config, undecided, target) is None and not serving_file.exists()  # serve as before

    ngram = FallbackDecision(True, "ngram", None, 1.3, "ngram measured fastest at 1.30x")
    assert mc.apply_fallback(config, ngram, target) == AppliedFallback("ngram", None, str(serving_file))
    serving = read_serving_config(serving_file)
    assert serving.mode == "ngram" and serving.num_speculative_tokens == 3 and serving.draft_dir is None
    assert serving.target_fingerprint == "fp-t" and serving.reason == "monitor fallback: ngram measured fastest at 1.30x"

    early = FallbackDecision(True, "self_speculation", 2, 1.2, "self_speculation at exit layer 2")
    applied = mc.apply_fallback(config, early, target)
    serving = read_serving_config(serving_file)
    assert applied.mode == serving.mode == "self_speculation" and serving.exit_layer == 2
    assert serving.draft_dir == str(early_exit_dir("fp-t", 2))
    exported = load_model(serving.draft_dir)  # the early exit, exported as a draft a serving engine can load
    assert exported.config.num_hidden_layers == 2 and exported.config.vocab_size == load_model(tiny_target).config.vocab_size


def test_the_monitor_replays_the_prompt_window_the_nightly_evaluates_on(tiny_target, tmp_path, monkeypatch):
    from specdistill.data.prompts import encode_chat
    from specdistill.ops import replay

    prompts = ["short question", "the quick brown fox " * 12, "hello world", "def add(a, b): return a + b " * 6]
    url = _store(tmp_path, [1_700_000_000 + i for i in range(len(prompts))], prompts)
    config = MonitorConfig(target=str(tiny_target), replay_prompts=10,
                           nightly_overrides=[f"log_db={url}", "window.max_prompt_tokens=24"])
    tok = load_model(tiny_target).tokenizer
    fits = [p for p in prompts if len(encode_chat(tok, [{"role": "user", "content": p}])) <= 24]
    assert 0 < len(fits) < len(prompts)  # the bound really filters

    seen = {}
    monkeypatch.setattr(replay, "choose_fallback", lambda target, prompts, **kw: seen.update(prompts=prompts) or
                        replay.FallbackDecision(False, None, None, None, "captured"))
    mc.measure_fallback(config, TargetVersion("fp", str(tiny_target), "", UPDATED_AT))
    assert sorted(p.text for p in seen["prompts"]) == sorted(fits)
    assert all(len(p.ids) <= 24 for p in seen["prompts"])

    monkeypatch.setattr(replay, "replay_acceptance", lambda *a, **kw: seen.update(replay=kw) or replay.AcceptanceSample(False))
    mc.sample_acceptance(config, Champion("d", "1", "/d"),
                         TargetVersion("fp", str(tiny_target), "", UPDATED_AT))
    assert seen["replay"]["max_prompt_tokens"] == 24


# --------------------------------------------------------------------------------------------
# a corrupt serving config: an alert, never a success


def _pushed(monkeypatch) -> list[float]:
    """The serving config error count of every push to the (fake) Pushgateway."""
    import specdistill.ops.metrics as metrics

    counts = []
    monkeypatch.setenv("SPECDISTILL_PUSHGATEWAY", "http://pushgateway.invalid:9091")
    monkeypatch.setattr(metrics, "push_to_gateway", lambda gateway, job, registry: counts.append(
        registry.get_sample_value("specdistill_serving_config_errors_total")))
    return counts


@pytest.mark.parametrize("content", ["", "{}", '{"mode": "suffix", "suffix_corpus": "/c", "suffix_max_tree_depth": -1}'])
def test_a_corrupt_serving_config_stops_the_monitor_counts_an_error_and_names_the_file(tmp_path, monkeypatch, content):
    from specdistill.ops.serving import ServingConfigError

    counts = _pushed(monkeypatch)
    serving = tmp_path / "serving.json"
    serving.write_text(content)
    config = MonitorConfig(target="demo", nightly_overrides=[f"serving_path={serving}"])
    with pytest.raises(ServingConfigError, match="records no success") as err:
        mc.check_serving_config(config)
    assert str(serving) in str(err.value) and counts == [1.0]
    serving.unlink()
    mc.check_serving_config(config)  # no file: nothing served yet, nothing wrong
    assert counts == [1.0]


def test_a_serving_config_broken_during_the_run_keeps_the_decision_and_fails_the_record(tmp_path, monkeypatch):
    from specdistill.ops.serving import ServingConfigError
    from specdistill.pipeline.outputs import MonitorOutcome

    counts = _pushed(monkeypatch)
    serving = tmp_path / "serving.json"
    serving.write_text("")
    url = _store(tmp_path, [datetime(2024, 5, 1, tzinfo=timezone.utc).timestamp()])
    config = MonitorConfig(target="demo", nightly_overrides=[f"serving_path={serving}", f"log_db={url}"])
    with pytest.raises(ServingConfigError, match="is empty"):
        mc.record_decision(config, MonitorOutcome(_change(False), Decision.KEEP))
    with LogStore(url) as store:
        assert [d["kind"] for d in store.decisions()] == ["keep"]  # the decision is not lost
        assert store.last_pipeline_success() is None
    assert counts == [1.0]


def test_the_monitor_flow_on_an_empty_serving_config_exits_non_zero_and_marks_no_success(tmp_path, monkeypatch, capsys):
    """`monitor run` end to end through the command line, with the flow's stages replaced by spies: the
    check comes first, so nothing is sampled, decided or marked successful."""
    import logging

    import flows.monitor as flow
    from specdistill.cli import main

    serving = tmp_path / "serving.json"
    serving.write_text("")
    calls = []
    monkeypatch.setattr(flow, "monitor", flow.monitor.fn)  # the flow's body, without a Prefect server
    monkeypatch.setattr(flow, "get_run_logger", lambda: logging.getLogger("monitor"))
    monkeypatch.setattr(flow.t, "check_serving_config", mc.check_serving_config)
    for name in ("current_champion", "mark_success"):
        monkeypatch.setattr(flow.nt, name, lambda *a, name=name, **k: calls.append(name))
    for name in ("detect_target_change", "sample_acceptance", "record_decision"):
        monkeypatch.setattr(flow.t, name, lambda *a, name=name, **k: calls.append(name))
    assert main(["monitor", "run", f"nightly_overrides=[serving_path={serving}]"]) == 2
    err = capsys.readouterr().err
    assert f"serving config {serving} is empty" in err and err.count("\n") == 1
    assert calls == []
