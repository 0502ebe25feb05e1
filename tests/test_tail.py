"""The nightly's tail reserve (`pipeline.tail`): what a run keeps for the benchmark of its draft, what the stages
before it get, and what gives way first when time is short."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdistill.data.prompts import Prompt
from specdistill.pipeline import tail
from specdistill.pipeline.nightly_recipe import load_nightly_config
from specdistill.pipeline.outputs import GeneratedData, Untrained, Window
from specdistill.pipeline.stage_budgets import stage_budgets, stage_deadline
from specdistill.pipeline.stages import bench
from specdistill.pipeline.stages.distill import distill_draft
from specdistill.speculative.specs import SELF_SPEC, DrafterSpec
from specdistill.speculative.threads import ThreadChoice
from tests.conftest import trained_result

FRONT = ("answers", "distill", "generic")
NOW = 1000.0


def _config(*overrides: str):
    return load_nightly_config(None, ["generation.max_minutes=7", "train.optim.max_minutes=4.5", "bench.max_minutes=4",
                                      "bench.generic_minutes=1", *overrides])


def test_a_reserve_the_benchmark_s_own_share_covers_cuts_nothing():
    """The quiet demo: 17 minutes left, the benchmark's share (4 of 16.5 budgeted) holds the 0.6-minute reserve."""
    config, reserve = _config(), tail.TailReserve(seconds=36.0)
    at = NOW + 17 * 60
    assert reserve.cut(config, "answers", at, now=NOW) == at and reserve.cuts == []
    assert tail.TailReserve().cut(config, "answers", at, now=NOW) == at  # nothing reserved: nothing moves
    assert reserve.cut(config, "answers", None, now=NOW) is None  # no deadline


def test_a_run_behind_its_deadline_cuts_the_stages_before_the_benchmark_to_leave_the_reserve():
    """6 minutes left at the training, 3 reserved: the benchmark's proportional share (4/9.5 of 6 = 2.5) would not
    hold it, so the training and the generic baseline share the 3 left in proportion (4.5 : 1)."""
    config, reserve = _config(), tail.TailReserve(seconds=180.0)
    at = NOW + 6 * 60
    cut_at = reserve.cut(config, "distill", at, now=NOW)
    distill = stage_deadline(config, "distill", cut_at, now=NOW).minutes(NOW)
    assert distill == pytest.approx(3 * 4.5 / 5.5)
    generic = stage_deadline(config, "generic", reserve.cut(config, "generic", at, now=NOW + 60 * distill),
                             now=NOW + 60 * distill).minutes(NOW + 60 * distill)
    assert distill + generic == pytest.approx(3.0)  # the benchmark starts with its 3 minutes
    assert reserve.cuts[0] == "distill: 2.5 minutes, its share cut from 2.8 to keep the tail's 3.0"
    # a stage without a budget of its own (`generation.max_minutes: null`) stops the reserve before the deadline
    unbudgeted = _config("generation.max_minutes=null")
    assert tail.TailReserve(seconds=180.0).cut(unbudgeted, "answers", at, now=NOW) == pytest.approx(at - 180)


@settings(max_examples=200, deadline=None)
@given(left=st.floats(0.0, 60.0), reserve=st.floats(0.0, 20.0),
       budgets=st.lists(st.one_of(st.none(), st.floats(0.1, 10.0)), min_size=4, max_size=4), generic=st.booleans())
def test_the_stages_before_the_benchmark_never_take_the_reserve_nor_more_than_without_it(left, reserve, budgets, generic):
    """Each front stage taking its whole share in turn, the benchmark starts with at least the reserve (or all that
    was left), and no stage gets more than it would without a reserve."""
    answers, distill, generic_minutes, bench_minutes = budgets
    config = load_nightly_config(None, [f"generation.max_minutes={answers or 'null'}",
                                        f"train.optim.max_minutes={distill or 'null'}",
                                        f"bench.generic_draft={str(generic).lower()}",
                                        f"bench.generic_minutes={generic_minutes or 'null'}",
                                        f"bench.max_minutes={bench_minutes or 'null'}"])
    r = tail.TailReserve(seconds=60 * reserve)
    at, now = NOW + 60 * left, NOW
    for stage in (s for s in FRONT if s in stage_budgets(config)):
        share = stage_deadline(config, stage, r.cut(config, stage, at, now=now), now=now).remaining(now)
        assert share <= stage_deadline(config, stage, at, now=now).remaining(now) + 1e-6
        now += min(share, 1e9)  # a stage without any bound (no budget, no deadline) does not occur: `at` is set
    assert at - now >= min(60 * reserve, 60 * left) - 1e-6


def test_the_reserve_is_sized_from_the_decode_speed_with_a_floor():
    config = load_nightly_config(None, ["deadline_minutes=18"])  # 40 new tokens, 5 prompts needed
    fast = tail.tail_reserve(config, 37.0, champion=False)  # bf16, quiet: the floor
    assert fast.seconds == 60 * tail.MIN_TAIL_MINUTES and fast.prompts == 5 and fast.drafters == 1
    slow = tail.tail_reserve(config, 4.0, champion=True, threads="1 thread")  # a busy neighbour
    assert slow.seconds == pytest.approx(tail.BENCH_OVERHEAD_S + 6 * (1 + 2 * tail.SPECULATIVE_RUN) * 40 / 4.0)
    assert slow.describe().startswith("reserved for the tail: 4.2 minutes before the closing stages for a benchmark of "
                                      "the challenger and the champion on 5 held-out prompts (target-only at 4.0 tokens/s")
    assert tail.tail_reserve(config, None, champion=False).seconds == 60 * tail.MIN_TAIL_MINUTES  # not measured
    assert tail.tail_reserve(load_nightly_config(None, ["deadline_minutes=null"]), 4.0, champion=True).seconds == 0


def test_a_night_whose_reserve_leaves_nothing_before_it_cannot_train():
    r = tail.TailReserve(seconds=120.0)
    assert r.leaves_nothing(None) is None and r.leaves_nothing(NOW + 121, now=NOW) is None
    why = r.leaves_nothing(NOW + 90, now=NOW)
    assert isinstance(why, Untrained) and why.reason == (
        "the run's deadline leaves 1.5 minutes, no more than the 2.0 its tail needs: no time to answer or train; "
        "the champion and serving.json are unchanged")


def _drafters() -> dict[str, DrafterSpec]:
    return {"challenger": DrafterSpec("ngram"), "champion": DrafterSpec("ngram"),
            "generic": DrafterSpec("ngram"), "self-spec:8": DrafterSpec(SELF_SPEC, "8"), "ngram": DrafterSpec("ngram"),
            "suffix": DrafterSpec("suffix", "/c"), "hybrid": DrafterSpec("hybrid", "/d,/c")}


def test_the_challenger_and_champion_are_always_benchmarked_and_the_rest_while_they_fit():
    config, drafters = load_nightly_config(None, []), _drafters()
    assert tail.fit_drafters(config, drafters, 0.0, 30.0) == (
        ["challenger", "champion"], ["ngram", "suffix", "self-spec:8", "generic", "hybrid"])
    two_more = tail.minimal_bench_seconds(config, 30.0, 4)
    kept, skipped = tail.fit_drafters(config, drafters, two_more, 30.0)
    assert kept == ["challenger", "champion", "ngram", "suffix"] and skipped == ["self-spec:8", "generic", "hybrid"]
    assert tail.fit_drafters(config, drafters, 3600.0, 30.0) == (list(drafters), [])


def test_the_benchmark_stage_measures_what_its_share_fits_and_says_what_it_left_out(monkeypatch):
    config = load_nightly_config(None, ["bench.max_minutes=4"])
    prompts = [Prompt(text="", ids=[1, 2, 3])]
    probe = ThreadChoice(2, {1: 20.0, 2: 30.0})
    kept, note = bench._fit(config, _drafters(), None, prompts, probe, time.time() + 20)
    assert list(kept) == ["challenger", "champion"]
    assert note.startswith("not measured, the run's deadline leaving the benchmark 0.3 minutes at 30.0 target tokens/s: ngram")
    assert bench._fit(config, _drafters(), None, prompts, probe, None) == (_drafters(), "")  # no deadline: every entry


def test_the_decode_speed_is_measured_at_the_benchmark_s_threads_and_torch_s_count_is_put_back(tiny_llama):
    before = torch.get_num_threads()
    rate, how = tail.measure_decode(tiny_llama, list(range(3, 20)), 1)
    assert rate > 0 and how == "1 thread" and torch.get_num_threads() == before
    rate, how = tail.measure_decode(tiny_llama, list(range(3, 20)), "auto")
    assert rate > 0 and "thread" in how and torch.get_num_threads() == before


def test_the_generic_baseline_gives_way_under_half_its_budget(monkeypatch):
    """Optional work: with 20 s of its 1-minute budget left the generic baseline is skipped (the draft would train)."""
    from specdistill.pipeline.nightly_recipe import run_root

    calls = []
    monkeypatch.setattr("specdistill.distill.train.distill", lambda dcfg, deadline: calls.append(dcfg) or trained_result("g"))
    config = load_nightly_config(None, ["train.optim.max_minutes=3", "bench.max_minutes=null"])
    window = Window(train=[], eval=[], key="w", since=None, replayed=0)
    conversations = run_root() / "generic" / "w-conversations.jsonl"
    conversations.parent.mkdir(parents=True)
    conversations.write_text("")
    heldout = GeneratedData("/data/c/eval.jsonl", None, 1, 1)
    skipped = distill_draft(config, None, heldout, generic=True, window=window, deadline_at=time.time() + 20)
    assert isinstance(skipped, Untrained) and not calls
    assert "to train the generic baseline, under the 30 s it needs: skipped" in skipped.reason
    distill_draft(config, None, heldout, generic=True, window=window, deadline_at=time.time() + 45)
    assert len(calls) == 1  # 45 s: more than half of its minute
