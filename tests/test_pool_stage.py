"""The nightly's pool stage: tonight's answers join the pool and the night trains on the view; eval prompts
are held out; a target update starts a new pool from the old pool's prompts re-answered; retention."""

from __future__ import annotations

import json
from pathlib import Path

from specdistill.data.prompts import Prompt
from specdistill.distill.pool import AnswerPool
from specdistill.pipeline.nightly_recipe import load_nightly_config
from specdistill.pipeline.outputs import GeneratedData, PooledData, Window
from specdistill.pipeline.stages.pool import pool_answers, pool_report, pool_root
from tests.test_pool import write_night


def _window(key: str, ids: list[str], evals: list[str]) -> Window:
    prompt = [{"role": "user", "content": "hi"}]
    return Window(train=[Prompt(id=i, messages=prompt, slice="chat") for i in ids],
                  eval=[Prompt(id=i, messages=prompt, slice="chat") for i in evals], key=key, since=None, replayed=0)


def _data(night: dict, evals: list[str]) -> tuple[GeneratedData, GeneratedData]:
    eval_path = Path(night["answers"]).with_name("eval_generated.jsonl")
    eval_path.write_text("".join(json.dumps({"id": i, "prompt_ids": [1000 + int(i)], "response_ids": [1]}) + "\n"
                                 for i in evals))
    train = GeneratedData(str(night["answers"]), str(night["teacher_cache"]), answers=0, tokens=0)
    return train, GeneratedData(str(eval_path), None, answers=len(evals), tokens=len(evals))


def _no_answers(config, window, split, *, record_teacher):
    raise AssertionError("nothing to re-answer without a target update")


def test_second_night_trains_on_both_nights_and_the_report_says_so(tmp_path):
    config = load_nightly_config(None, ["pool.max_tokens=1000"])
    n1 = write_night(tmp_path, "w1", ["1", "2", "3"])
    first = pool_answers(config, _window("w1", ["1", "2", "3"], ["90"]), *_data(n1, ["90"]), "fp-target-a", answer=_no_answers)
    assert list(first.pool.nights) == ["w1"] and first.answers == 3
    n2 = write_night(tmp_path, "w2", ["3", "4"], salt=1)  # "3" replayed
    second = pool_answers(config, _window("w2", ["3", "4"], ["91"]), *_data(n2, ["91"]), "fp-target-a", answer=_no_answers)
    assert second.pool.nights == {"w2": {"answers": 2, "tokens": 6}, "w1": {"answers": 2, "tokens": 6}}
    assert second.answers == 4 and second.tokens == 12 and second.pool.duplicates == 1
    assert Path(second.path).parent.parent == pool_root() / "fp-target-a" / "views"
    report = pool_report(second)
    assert "trained on 4 answers, 12 answer tokens, from 2 night(s)" in report and "`w1`: 2 answers" in report
    assert set(AnswerPool.open(pool_root(), "fp-target-a").manifest["held_out_ids"]) == {"90", "91"}


def test_pool_disabled_trains_on_tonight_alone(tmp_path):
    config = load_nightly_config(None, ["pool.enabled=false"])
    n1 = write_night(tmp_path, "w1", ["1"])
    train, held = _data(n1, ["9"])
    pooled = pool_answers(config, _window("w1", ["1"], ["9"]), train, held, "fp-target-a", answer=_no_answers)
    assert pooled.pool is None and pooled == PooledData(train.path, train.teacher_cache, train.answers, train.tokens)
    assert not (pool_root() / "fp-target-a").exists()


def test_target_update_starts_a_new_pool_from_the_old_pools_recent_prompts(tmp_path):
    old = load_nightly_config(None, [])
    n1 = write_night(tmp_path, "w1", ["1", "2", "3"], fingerprint="fp-old")
    pool_answers(old, _window("w1", ["1", "2", "3"], ["90"]), *_data(n1, ["90"]), "fp-old", answer=_no_answers)

    asked = {}

    def fake_generate(config, window, split, *, record_teacher):  # the new target answers the old prompts
        asked.update(ids=[p.id for p in window.train], target=config.target, split=split)
        made = write_night(tmp_path, window.key, asked["ids"], fingerprint="fp-new", salt=7)
        return GeneratedData(str(made["answers"]), str(made["teacher_cache"]), answers=len(asked["ids"]),
                             tokens=3 * len(asked["ids"]))

    new = load_nightly_config(None, ["pool.reanswer_from=fp-old", "pool.reanswer_prompts=2", "pool.keep_versions=1"])
    n2 = write_night(tmp_path, "w2", ["3", "4"], fingerprint="fp-new")
    pooled = pool_answers(new, _window("w2", ["3", "4"], ["91"]), *_data(n2, ["91"]), "fp-new", answer=fake_generate)
    assert asked["split"] == "train" and len(asked["ids"]) == 2 and "3" not in asked["ids"]  # tonight's prompt is not redone
    assert pooled.pool.fingerprint == "fp-new" and pooled.pool.reanswered == 2
    keys = list(pooled.pool.nights)
    assert keys[0] == "w2" and keys[1].startswith("reanswer-fp-old") and len(keys) == 2  # no old-target answer trained on
    assert pooled.pool.retired[0]["fingerprint"] == "fp-old"  # keep_versions=1: the old pool is dropped
    assert not (pool_root() / "fp-old").exists() and not Path(n1["teacher_cache"]).exists()
    assert {"90", "91"} <= set(AnswerPool.open(pool_root(), "fp-new").manifest["held_out_ids"])  # held out carries over
    again = pool_answers(new, _window("w2", ["3", "4"], ["91"]), *_data(n2, ["91"]), "fp-new", answer=fake_generate)
    assert again.pool.reanswered == 0 and again.answers == pooled.answers  # once per new pool
