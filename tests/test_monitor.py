"""Monitor: replay acceptance from the log store, the decision, the fallback choice, the early-exit
export, the metrics page fed from the store, and the decisions table."""

from __future__ import annotations

import json
import urllib.request

import pytest

from specdistill.acceptance import DraftCounts
from specdistill.data.formats import Message
from specdistill.data.logstore import LogStore
from specdistill.data.prompts import Prompt, prompt_messages
from specdistill.data.readers import Conversation
from specdistill.modeling.drafts import export_early_exit_draft, init_draft_from_target, save_draft
from specdistill.modeling.models import load_model
from specdistill.ops.metrics import LiveSample, SpecDecodeMetrics, refresh_metrics
from specdistill.ops.policy import PLAUSIBLE_FACTOR, Decision, decide
from specdistill.ops.replay import (
    AcceptanceSample,
    FallbackDecision,
    choose_fallback,
    prompts_from_store,
    replay_acceptance,
)
from specdistill.ops.serving import ServingConfig, write_serving_config
from specdistill.ops.targets import TargetChange, TargetVersion
from specdistill.speculative import ModelDrafter, SelfSpecDrafter, generate
from tests.conftest import make_tiny_llama, save_tiny_target

PROMPTS = ["hello world, the quick brown fox", "def add(a, b):", "speculative decoding drafts tokens",
           "import torch as tt", "the lazy dog jumps", "print the ones"]


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("target"), tie=False)


def fill_store(store: LogStore, prompts=PROMPTS) -> None:
    run = store.begin_run("traffic", "jsonl", 0)
    store.add_batch(run, [Conversation([Message("user", p), Message("assistant", "ok")], "traffic", f"t:{i}",
                                       timestamp=1_700_000_000 + i) for i, p in enumerate(prompts)])
    # a conversation that opens with an assistant turn has no prompt to replay
    store.add_batch(run, [Conversation([Message("system", "be brief"), Message("assistant", "hi"),
                                        Message("user", "late question")], "traffic", "t:x", timestamp=1_800_000_000)])


@pytest.fixture
def store(tmp_path):
    s = LogStore(f"sqlite:///{tmp_path / 'logs.db'}")
    fill_store(s)
    yield s
    s.close()


def test_prompt_messages_stop_before_the_first_answer_and_need_a_user_turn():
    m = [Message("system", "s"), Message("user", "u"), Message("assistant", "a"), Message("user", "u2")]
    assert prompt_messages(m) == [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert prompt_messages([Message("system", "s"), Message("assistant", "a")]) is None


def test_prompts_from_store_are_the_newest_usable_ones(store, tiny_target):
    tok = load_model(tiny_target).tokenizer
    got = prompts_from_store(store, tok, 3)
    assert [p.text for p in got] == PROMPTS[::-1][:3]  # newest first; the assistant-first record skipped
    assert all(p.ids and p.slice.startswith("conversation:") for p in got)
    assert prompts_from_store(store, tok, 3, max_prompt_tokens=2) == []  # too long: skipped, never cut



def test_the_monitor_replays_held_out_prompts_and_the_champion_at_its_measured_shape(store, tiny_target):
    """Prompts no training window drew from (the eval split), the newest of all where there are none; the
    champion at the γ and tree its registration measured it at, else serving.json's γ as a chain."""
    from specdistill.ops.replay import held_out_prompts
    from specdistill.pipeline.monitor_recipe import load_monitor_config
    from specdistill.pipeline.outputs import Champion
    from specdistill.pipeline.stages.monitor import replay_shape

    tok = load_model(tiny_target).tokenizer
    splits = {c.id: c.split for c in store.window()}
    held, which = held_out_prompts(store, tok, 10)
    evals = [p for p in held if splits[int(p.slice.split(":")[1])] == "eval"]
    if any(s == "eval" for s in splits.values()):
        assert which == "eval split" and held == evals and held
    only_train = LogStore(store.url)
    with only_train.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE conversations SET split = 'train'")
    newest, which = held_out_prompts(only_train, tok, 3)
    assert which.startswith("newest traffic") and [p.text for p in newest] == PROMPTS[::-1][:3]

    config = load_monitor_config(None, ["gamma=null"])
    tagged = Champion("d", "3", "/d", {"measured_gamma": "3", "measured_tree_width": "4"})
    assert replay_shape(config, tagged) == (3, 4)
    assert replay_shape(config, Champion("d", "2", "/d", {})) == (config.replay_gamma(), 1)
    assert replay_shape(load_monitor_config(None, ["gamma=2"]), tagged) == (2, 1)  # the monitor's own γ wins

# a replay record as the monitor wrote it before the sample held its counts (decision payloads, decision.json)
OLD_REPLAY_RECORD = {
    "ok": True, "reason": "", "source": "replay", "target_fingerprint": "fp", "draft_version": "3", "gamma": 4,
    "tree_width": 1, "prompt_split": "eval split", "requests": 6, "rounds": 40, "proposed": 150, "accepted": 60,
    "generated_tokens": 180, "accepted_per_position": [30, 18, 9, 3], "acceptance_rate": 0.4,
    "first_position_acceptance": 0.75, "mean_accepted_length": 2.5, "per_position_acceptance": [0.75, 0.45, 0.225, 0.075],
    "vocab_mismatch": False, "vocab_transplanted": False, "conversation_ids": [1, 2], "sample_ids": [7, 8],
    "seconds": 12.5, "prompts_available": 12, "stopped": "settled", "threads": "1 thread", "interval": [0.7, 0.8],
}


def test_a_replay_record_keeps_its_keys_and_one_written_before_the_counts_type_is_read():
    sample = AcceptanceSample.from_dict(json.loads(json.dumps(OLD_REPLAY_RECORD)))
    assert sample.counts == DraftCounts(40, 150, 60, [30, 18, 9, 3])
    assert sample.per_position_acceptance == pytest.approx(OLD_REPLAY_RECORD["per_position_acceptance"])
    assert (sample.counts.acceptance_rate, sample.counts.first_position_acceptance, sample.counts.accepted_length) == (
        sample.acceptance_rate, sample.first_position_acceptance, sample.mean_accepted_length)
    written = sample.to_dict()
    same = [k for k in OLD_REPLAY_RECORD if k != "per_position_acceptance"]  # every old key, same value
    assert {k: written[k] for k in same} == {k: OLD_REPLAY_RECORD[k] for k in same}
    assert written["per_position_acceptance"] == pytest.approx(OLD_REPLAY_RECORD["per_position_acceptance"])
    assert AcceptanceSample.from_dict(written) == sample


def test_replay_of_a_draft_identical_to_the_target_accepts_everything_and_stores_each_request(store, tiny_target, tmp_path):
    target = load_model(tiny_target, dtype="float32")
    clone = save_draft(init_draft_from_target(target.model, [0, 1, 2, 3]), target.tokenizer, tmp_path / "clone")
    sample = replay_acceptance(target, str(clone), store, n_prompts=4, gamma=3, max_new_tokens=12,
                               draft_version="v1", min_draft_tokens=10, progress=False)
    assert sample.ok and sample.acceptance_rate == 1.0 and not sample.vocab_mismatch
    assert sample.mean_accepted_length == pytest.approx(1 + sample.counts.accepted / sample.counts.rounds)
    assert sample.requests == 4 and len(sample.sample_ids) == 4 and len(sample.conversation_ids) == 4
    # the last rounds of a request propose fewer than gamma tokens, so later positions are rarer
    assert sample.per_position_acceptance[0] == 1.0 and sum(sample.counts.accepted_per_position) == sample.counts.accepted
    stored = store.acceptance(target.fingerprint, "v1")
    assert stored["samples"] == 4 and stored["acceptance_rate"] == pytest.approx(sample.acceptance_rate)
    assert decide(sample) == "keep"


def test_a_replay_reads_prompts_until_its_bound_settles_the_decision_or_its_time_runs_out(store, tiny_target, tmp_path):
    from specdistill.budget import Deadline

    target = load_model(tiny_target, dtype="float32")
    clone = save_draft(init_draft_from_target(target.model, [0, 1, 2, 3]), target.tokenizer, tmp_path / "clone")
    kw = dict(n_prompts=6, gamma=3, max_new_tokens=8, min_draft_tokens=10, progress=False)
    settled = replay_acceptance(target, str(clone), store, settle_lines=[0.5], min_prompts=3, **kw)
    assert settled.ok and settled.requests == 3 and settled.prompts_available == 6
    assert settled.stopped.startswith("settled after 3 of 6 prompts: its 95% interval 1.000-1.000 over 3 prompts lies over 0.500")
    every = replay_acceptance(target, str(clone), store, **kw)  # no lines: every prompt, as before
    assert every.requests == 6 and every.stopped == "every usable prompt read (6 of at most 6)"
    straddled = replay_acceptance(target, str(clone), store, settle_lines=[1.0], min_prompts=3, **kw)
    assert straddled.requests == 6 and straddled.stopped.endswith("straddles 1.000, not settled")
    assert settled.interval == [1.0, 1.0] and straddled.interval[0] <= straddled.first_position_acceptance <= straddled.interval[1]
    seen = []
    late = replay_acceptance(target, str(clone), store, settle_lines=[1.0], min_prompts=2, deadline=Deadline(0.0),
                             between_prompts=lambda: seen.append(1), **kw)
    assert late.ok and late.requests == 2 and len(seen) == 2  # past its deadline: the minimum read, no more
    assert late.stopped.startswith("time budget reached after 2 of 6 prompts: its 95% interval") and "not settled" in late.stopped
    short = replay_acceptance(target, str(clone), store, settle_lines=[1.0], min_prompts=2, deadline=Deadline(0.0),
                              **{**kw, "min_draft_tokens": 20})
    assert 2 < short.requests < 6 and short.ok and short.counts.proposed >= 20  # nor fewer draft tokens than a sample needs


@pytest.mark.e2e
def test_replay_of_an_unrelated_draft_measures_low_acceptance(store, tiny_target, tmp_path):
    target = load_model(tiny_target, dtype="float32")
    other = tmp_path / "other"
    make_tiny_llama(vocab_size=target.config.vocab_size, layers=1, seed=7, tie=False).save_pretrained(other)
    target.tokenizer.save_pretrained(other)
    sample = replay_acceptance(target, str(other), store, n_prompts=5, gamma=4, max_new_tokens=16,
                               min_draft_tokens=10, progress=False)
    assert sample.ok and sample.acceptance_rate < 0.5 and decide(sample) == "fallback"
    too_few = replay_acceptance(target, str(other), store, n_prompts=1, gamma=4, max_new_tokens=4,
                                min_draft_tokens=1000, progress=False)
    assert not too_few.ok and "minimum 1000" in too_few.reason and decide(too_few) == "no-sample"


def test_a_draft_with_the_old_vocabulary_is_measured_through_a_transplant_or_read_as_zero(store, tiny_target, tmp_path):
    from specdistill.ops.demo_update import add_domain_tokens

    old = load_model(tiny_target, dtype="float32")
    old_draft = save_draft(init_draft_from_target(old.model, [0, 1, 2, 3]), old.tokenizer, tmp_path / "old-draft")
    new = load_model(tiny_target, dtype="float32")
    add_domain_tokens(new.model, new.tokenizer, ("QuantLib", "CalcBlackScholesVega"))
    sample = replay_acceptance(new, str(old_draft), store, n_prompts=3, gamma=3, max_new_tokens=10,
                               min_draft_tokens=5, progress=False)
    assert sample.ok and sample.vocab_mismatch and sample.vocab_transplanted
    assert "vocabulary" in sample.reason and sample.acceptance_rate is not None
    strict = replay_acceptance(new, str(old_draft), store, on_vocab_mismatch="zero", progress=False)
    assert strict.ok and strict.acceptance_rate == 0.0 and strict.reason.startswith("vocabulary mismatch")
    assert decide(strict) == "fallback"


def test_decide_on_first_position_acceptance_of_replayed_and_live_samples():
    assert decide(AcceptanceSample(True, acceptance_rate=0.3, first_position_acceptance=0.5, gamma=8)) == "keep"
    assert decide(AcceptanceSample(True, acceptance_rate=0.3, first_position_acceptance=0.49)) == "fallback"
    assert decide(AcceptanceSample(True, acceptance_rate=0.3, first_position_acceptance=0.6), 0.7) == "fallback"
    assert decide(AcceptanceSample(False, reason="no prompts")) == "no-sample"
    assert decide(LiveSample(False, "metrics page unreachable")) == "no-sample"  # never a fallback by itself
    assert decide(LiveSample(True, acceptance_rate=0.2, first_position_acceptance=0.7)) == "keep"
    assert decide(LiveSample(True, acceptance_rate=0.6, first_position_acceptance=0.4)) == "fallback"
    assert decide(LiveSample(True, acceptance_rate=0.2)) == "fallback"  # no per-position counters: α stands in


@pytest.mark.e2e
def test_choose_fallback_never_decides_on_too_few_tokens_and_guards_against_slowdowns(tiny_target):
    target = load_model(tiny_target, dtype="float32")
    prompts = [Prompt(p) for p in PROMPTS[:3]]
    none = choose_fallback(target, prompts, exit_layers=(1, 2), max_new_tokens=8, min_tokens=10_000, repeats=1,
                           progress=False)
    assert not none.decided and none.mode is None and "no decision" in none.reason
    assert {(c.mode, c.exit_layer) for c in none.candidates} == {("self-spec", 1), ("self-spec", 2), ("ngram", None)}
    # a margin no fallback can beat: speculation is turned off
    off = choose_fallback(target, prompts, exit_layers=(2,), max_new_tokens=8, min_tokens=1, repeats=1,
                          margin=100.0, progress=False)
    assert off.decided and off.mode == "off" and off.speedup == 1.0 and "does not beat" in off.reason
    # three prompts are fewer than a serving choice needs: off, and said so
    few = choose_fallback(target, prompts, exit_layers=(2,), max_new_tokens=8, min_tokens=1, repeats=1,
                          margin=-1.0, progress=False)
    assert few.decided and few.mode == "off" and "on only 3 prompts, fewer than the 5" in few.reason
    # no margin and no minimum: the fastest plausible candidate wins, with its numbers
    best = choose_fallback(target, prompts, exit_layers=(1, 2), max_new_tokens=8, min_tokens=1, repeats=1,
                           margin=-1.0, min_prompts=1, progress=False)
    plausible = [c for c in best.candidates if c.speedup <= PLAUSIBLE_FACTOR * c.accepted_length]
    fastest = max(plausible, key=lambda c: c.speedup, default=None)
    if fastest is None:  # every timing on this tiny model was disturbed
        assert best.mode == "off" and "implausible" in best.reason
    else:
        assert best.mode == fastest.mode and best.exit_layer == fastest.exit_layer and best.speedup == fastest.speedup
    assert json.loads(json.dumps(best.to_dict()))["candidates"][0]["tokens_per_second_target_only"] > 0


def test_the_fallback_measures_prompts_until_its_choice_is_settled_or_its_time_runs_out(tiny_target, monkeypatch):
    from specdistill.budget import Deadline
    from specdistill.ops import replay
    from specdistill.ops.policy.sequential import Settled

    target = load_model(tiny_target, dtype="float32")
    prompts = [Prompt(p) for p in PROMPTS[:4]]
    kw = dict(exit_layers=(2,), max_new_tokens=4, min_tokens=1, repeats=1, min_prompts=2, progress=False)
    asked = []

    def settles_at_three(speedups, **_):
        asked.append({name: len(xs) for name, xs in speedups.items()})
        n = len(speedups["ngram"])
        return Settled(n >= 3, f"bound after {n}")

    monkeypatch.setattr(replay, "leader_settled", settles_at_three)
    monkeypatch.setattr(replay, "beaten", lambda speedups, **_: {})
    settled = choose_fallback(target, prompts, settle=True, **kw)
    assert asked == [{"self-spec:2": n, "ngram": n} for n in (2, 3)]  # from the choice's minimum on
    assert settled.decided and settled.prompts == 3 and settled.prompts_available == 4
    assert settled.stopped == "settled after 3 of 4 prompts: bound after 3"
    assert all(len(c.prompt_speedups) == 3 for c in settled.candidates)

    monkeypatch.setattr(replay, "leader_settled", lambda speedups, **_: Settled(False, "leader not ahead"))
    late = choose_fallback(target, prompts, settle=True, deadline=Deadline(0.0), **kw)
    assert late.prompts == 2 and late.stopped == "time budget reached after 2 of 4 prompts: leader not ahead, not settled"
    whole = choose_fallback(target, prompts, **kw)  # as before: every prompt, no bound asked for
    assert whole.prompts == 4 and whole.stopped == "every prompt measured (4)"
    # a mode that can no longer win is measured no further; the others are
    monkeypatch.setattr(replay, "beaten", lambda speedups, **_: {"self-spec:2": "slow"} if "self-spec:2" in speedups else {})
    pruned = choose_fallback(target, prompts, settle=True, **kw)
    assert pruned.prompts == 4 and pruned.stopped.endswith("not settled; self-spec:2 measured no further: slow")
    assert [len(c.prompt_speedups) for c in pruned.candidates] == [2, 4]


@pytest.mark.e2e
def test_exported_early_exit_draft_proposes_what_the_self_spec_drafter_proposes(tiny_target, tmp_path):
    target = load_model(tiny_target, dtype="float32")
    out = export_early_exit_draft(target, 2, tmp_path / "early-exit")
    exported = load_model(out, dtype="float32")
    assert exported.config.num_hidden_layers == 2 and exported.config.vocab_size == target.config.vocab_size
    ids = target.tokenizer("def add(a, b): return")["input_ids"]
    a = generate(target.model, ids, max_new_tokens=16, drafter=ModelDrafter(exported.model, target.config.vocab_size))
    b = generate(target.model, ids, max_new_tokens=16, drafter=SelfSpecDrafter(target.model, 2))
    assert a.output_ids == b.output_ids
    assert (a.stats.counts.proposed, a.stats.counts.accepted) == (b.stats.counts.proposed, b.stats.counts.accepted)
    with pytest.raises(ValueError, match="exit layer"):
        export_early_exit_draft(target, 4, tmp_path / "bad")


def test_metrics_page_counts_each_stored_sample_once_and_shows_the_serving_mode(store, tmp_path):
    store.add_acceptance_sample("fp", "v1", 2, DraftCounts(5, 10, 6, [4, 2]))
    metrics = SpecDecodeMetrics()
    write_serving_config(ServingConfig("ngram", target_fingerprint="fp", reason="fallback"))
    last = refresh_metrics(metrics, store)
    assert refresh_metrics(metrics, store, last) == last  # nothing new: nothing counted twice
    store.add_acceptance_sample("fp", "v1", 2, DraftCounts(5, 10, 2, [2, 0]))
    refresh_metrics(metrics, store, last)
    server, thread = metrics.serve(0)
    try:
        page = urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5).read().decode()
    finally:
        server.shutdown()
    assert "specdistill_spec_decode_num_draft_tokens_total 20.0" in page
    assert "specdistill_spec_decode_num_accepted_tokens_total 8.0" in page
    assert 'specdistill_serving_mode{mode="ngram"} 1.0' in page
    assert "specdistill_acceptance_rate 0.2" in page


def _page(metrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics.registry).decode()


def test_the_exporter_survives_a_bad_and_a_newer_serving_file(store, tmp_path):
    """A truncated file or one unknown key used to end `monitor serve` (exit 2 / TypeError): Prometheus
    lost its target. Now the last good config stays and an error counter rises."""
    path = tmp_path / "serving.json"
    metrics = SpecDecodeMetrics()
    write_serving_config(ServingConfig("draft", draft_dir="/d", draft_version="7", target_fingerprint="fp"), path)
    refresh_metrics(metrics, store, 0, path)
    newer = {**json.loads(path.read_text()), "speculative_tree": {"depth": 3}}  # as a newer version writes
    path.write_text(json.dumps(newer))
    refresh_metrics(metrics, store, 0, path)
    assert 'specdistill_serving_mode{mode="draft"} 1.0' in _page(metrics)
    assert "specdistill_serving_config_errors_total 0.0" in _page(metrics)
    for bad in ('{"mode": "ngram", "num_specul', '{"mode": "ngram", "num_speculative_tokens": true}', "[]"):
        path.write_text(bad)
        refresh_metrics(metrics, store, 0, path)
    page = _page(metrics)
    assert 'specdistill_serving_mode{mode="draft"} 1.0' in page and 'specdistill_draft_version_info{version="7"} 1.0' in page
    assert "specdistill_serving_config_errors_total 3.0" in page


def test_serve_metrics_refuses_a_zero_interval_before_binding(store):
    from specdistill.ops.metrics import serve_metrics

    for interval in (0, -1, float("nan")):
        with pytest.raises(ValueError, match="refresh interval"):
            serve_metrics(store, 0, interval_s=interval, iterations=1)


def test_pipeline_success_recorded_in_the_store_reaches_the_exporter(store):
    from specdistill.pipeline.success import mark_pipeline_success

    metrics = SpecDecodeMetrics()
    refresh_metrics(metrics, store)
    assert "specdistill_pipeline_last_success_timestamp_seconds" not in _page(metrics)  # never succeeded: no value
    when = mark_pipeline_success(store.url, "nightly", "fp", when=1_765_000_000.5)
    refresh_metrics(metrics, store)
    assert "specdistill_pipeline_last_success_timestamp_seconds 1.7650000005e+09" in _page(metrics)
    assert store.last_pipeline_success().timestamp() == pytest.approx(when)


def test_decisions_are_recorded_with_their_numbers(store_url):
    s = LogStore(store_url)
    try:
        # the monitor flow's record (`pipeline.stages.monitor.record_decision`): its outcome as JSON
        from specdistill.pipeline.outputs import MonitorOutcome

        current = TargetVersion("fp-new", "/t", "demo", "2024-05-01T00:00:00+00:00")
        d = MonitorOutcome(TargetChange(True, True, "fp-old", current), Decision.FALLBACK,
                           sample=AcceptanceSample(True, acceptance_rate=0.21),
                           fallback=FallbackDecision(True, "ngram", None, 1.2, "ngram measured fastest"),
                           decision_reason="acceptance 0.21 < 0.5")
        first = s.add_decision(d.decision, current.fingerprint, "3", d.to_json())
        s.add_decision("keep", "fp-old", "3", json.dumps({"acceptance_rate": 0.8}))
        got = s.decisions()
        assert [r["kind"] for r in got] == ["keep", "fallback"]  # newest first
        assert got[1]["id"] == first and got[1]["payload"]["fallback"]["mode"] == "ngram"
        assert got[1]["payload"]["sample"]["acceptance_rate"] == 0.21
        assert [r["kind"] for r in s.decisions(target_fingerprint="fp-new")] == ["fallback"]
        assert s.decisions(kind="keep")[0]["payload"] == {"acceptance_rate": 0.8}
        with pytest.raises(ValueError, match="not JSON"):
            s.add_decision("keep", "fp", None, "{broken")
    finally:
        s.close()


def test_cli_monitor_sample_prints_alpha_and_tau(store, tiny_target, tmp_path, capsys):
    from specdistill.cli import main

    target = load_model(tiny_target, dtype="float32")
    clone = save_draft(init_draft_from_target(target.model, [0, 1, 2, 3]), target.tokenizer, tmp_path / "clone")
    code = main(["monitor", "sample", "--target", str(tiny_target), "--draft", str(clone), "--n", "2",
                 "--max-new-tokens", "8", "--min-draft-tokens", "4", "--db", store.url, "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["acceptance_rate"] == 1.0 and out["decision"] == "keep" and out["requests"] == 2


def _serve_cli(argv, tmp_path, monkeypatch):
    """`monitor serve ARGV` through the command line, stopped after its first refresh (as Ctrl-C would);
    the servers it bound are shut down here."""
    import specdistill.ops.metrics as exporter
    from specdistill.cli import main

    url = f"sqlite:///{tmp_path / 'serve.db'}"
    LogStore(url).close()
    servers = []
    real_serve = SpecDecodeMetrics.serve

    def serve(self, port, host="127.0.0.1"):
        servers.append(real_serve(self, port, host))
        return servers[-1]

    def interrupt(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(SpecDecodeMetrics, "serve", serve)
    monkeypatch.setattr(exporter.time, "sleep", interrupt)
    try:
        return main(["monitor", "serve", "--db", url, "--interval", "1", *argv])
    finally:
        for httpd, _ in servers:
            httpd.shutdown()
            httpd.server_close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_monitor_serve_says_where_it_serves_only_after_the_bind(tmp_path, monkeypatch, capsys):
    port = _free_port()
    assert _serve_cli(["--host", "8.8.8.8", "--port", str(port)], tmp_path, monkeypatch) == 2  # not this machine's
    err = capsys.readouterr().err
    assert err.startswith(f"specdistill: error: cannot serve metrics on 8.8.8.8:{port}") and err.count("\n") == 1, err
    assert "serving metrics on" not in err
    assert _serve_cli(["--host", "127.0.0.1", "--port", str(port)], tmp_path, monkeypatch) == 0
    err = capsys.readouterr().err
    assert f"serving metrics on http://127.0.0.1:{port}/metrics" in err and "warning" not in err


def test_monitor_serve_on_every_interface_warns_that_the_metrics_are_public(tmp_path, monkeypatch, capsys):
    from specdistill.ops.metrics import listens_everywhere

    assert _serve_cli(["--host", "0.0.0.0", "--port", str(_free_port())], tmp_path, monkeypatch) == 0
    err = capsys.readouterr().err
    assert "serving metrics on http://0.0.0.0:" in err
    assert "warning: --host 0.0.0.0 listens on every interface" in err and "public" in err
    assert [h for h in ("0.0.0.0", "::", "[::]", "", "127.0.0.1", "::1", "localhost", "10.0.0.5") if listens_everywhere(h)] \
        == ["0.0.0.0", "::", "[::]", ""]
