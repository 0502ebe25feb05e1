"""Logged responses as training data: the current target's own answers are used as they are (labelled by
one prefill, not decoded again), a claimed answer the target would not write is refused and answered
again, other models' responses are labelled as extra examples, bad responses are skipped and counted."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch

from specdistill.data.ingest import ingest
from specdistill.data.logstore import LogStore
from specdistill.data.prompts import Prompt, encode_chat, prompt_messages
from specdistill.distill.examples import read_done
from specdistill.modeling.models import load_model
from specdistill.ops.targets import register_target, target_history
from specdistill.pipeline.nightly_recipe import load_nightly_config
from specdistill.pipeline.outputs import Window
from specdistill.pipeline.stages.answers.harness import generate_answers
from specdistill.pipeline.stages.answers.logged import NOT_GREEDY, NOT_TOP_K, check_response, own_names
from specdistill.pipeline.stages.answers.stage import generate_responses
from specdistill.pipeline.stages.corpus import read_answers
from specdistill.pipeline.stages.pool import data_line
from specdistill.recipe import ConfigError
from tests.conftest import lively, make_tiny_llama, train_bpe

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QUESTIONS = [f"question {i}: the quick brown fox" for i in range(12)]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    tok = train_bpe(300)
    tok.chat_template = TEMPLATE
    model = lively(make_tiny_llama(vocab_size=len(tok), layers=4, seed=0, tie=False), seed=1, std=0.3).float()
    with torch.no_grad():  # a byte token alone is no text: its logit stays at 0, below the best of the others
        model.lm_head.weight[_not_text(tok)] = 0.0
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _not_text(tok) -> list[int]:
    return [i for i in range(len(tok)) if not tok.decode([i]).isprintable() or "\ufffd" in tok.decode([i])
            or i in tok.all_special_ids]


def _decode_by_rank(target, prompt_ids: list[int], n: int, rank: int) -> str:
    """n tokens, each the target's `rank`-th likeliest text token next (0 its greedy choice, -1 its least
    likely); byte and special tokens never picked."""
    ids = list(prompt_ids)
    bad = _not_text(target.tokenizer)
    with torch.no_grad():
        for _ in range(n):
            logits = target.model(torch.tensor([ids])).logits[0, -1].clone()
            logits[bad] = float("-inf") if rank >= 0 else float("inf")
            order = logits.argsort(descending=rank >= 0, stable=True)
            ids.append(int(order[rank if rank >= 0 else -rank - 1]))
    return target.tokenizer.decode(ids[len(prompt_ids):])


def _least_likely_text(target, prompt_ids: list[int], n: int = 10) -> str:
    """The target's least likely next token, n times: text it would never write."""
    return _decode_by_rank(target, prompt_ids, n, rank=-1)


def _openai(question: str, answer: str, model: str) -> dict:
    return {"request": {"model": model, "messages": [{"role": "user", "content": question}]},
            "response": {"model": model, "choices": [{"message": {"role": "assistant", "content": answer}}]}}


def _traffic(tmp_path: Path, target_dir: Path, created: float | None = None) -> tuple[str, Window, dict[str, str]]:
    """Served by `tiny-v1` (this target): its own greedy answers (6), one claimed answer it would never
    write; by `other-model`: 2 plain responses and 3 bad ones (a cut character, a control token, over the
    context; an empty one never reaches the store: ingestion quarantines it)."""
    target = load_model(str(target_dir), dtype="float32")
    tok = target.tokenizer
    own = generate_answers(target.model, tok, [Prompt(id=str(i), messages=[{"role": "user", "content": q}])
                                                for i, q in enumerate(QUESTIONS[:6])],
                           tmp_path / "served.jsonl", max_new_tokens=8, progress=False)
    records = [_openai(q, own[str(i)]["response"], "tiny-v1") for i, q in enumerate(QUESTIONS[:6])]
    claimed = _least_likely_text(target, encode_chat(tok, [{"role": "user", "content": QUESTIONS[6]}]))
    records.append(_openai(QUESTIONS[6], claimed, "tiny-v1"))
    records += [_openai(QUESTIONS[7], "the lazy dog sleeps", "other-model"), _openai(QUESTIONS[8], "def add(a, b)", "other-model")]
    records += [_openai(QUESTIONS[9], "caf\ufffd", "other-model"), _openai(QUESTIONS[10], "hi <|im_end|> there", "other-model"),
                _openai(QUESTIONS[11], "the quick brown fox " * 80, "other-model")]
    if created is not None:
        for r in records:
            r["response"]["created"] = created
    path = tmp_path / "traffic.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    url = f"sqlite:///{tmp_path / 'logs.db'}"
    with LogStore(url, eval_fraction=0.0) as store:
        ingest(path, "openai", store, progress=False)
        rows = store.sample(100, seed=0)
    prompts = [Prompt(id=str(c.id), messages=prompt_messages(c.messages), slice="chat") for c in rows]
    by_question = {p.messages[-1]["content"]: p.id for p in prompts}
    window = Window(train=prompts, eval=[], key="w1", since=None, replayed=0)
    return url, window, by_question


def _config(target_dir, url, *overrides):
    return load_nightly_config(None, [f"target={target_dir}", f"log_db={url}", "dtype=float32", "train.kind=eagle3",
                                      "generation.max_new_tokens=8", "generation.max_minutes=null",
                                      f"generation.logged.served_names.tiny-v1={target_dir}", "generation.logged.other=true",
                                      *overrides])


def test_own_logged_answers_are_not_decoded_again_and_the_report_counts_every_kind(target_dir, tmp_path, monkeypatch):
    import specdistill.pipeline.stages.answers.harness as harness

    url, window, ids = _traffic(tmp_path, target_dir)
    decoded: list[str] = []
    real = harness.decode_batch
    monkeypatch.setattr(harness, "decode_batch", lambda model, prompts, **kw: (decoded.extend(  # not the thread probe's
        "x" * len(prompts) * (kw["max_new_tokens"] != harness.THREAD_PROBE_TOKENS)), real(model, prompts, **kw))[1])
    data = generate_responses(_config(target_dir, url), window, "train", record_teacher=True)

    records = read_done(Path(data.path))
    own_ids = {ids[q] for q in QUESTIONS[:6]}
    assert {i for i, r in records.items() if r.get("source") == "own"} == own_ids  # used as they are
    assert {i for i, r in records.items() if r.get("source") == "other"} == {ids[QUESTIONS[7]] + "~log", ids[QUESTIONS[8]] + "~log"}
    decoded_ids = {i for i, r in records.items() if not r.get("source")}
    assert decoded_ids == {p.id for p in window.train} - own_ids  # the refused claim and every other prompt
    assert ids[QUESTIONS[6]] in decoded_ids
    # the decode loop saw exactly those prompts
    assert len(decoded) == len(decoded_ids)
    logged = data.logged
    assert (logged.own, logged.other, logged.refused) == (6, 2, 1)
    assert logged.skipped == {"cut mid-character": 1, "control tokens": 1, "over the context": 1}
    assert data.answers == len(window.train)  # every prompt answered once: decoded or logged
    # other models' text trains the head but is not the target's: not in the suffix corpus
    assert {r["id"] for r in read_answers(data.path)} == own_ids | decoded_ids
    line = data_line(data)
    assert "6 logged answers of this target used as they are" in line and "2 other models' responses labelled" in line
    assert "1 claimed by this target refused as not its text" in line and "skipped:" in line

    # a rerun labels and decodes nothing again
    decoded.clear()
    again = generate_responses(_config(target_dir, url), window, "train", record_teacher=True)
    assert decoded == [] and (again.logged.own, again.logged.other) == (6, 2) and again.path == data.path


def _runner_up_text(target, prompt_ids: list[int], n: int = 8) -> str:
    """The target's second most likely next token, n times: text it samples, never its greedy answer."""
    return _decode_by_rank(target, prompt_ids, n, rank=1)


def test_claimed_answers_are_held_to_the_text_the_target_writes_at_the_requests_temperature(target_dir, tmp_path):
    """Random text and boilerplate under the target's served name passed the likelihood floor (sampled at
    temperature 1), were trained on as `source: own` and went into the suffix corpus."""
    target = load_model(str(target_dir), dtype="float32")
    tok = target.tokenizer
    prompts = [Prompt(id=str(i), messages=[{"role": "user", "content": q}]) for i, q in enumerate(QUESTIONS)]
    greedy = generate_answers(target.model, tok, prompts[:6], tmp_path / "g.jsonl", max_new_tokens=8, progress=False)
    runner_up = {i: _runner_up_text(target, encode_chat(tok, prompts[i].messages)) for i in range(6, 10)}
    claims = [(i, greedy[str(i)]["response"], 0) for i in range(4)]  # greedy requests, greedy answers: its own
    claims += [(i, greedy[str(i)]["response"], 1.0) for i in (4, 5)]  # sampled requests, its greedy answers: its own
    claims += [(i, runner_up[i], 1.0) for i in (6, 7)]  # sampled requests, its runner-up tokens: text it samples
    claims += [(i, runner_up[i], 0) for i in (8, 9)]  # greedy requests, answered by text it samples: not its answers
    claims += [(10, "#6x&z32380%z3q017 qq!! zz", None)]  # noise, no temperature logged: as greedy (the default)
    claims += [(11, _least_likely_text(target, encode_chat(tok, prompts[11].messages)), 0.7)]  # noise, sampled
    records = []
    for i, text, temperature in claims:
        records.append(_openai(QUESTIONS[i], text, "tiny-v1"))
        if temperature is not None:
            records[-1]["request"]["temperature"] = temperature
    path = tmp_path / "traffic.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    url = f"sqlite:///{tmp_path / 'logs.db'}"
    with LogStore(url, eval_fraction=0.0) as store:
        ingest(path, "openai", store, progress=False)
        rows = store.sample(100, seed=0)
    assert sorted(c.request_temperature for c in rows if c.request_temperature is not None) == [0] * 6 + [0.7] + [1] * 4
    window_prompts = [Prompt(id=str(c.id), messages=prompt_messages(c.messages), slice="chat") for c in rows]
    ids = {p.messages[-1]["content"]: p.id for p in window_prompts}
    window = Window(train=window_prompts, eval=[], key="w1", since=None, replayed=0)
    data = generate_responses(_config(target_dir, url), window, "train", record_teacher=True)

    records = read_done(Path(data.path))
    assert {i for i, r in records.items() if r.get("source") == "own"} == {ids[q] for q in QUESTIONS[:8]}
    assert data.logged.refused == 4 and data.logged.skipped == {}
    assert data.logged.refused_why == {NOT_GREEDY: 3, NOT_TOP_K: 1}
    # what was refused is neither trained on as its own nor in the suffix corpus: the prompt was answered again
    corpus = {r["id"]: r["response_ids"] for r in read_answers(data.path)}
    for i in range(8, 12):
        claimed = encode_chat(tok, [{"role": "user", "content": QUESTIONS[i]}, {"role": "assistant", "content": claims[i][1]}])
        record = records[ids[QUESTIONS[i]]]
        assert record.get("source") is None and record["prompt_ids"] + corpus[ids[QUESTIONS[i]]] != claimed
    assert "4 claimed by this target refused as not its text" in data_line(data)


def records_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_other_models_responses_are_left_alone_when_switched_off(target_dir, tmp_path):
    url, window, ids = _traffic(tmp_path, target_dir)
    data = generate_responses(_config(target_dir, url, "generation.logged.other=false"), window, "train", record_teacher=True)
    records = read_done(Path(data.path))
    assert not any(r.get("source") == "other" for r in records.values()) and data.logged.own == 6


def test_a_served_name_mapped_to_no_registered_target_is_a_config_error_naming_the_key(target_dir):
    with pytest.raises(ConfigError, match=r"generation\.logged\.served_names\.acme: '/no/such/model' is not a registered target"):
        own_names({"acme": "/no/such/model"}, str(target_dir), "fp-current")


def test_target_register_records_served_names_and_they_name_that_version_only(target_dir, tmp_path):
    first = register_target("old", fingerprint="fp-old", model_dir=tmp_path / "old", served_names=["acme-v1"])
    assert first.served_names == ("acme-v1",)
    register_target("new", fingerprint="fp-new", model_dir=tmp_path / "new")
    again = register_target("new", fingerprint="fp-new", model_dir=tmp_path / "new", served_names=["acme-v2", "acme-v2"])
    assert again.served_names == ("acme-v2",) and [v.fingerprint for v in target_history()] == ["fp-old", "fp-new"]
    assert set(own_names({}, "new", "fp-new")) == {"acme-v2"}
    assert set(own_names({"acme-old": "old", "alias": "fp-new"}, "new", "fp-new")) == {"acme-v2", "alias"}  # acme-old: another version
    with pytest.raises(ValueError, match="1 to 256 characters"):
        register_target("new", fingerprint="fp-new", model_dir=tmp_path / "new", served_names=[" "])


def test_answers_logged_under_a_name_before_it_was_registered_for_this_version_are_not_its_own(target_dir, tmp_path):
    """One served name, two versions: the old version's logs counted as the new target's own answers."""
    config = lambda url: load_nightly_config(None, [  # noqa: E731
        f"target={target_dir}", f"log_db={url}", "dtype=float32", "train.kind=eagle3", "generation.max_new_tokens=8",
        "generation.max_minutes=null", "generation.logged.other=true"])
    url, window, ids = _traffic(tmp_path / "before", target_dir, created=time.time() - 3600)
    register_target("old", fingerprint="fp-old", model_dir=tmp_path / "old", served_names=["tiny-v1"])
    register_target(str(target_dir), served_names=["tiny-v1"])  # the name moves to this version now
    data = generate_responses(config(url), window, "train", record_teacher=True)
    records = read_done(Path(data.path))
    assert data.logged.own == 0 and not any(r.get("source") == "own" for r in records.values())
    assert ids[QUESTIONS[0]] + "~log" in records  # the old version's answer: another model's text
    url, window, ids = _traffic(tmp_path / "after", target_dir, created=time.time() + 60)
    data = generate_responses(config(url), dataclasses.replace(window, key="w2"), "train", record_teacher=True)
    assert data.logged.own == 6  # logged since the registration: this version's own


def test_the_cli_records_served_names(target_dir):
    from specdistill.cli import main

    assert main(["target", "register", str(target_dir), "--no-event", "--served-name", "tiny-v1"]) == 0
    assert target_history()[-1].served_names == ("tiny-v1",)


def test_bad_responses_are_skipped_with_their_reason(target_dir):
    tok = load_model(str(target_dir), dtype="float32").tokenizer
    prompt = [{"role": "user", "content": "hello"}]
    assert check_response(tok, prompt, "", 256, 64) == (None, "empty")
    assert check_response(tok, prompt, "caf\ufffd", 256, 64) == (None, "cut mid-character")
    assert check_response(tok, prompt, "a <|im_start|> b", 256, 64) == (None, "control tokens")
    assert check_response(tok, prompt, "fox " * 200, 256, 64) == (None, "over the context")
    example, reason = check_response(tok, prompt, "the quick brown fox " * 10, 256, 5)
    assert reason is None and sum(example.assistant_mask) == 5  # a long response is cut to max_tokens
    assert example.input_ids[: len(encode_chat(tok, prompt))] == encode_chat(tok, prompt)


def test_labelling_stops_at_its_share_of_the_budget(target_dir, tmp_path):
    url, window, _ = _traffic(tmp_path, target_dir)
    config = _config(target_dir, url, "generation.logged.max_share=0.0", "generation.max_minutes=5")
    started = time.time()
    data = generate_responses(config, window, "train", record_teacher=True, deadline_at=started + 300)
    assert data.logged.own == 0 and data.logged.other == 0 and data.logged.not_labelled == 9
    assert data.answers == len(window.train)  # everything was decoded instead
