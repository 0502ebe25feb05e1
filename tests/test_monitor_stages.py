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
from specdistill.pipeline.monitor_recipe import MonitorConfig
from specdistill.pipeline.nightly_recipe import load_nightly_config
from specdistill.pipeline.outputs import AppliedFallback, Champion
from specdistill.pipeline.stages import monitor as mc
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

    early = FallbackDecision(True, "self-spec", 2, 1.2, "self-spec at exit layer 2")
    applied = mc.apply_fallback(config, early, target)
    serving = read_serving_config(serving_file)
    assert applied.mode == serving.mode == "self-spec" and serving.exit_layer == 2
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


# --------------------------------------------------------------------------------------------
# the decision's time budget, its threads, and its stage minutes in the report


def test_the_decision_deadline_is_shared_by_the_replay_and_the_fallback_as_the_nightlys_stages_are():
    config = MonitorConfig(target="demo", deadline_minutes=8, replay_max_minutes=1.5, fallback_max_minutes=6)
    deadline_at = mc.decision_deadline(config, now=1000.0)
    assert deadline_at == 1000.0 + 480
    assert mc.stage_deadline(config, "replay", deadline_at, now=1000.0).at == 1000.0 + 90  # its own budget
    assert mc.stage_deadline(config, "fallback", deadline_at, now=1100.0).at == 1000.0 + 460  # its own: 6 minutes from now
    assert mc.stage_deadline(config, "fallback", deadline_at, now=1300.0).at == 1000.0 + 480  # cut to the deadline
    tight = MonitorConfig(target="demo", deadline_minutes=3, replay_max_minutes=1.5, fallback_max_minutes=6)
    assert mc.stage_deadline(tight, "replay", mc.decision_deadline(tight, now=0.0), now=0.0).at == 180 * 1.5 / 7.5  # its share
    assert mc.decision_deadline(MonitorConfig(target="demo", deadline_minutes=None)) is None
    with pytest.raises(ValueError, match="not a budgeted monitor stage"):
        mc.stage_deadline(config, "retraining", deadline_at)


def test_the_replay_stops_on_the_lines_the_decision_turns_on():
    config = MonitorConfig(target="demo", red_line=0.5, max_relative_drop=0.2)
    assert mc.decision_lines(config, None) == [0.5]
    assert mc.decision_lines(config, Champion("d", "1", "/d", tags={"first_position_acceptance": "0.75"})) == pytest.approx([0.5, 0.6])
    assert mc.decision_lines(config, Champion("d", "1", "/d", tags={"first_position_acceptance": "n/a"})) == [0.5]


def test_the_monitor_measures_at_the_threads_it_finds_best_and_puts_torchs_back(tiny_target, monkeypatch):
    import torch

    from specdistill.speculative import threads

    target = load_model(tiny_target, dtype="float32")
    before = torch.get_num_threads()
    probes = []

    def probe(model, ids, candidates=None):
        probes.append(list(ids))
        torch.set_num_threads(1)
        return threads.ThreadChoice(1, {1: 20.0, 2: 6.0})

    monkeypatch.setattr(threads, "fastest_threads", probe)
    with mc.measuring_threads(MonitorConfig(target="demo"), target, [5, 6, 7]) as watch:  # auto
        assert torch.get_num_threads() == 1 and probes == [[5, 6, 7]]
        assert watch.describe().startswith("1 thread, the fastest of a probe (tokens/s by threads: 1: 20.0, 2: 6.0")
    assert torch.get_num_threads() == before
    with mc.measuring_threads(MonitorConfig(target="demo"), target, list(range(500))):  # decoding timed, not a prefill
        assert probes.pop() == list(range(500 - mc.PROBE_PROMPT_TOKENS, 500))
    with mc.measuring_threads(MonitorConfig(target="demo", threads=1), target, [5, 6, 7]) as watch:
        assert watch is None and torch.get_num_threads() == 1 and len(probes) == 1
    assert torch.get_num_threads() == before
    with mc.measuring_threads(MonitorConfig(target="demo"), target, None) as watch:  # nothing to probe on
        assert watch is None and len(probes) == 1
    assert torch.get_num_threads() == before


def test_the_monitor_flow_decides_within_its_deadline_reports_its_stage_minutes_and_can_stop_before_retraining(monkeypatch):
    """The flow's body with its stages replaced: both measuring stages get the one deadline fixed at the
    start; `retrain=false` falls back without starting the incremental run; the report says how each
    measurement ended and the minutes of each stage."""
    import logging
    import time

    import flows.monitor as flow
    from specdistill.acceptance import DraftCounts
    from specdistill.ops.replay import AcceptanceSample

    calls, deadlines = [], []
    change = _change(drifted=True)
    sample = AcceptanceSample(True, acceptance_rate=0.1, first_position_acceptance=0.119,
                              counts=DraftCounts(proposed=300),
                              mean_accepted_length=1.1, stopped="settled after 6 of 12 prompts: its 95% interval "
                              "0.080-0.160 over 6 prompts lies under 0.500", threads="1 thread, the fastest of a probe")
    fallback = FallbackDecision(True, "ngram", None, 1.78, "ngram measured fastest at 1.78x", prompts=9,
                                stopped="time budget reached after 9 of 16 prompts: the leader ngram's 95% lower "
                                        "bound over 9 prompts is 1.02x, not above 1.05x, not settled")
    monkeypatch.setattr(flow, "get_run_logger", lambda: logging.getLogger("monitor"))
    monkeypatch.setattr(flow, "create_markdown_artifact", lambda *a, **k: None)
    monkeypatch.setattr(flow, "nightly", lambda **k: calls.append("nightly"))
    monkeypatch.setattr(flow.t, "check_serving_config", lambda config: None)
    monkeypatch.setattr(flow.nt, "current_champion", lambda config: Champion("draft", "1", "/d"))
    monkeypatch.setattr(flow.nt, "mark_success", lambda *a: calls.append("mark_success"))
    monkeypatch.setattr(flow.t, "detect_target_change", lambda config, champion: change)
    monkeypatch.setattr(flow.t, "sample_acceptance", lambda config, champion, target, deadline_at: deadlines.append(deadline_at) or sample)
    monkeypatch.setattr(flow.t, "choose_fallback", lambda config, target, deadline_at: deadlines.append(deadline_at) or fallback)
    monkeypatch.setattr(flow.t, "apply_fallback", lambda *a: calls.append("apply_fallback"))
    monkeypatch.setattr(flow.t, "record_decision", lambda config, outcome: calls.append("record_decision"))
    started = time.time()
    outcome = flow.monitor.fn(overrides=["retrain=false", "deadline_minutes=5"])
    assert outcome.decision == Decision.FALLBACK and outcome.fallback is fallback and outcome.incremental is None
    assert calls == ["apply_fallback", "record_decision", "mark_success"]  # no incremental run
    assert len(set(deadlines)) == 1 and started + 300 <= deadlines[0] <= time.time() + 300
    assert list(outcome.stage_seconds) == ["start", "replay", "fallback", "record"]
    report = outcome.report
    assert "replay: settled after 6 of 12 prompts" in report and "threads: 1 thread, the fastest of a probe" in report
    assert "fallback bench: time budget reached after 9 of 16 prompts" in report and "not settled" in report
    assert "**stage times** (minutes, 0.0 in all; the decision in 0.0 of a 5-minute deadline): start 0.0 · replay 0.0" in report
    assert "measured on: CPU " in report


def test_the_recorded_decision_carries_each_stages_minutes_to_mlflow(tmp_path):
    import mlflow

    from specdistill.ops import registry
    from specdistill.pipeline.outputs import MonitorOutcome

    url = _store(tmp_path, [datetime(2024, 5, 1, tzinfo=timezone.utc).timestamp()])
    config = MonitorConfig(target="demo", nightly_overrides=[f"serving_path={tmp_path / 'serving.json'}", f"log_db={url}"])
    outcome = MonitorOutcome(_change(False), Decision.KEEP, stage_seconds={"start": 6.0, "replay": 30.0})
    mc.record_decision(config, outcome)
    registry.client()
    run = mlflow.search_runs(experiment_ids=[registry.experiment_for(config.nightly.target_name)], output_format="list")[0]
    assert run.data.metrics["start_minutes"] == pytest.approx(0.1) and run.data.metrics["replay_minutes"] == pytest.approx(0.5)
