"""The answer pool: views newest first and deduplicated, held-out prompts never in, token budget,
disk cap (oldest first), bad shards skipped with a warning, one pool per target version."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdistill.distill.features import FeatureCache
from specdistill.distill.pool import AnswerPool, PoolWarning, pools, retire_pools
from specdistill.distill.shards import intact_keys, load_shards
from specdistill.distill.teacher import TeacherCache, check_entry

FP = "fp-target-a"


def write_night(root: Path, key: str, ids: list[str], *, fingerprint: str = FP, answer_len: int = 3,
                salt: int = 0, per_shard: int = 2) -> dict:
    """A night as the answer stage leaves it: answers JSONL, teacher cache, feature cache (tiny tensors)."""
    d = root / "data" / key
    d.mkdir(parents=True)
    teacher = TeacherCache.create(d / "teacher_cache", fingerprint=fingerprint, k=2, temperature=1.0, vocab="full",
                                  data=key)
    features = FeatureCache.create(d / "features", fingerprint=fingerprint, layers=[0, 1, 2], data=key, prompt_context=0)
    with open(d / "train_generated.jsonl", "w") as f:
        for rid in ids:
            prompt = [int(rid) % 50 + 3, 7]
            answer = [salt + 10 + j for j in range(answer_len)]
            f.write(json.dumps({"id": rid, "prompt": [{"role": "user", "content": f"p{rid}"}], "prompt_ids": prompt,
                                "response_ids": answer, "response": "x"}) + "\n")
    for start in range(0, len(ids), per_shard):
        rows, feats = {}, {}
        for rid in ids[start : start + per_shard]:
            seq = torch.tensor([int(rid) % 50 + 3, 7] + [salt + 10 + j for j in range(answer_len)], dtype=torch.int32)
            rows[rid] = {"input_ids": seq, "logprobs": torch.full((answer_len, 2), -0.7 - salt),
                         "indices": torch.zeros(answer_len, 2, dtype=torch.int32), "residual": torch.zeros(answer_len)}
            feats[rid] = {"input_ids": seq, "start": torch.tensor(0), "features": torch.zeros(len(seq) - 1, 3)}
        teacher.write_shard(f"{start:04d}", rows)
        features.write_shard(f"{start:04d}", feats)
    return {"key": key, "answers": d / "train_generated.jsonl", "teacher_cache": d / "teacher_cache",
            "features": d / "features"}


def add(pool: AnswerPool, night: dict):
    return pool.add_night(night["key"], night["answers"], night["teacher_cache"], night["features"])


def view_ids(view) -> list[str]:
    return [json.loads(line)["id"] for line in Path(view.path).read_text().splitlines()]


def test_view_trains_on_every_night_newest_first_and_once_per_prompt(tmp_path):
    pool = AnswerPool.open(tmp_path / "pool", FP)
    add(pool, write_night(tmp_path, "night1", ["1", "2", "3", "4"], salt=0))
    add(pool, write_night(tmp_path, "night2", ["3", "5", "6"], salt=1))  # "3" replayed from night 1
    view = pool.view(include="night2")
    assert view_ids(view)[:3] == ["3", "5", "6"] and sorted(view_ids(view)[3:]) == ["1", "2", "4"]
    assert view.answers == 6 and view.tokens == 18 and view.duplicates == 1
    assert list(view.nights) == ["night2", "night1"]
    assert view.nights == {"night2": {"answers": 3, "tokens": 9}, "night1": {"answers": 3, "tokens": 9}}
    rows = load_shards(Path(view.teacher_cache))  # the trainer's read: the replayed prompt has tonight's answer
    assert rows["3"]["input_ids"].tolist()[2:] == [11, 12, 13] and set(rows) == {"1", "2", "3", "4", "5", "6"}
    assert set(FeatureCache(view.features, {}).ids()) == set(rows)
    assert TeacherCache.open(view.teacher_cache, fingerprint=FP).meta["k"] == 2
    FeatureCache.open(view.features, fingerprint=FP, layers=[0, 1, 2], prompt_context=0)
    assert pool.view(include="night2").path == view.path  # same content: the same view, reused


def test_token_budget_cuts_older_nights_never_tonights(tmp_path):
    pool = AnswerPool.open(tmp_path / "pool", FP)
    add(pool, write_night(tmp_path, "old", ["1", "2", "3"]))
    add(pool, write_night(tmp_path, "new", ["4", "5", "6", "7"]))
    view = pool.view(include="new", max_tokens=15)  # tonight alone is 12 tokens: one older answer fits
    assert view_ids(view) == ["4", "5", "6", "7", "1"] and view.over_budget == 2
    assert pool.view(include="new", max_tokens=3).answers == 4  # over budget alone: tonight still trains


def test_held_out_prompts_never_enter_a_view(tmp_path):
    pool = AnswerPool.open(tmp_path / "pool", FP)
    add(pool, write_night(tmp_path, "n1", ["1", "2", "3"]))
    add(pool, write_night(tmp_path, "n2", ["4", "5"]))
    pool.hold_out([{"id": "2", "prompt_ids": [0]}, {"id": "99", "prompt_ids": [5 + 3, 7]}])  # "5" by its tokens
    view = pool.view(include="n2")
    assert set(view_ids(view)) == {"1", "3", "4"} and view.held_out == 2
    assert {r["id"] for r in pool.recent_prompts(10)} == {"1", "3", "4"}
    reopened = AnswerPool.open(tmp_path / "pool", FP)  # recorded in the manifest, across nights
    assert "2" in reopened.manifest["held_out_ids"]


def test_a_rerun_of_an_older_night_trains_on_its_own_answers_teacher_rows(tmp_path):
    """Prompt 3 was answered on both nights, differently (bf16 greedy answers depend on the batch they
    were decoded in). Rerunning night 1 after night 2 takes night 1's answer, so it must read night
    1's teacher rows: the trainer refused the view ("teacher cache entry '3' was written for other
    token ids") when the newest night's shard was always read last."""
    pool = AnswerPool.open(tmp_path / "pool", FP)
    add(pool, write_night(tmp_path, "night1", ["1", "2", "3", "4"], salt=0))
    add(pool, write_night(tmp_path, "night2", ["3", "5", "6"], salt=1))
    view = pool.view(include="night1")  # a rerun of the older window
    records = {json.loads(line)["id"]: json.loads(line) for line in Path(view.path).read_text().splitlines()}
    assert records["3"]["response_ids"] == [10, 11, 12]  # night 1's answer
    rows = load_shards(Path(view.teacher_cache))
    for rid, rec in records.items():  # the trainer's check, for every answer in the view
        check_entry(rows[rid], rid, rec["prompt_ids"] + rec["response_ids"], len(rec["response_ids"]))
    assert FeatureCache(view.features, {}).load_all()["3"]["input_ids"].tolist() == [6, 7, 10, 11, 12]


def test_an_older_answer_never_stands_in_for_a_newer_one_over_the_budget(tmp_path):
    pool = AnswerPool.open(tmp_path / "pool", FP)
    add(pool, write_night(tmp_path, "n1", ["1"], answer_len=2))
    add(pool, write_night(tmp_path, "n2", ["1"], answer_len=9, salt=1))
    add(pool, write_night(tmp_path, "n3", ["2"], answer_len=2, salt=2))
    view = pool.view(include="n3", max_tokens=6)  # n2's answer to "1" does not fit; n1's older one would
    assert view_ids(view) == ["2"] and view.over_budget == 1


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(nights=st.lists(st.lists(st.integers(1, 30), min_size=1, max_size=6, unique=True), min_size=1, max_size=4),
       held=st.sets(st.integers(1, 30), max_size=8), budget=st.one_of(st.none(), st.integers(0, 40)),
       rerun=st.integers(0, 3))
def test_view_invariants(tmp_path_factory, nights, held, budget, rerun):
    root = tmp_path_factory.mktemp("pool")
    pool = AnswerPool.open(root / "pool", FP)
    for i, ids in enumerate(nights):  # every night answers differently (salt): a prompt's answers differ by night
        add(pool, write_night(root, f"n{i}", [str(x) for x in ids], salt=i))
    pool.hold_out({"id": str(h), "prompt_ids": [-1]} for h in held)
    tonight = rerun % len(nights)  # the newest night, or a rerun of an older one
    view = pool.view(include=f"n{tonight}", max_tokens=budget)
    ids = view_ids(view)
    assert len(ids) == len(set(ids)) and not set(ids) & {str(h) for h in held}
    assert {str(x) for x in nights[tonight]} - {str(h) for h in held} <= set(ids)  # tonight's answers always in
    if budget is not None:
        assert view.tokens <= max(budget, view.nights.get(f"n{tonight}", {"tokens": 0})["tokens"])
    rows = load_shards(Path(view.teacher_cache))
    for line in Path(view.path).read_text().splitlines():  # every answer reads its own teacher rows
        rec = json.loads(line)
        assert rows[rec["id"]]["input_ids"].tolist() == rec["prompt_ids"] + rec["response_ids"]


def test_disk_cap_evicts_the_oldest_nights_first(tmp_path):
    pool = AnswerPool.open(tmp_path / "pool", FP)
    made = [write_night(tmp_path, f"n{i}", [str(10 * i + j) for j in range(4)]) for i in range(3)]
    for night in made:
        add(pool, night)
    per_night = pool.nights[0].disk_bytes()
    left = pool.enforce_disk_cap((per_night * 1.5) / 2**30, keep=["n2"])
    assert [e["key"] for e in left] == ["n0", "n1"]  # oldest first, until it fits; tonight stays
    assert not made[0]["teacher_cache"].exists() and not made[0]["answers"].exists()
    assert made[2]["teacher_cache"].exists() and pool.disk_bytes() <= per_night * 1.5
    assert pool.view(include="n2").nights.keys() == {"n2"}
    assert pool.enforce_disk_cap(1e-9, keep=["n2"]) == []  # only tonight left: kept even over the cap
    assert [e["key"] for e in AnswerPool.open(tmp_path / "pool", FP).manifest["evictions"]] == ["n0", "n1"]


def test_truncated_shard_is_skipped_with_a_warning_naming_it(tmp_path):
    pool = AnswerPool.open(tmp_path / "pool", FP)
    old = write_night(tmp_path, "old", ["1", "2", "3", "4"])
    add(pool, old)
    add(pool, write_night(tmp_path, "new", ["5", "6"]))
    shard = sorted(old["teacher_cache"].glob("shard-*.safetensors"))[0]  # holds "1" and "2"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 5])
    assert intact_keys(shard) is None
    with pytest.warns(PoolWarning, match=str(shard)):
        view = pool.view(include="new")
    assert set(view_ids(view)) == {"3", "4", "5", "6"}
    assert set(load_shards(Path(view.teacher_cache))) == {"3", "4", "5", "6"}  # never linked, never read
    assert any(str(shard) in s for s in view.skipped)


def test_night_of_another_target_is_skipped_with_a_warning(tmp_path):
    pool = AnswerPool.open(tmp_path / "pool", FP)
    stale = write_night(tmp_path, "stale", ["1", "2"])
    add(pool, stale)
    add(pool, write_night(tmp_path, "new", ["3"]))
    meta = stale["teacher_cache"] / "teacher_cache.json"  # rewritten by another target's run
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "fingerprint": "fp-other"}))
    with pytest.warns(PoolWarning, match="stale.*fp-other"):
        view = pool.view(include="new")
    assert view_ids(view) == ["3"]
    other = write_night(tmp_path, "foreign", ["4"], fingerprint="fp-other")
    with pytest.raises(ValueError, match="fp-other"):
        add(pool, other)


def test_a_target_update_starts_a_new_pool_and_retention_drops_old_ones(tmp_path):
    root = tmp_path / "pool"
    a = AnswerPool.open(root, "fp-a")
    add(a, write_night(tmp_path, "a1", ["1", "2"], fingerprint="fp-a"))
    b = AnswerPool.open(root, "fp-b")
    assert b.nights == [] and b.dir != a.dir
    assert [r["id"] for r in a.recent_prompts(1)] == ["1"]
    c = AnswerPool.open(root, "fp-c")
    add(c, write_night(tmp_path, "c1", ["3"], fingerprint="fp-c"))
    dropped = retire_pools(root, keep_versions=2, current="fp-c")
    assert [d["fingerprint"] for d in dropped] == ["fp-a"]  # b was touched after a: it is kept
    assert {p.fingerprint for p in pools(root)} == {"fp-b", "fp-c"}
    assert not (tmp_path / "data" / "a1" / "teacher_cache").exists()


def test_reanswered_night_goes_before_tonight(tmp_path):
    pool = AnswerPool.open(tmp_path / "pool", FP)
    add(pool, write_night(tmp_path, "tonight", ["1"]))
    re = write_night(tmp_path, "reanswer", ["1", "2"], salt=5)
    pool.add_night(re["key"], re["answers"], re["teacher_cache"], re["features"], before="tonight")
    assert [n.key for n in pool.nights] == ["reanswer", "tonight"]
    rows = load_shards(Path(pool.view(include="tonight").teacher_cache))
    assert rows["1"]["input_ids"].tolist()[2:] == [10, 11, 12]  # tonight's answer wins for the shared prompt
