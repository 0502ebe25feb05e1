"""Target-generated data: chat-template masks, batched left-padded generation, resume, recorded teacher and features."""

from __future__ import annotations

import json

import pytest
import torch

from specdistill.data.prompts import Prompt, encode_chat
from specdistill.distill.examples import encode_conversation, encode_generated, read_done
from specdistill.distill.features import FeatureCache, build_feature_cache, entry_features, feature_start
from specdistill.distill.teacher import TeacherCache
from specdistill.pipeline.stages.answers.harness import generate_answers
from tests.conftest import make_tiny_llama

pytestmark = pytest.mark.e2e  # the `tok` fixture converts the real demo target on a fresh machine


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from specdistill.modeling.models import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("demo"))


@pytest.fixture(scope="module")
def tiny_target(tok):
    return make_tiny_llama(vocab_size=len(tok), hidden=32, layers=2, seed=3, tie=False)


def _prompts(n):
    texts = ["Hi.", "What is the capital of France?", "Write a haiku about snow, please.", "2+2?", "Name a dog breed.",
             "Explain recursion in one sentence."]
    return [Prompt(id=f"q{i}", messages=[{"role": "user", "content": texts[i % len(texts)] + " " * (i // len(texts))}]) for i in range(n)]


def test_assistant_mask_marks_exactly_the_assistant_turns(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello there!"}, {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Goodbye."}]
    ex = encode_conversation(tok, msgs)
    marked = [t for t, m in zip(ex.input_ids, ex.assistant_mask) if m]
    eos = tok.eos_token_id
    assert tok.decode(marked) == "Hello there!" + tok.eos_token + "Goodbye." + tok.eos_token
    assert marked.count(eos) == 2
    assert ex.input_ids == tok.apply_chat_template(msgs, tokenize=True)["input_ids"][: len(ex.input_ids)]
    with pytest.raises(ValueError, match="no assistant turn"):
        encode_conversation(tok, msgs[:2])


def test_a_conversation_cut_at_max_len_is_the_whole_ones_prefix_and_renders_no_later_turn(tok, monkeypatch):
    msgs = [{"role": "user", "content": "Tell me a long story."}, {"role": "assistant", "content": "Once upon a time " * 20}]
    msgs += [{"role": "user", "content": "More."}, {"role": "assistant", "content": "The end."}] * 30
    whole = encode_conversation(tok, msgs)
    rendered = []
    real = type(tok).apply_chat_template
    monkeypatch.setattr(type(tok), "apply_chat_template", lambda self, m, **kw: rendered.append(len(m)) or real(self, m, **kw))
    cut = encode_conversation(tok, msgs, max_len=64)
    assert (cut.input_ids, cut.assistant_mask) == (whole.input_ids[:64], whole.assistant_mask[:64])
    assert max(rendered) <= 2  # the first answer passes 64 tokens: the 60 turns after it are never rendered


def test_batched_left_padded_generation_matches_one_by_one(tok, tiny_target, tmp_path):
    prompts = _prompts(4)
    batched = generate_answers(tiny_target, tok, prompts, tmp_path / "b.jsonl", batch_size=4, max_new_tokens=8, progress=False)
    single = generate_answers(tiny_target, tok, prompts, tmp_path / "s.jsonl", batch_size=1, max_new_tokens=8, progress=False)
    lengths = {len(encode_chat(tok, p.messages)) for p in prompts}
    assert len(lengths) > 1  # the batch really was padded
    for p in prompts:
        assert batched[p.id]["response_ids"] == single[p.id]["response_ids"]


def test_generation_resumes_without_redoing_answers(tok, tiny_target, tmp_path):
    out = tmp_path / "a.jsonl"
    generate_answers(tiny_target, tok, _prompts(3), out, batch_size=2, max_new_tokens=6, progress=False)
    with open(out, "a") as f:
        f.write('{"id": "q9", "prompt": [')  # a write torn by a kill
    first = {json.loads(line)["id"]: line for line in out.read_text().splitlines()[:3]}
    done = generate_answers(tiny_target, tok, _prompts(5), out, batch_size=2, max_new_tokens=6, progress=False)
    lines = out.read_text().splitlines()
    assert len(lines) == 5 and len(done) == 5
    assert {json.loads(line)["id"]: line for line in lines[:3]} == first  # the old answers were kept, not redone
    assert sorted(read_done(out)) == [f"q{i}" for i in range(5)]


def test_recorded_teacher_is_the_targets_distribution_at_each_answer_token(tok, tiny_target, tmp_path):
    cache = TeacherCache.create(tmp_path / "c", fingerprint="f" * 16, k=8, temperature=1.0, vocab="full", data="gen")
    done = generate_answers(tiny_target, tok, _prompts(3), tmp_path / "g.jsonl", batch_size=3, max_new_tokens=6,
                            teacher_cache=cache, progress=False)
    rows = TeacherCache.open(tmp_path / "c", fingerprint="f" * 16).load_all()
    for ex_id, rec in done.items():
        ex = encode_generated(tok, rec)
        entry = rows[ex_id]
        assert entry["indices"][:, 0].tolist() == rec["response_ids"]  # greedy: the top-1 is what was generated
        with torch.no_grad():
            logits = tiny_target(input_ids=torch.tensor([ex.input_ids])).logits[0]
        pos = [t - 1 for t in range(1, len(ex.input_ids)) if ex.assistant_mask[t]]
        want = torch.log_softmax(logits[pos], -1).topk(8, -1)
        assert torch.allclose(entry["logprobs"], want.values, atol=1e-4)
        assert torch.allclose(entry["residual"], 1 - want.values.exp().sum(-1), atol=1e-5)


def test_recording_refuses_sampled_generation(tok, tiny_target, tmp_path):
    cache = TeacherCache.create(tmp_path / "c", fingerprint="f" * 16, k=8, temperature=1.0, vocab="full")
    with pytest.raises(ValueError, match="greedy"):
        generate_answers(tiny_target, tok, _prompts(1), tmp_path / "x.jsonl", temperature=0.8, teacher_cache=cache)


def test_sampled_generation_is_reproducible(tok, tiny_target, tmp_path):
    a = generate_answers(tiny_target, tok, _prompts(2), tmp_path / "a.jsonl", temperature=1.0, seed=5, max_new_tokens=6,
                         progress=False)
    b = generate_answers(tiny_target, tok, _prompts(2), tmp_path / "b.jsonl", temperature=1.0, seed=5, max_new_tokens=6,
                         progress=False)
    assert [a[k]["response_ids"] for k in sorted(a)] == [b[k]["response_ids"] for k in sorted(b)]


@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize("context", [0, 2, None])
def test_answer_pass_records_the_features_a_teacher_forced_pass_would(tok, tiny_target, tmp_path, context, lean):
    """The feature layers' inputs seen by prefill and decode steps are the ones the separate feature
    pass records over the finished answers (fp32), at the same stored positions; lean or not."""
    if not lean:
        tiny_target.config._attn_implementation = "eager"  # transformers' forward and the hooks record the steps
    try:
        cache = FeatureCache.create(tmp_path / "f", fingerprint="fp", layers=[0, 1, 1], data="answers", prompt_context=context)
        done = generate_answers(tiny_target, tok, _prompts(5), tmp_path / "g.jsonl", batch_size=3, max_new_tokens=7,
                                feature_cache=cache, progress=False, decode_attention=lean)
    finally:
        tiny_target.config._attn_implementation = "sdpa"
    examples = [encode_generated(tok, rec) for rec in done.values()]
    reference = build_feature_cache(tiny_target, examples, tmp_path / "ref", fingerprint="fp", layers=[0, 1, 1],
                                    prompt_context=context, progress=False).load_all()
    rows = FeatureCache.open(tmp_path / "f", fingerprint="fp", layers=[0, 1, 1], prompt_context=context).load_all()
    assert sorted(rows) == sorted(done)
    for ex in examples:
        start = feature_start(ex.assistant_mask, context)
        got = entry_features(rows[ex.id], ex.id, ex.input_ids, start)
        want = entry_features(reference[ex.id], ex.id, ex.input_ids, start)
        assert got.shape == want.shape == (len(ex.input_ids) - 1 - start, 3 * 32)
        torch.testing.assert_close(got.float(), want.float(), atol=0.02, rtol=0.02)  # both stored in bf16


def test_a_truncated_example_reads_the_prefix_of_its_answer_pass_features(tok, tiny_target, tmp_path):
    cache = FeatureCache.create(tmp_path / "f", fingerprint="fp", layers=[0, 1], data="answers", prompt_context=0)
    done = generate_answers(tiny_target, tok, _prompts(1), tmp_path / "g.jsonl", max_new_tokens=7, feature_cache=cache,
                            progress=False)
    rec = next(iter(done.values()))
    full, cut = encode_generated(tok, rec), encode_generated(tok, rec, max_len=len(rec["prompt_ids"]) + 2)
    entry = cache.load_all()[rec["id"]]
    start = feature_start(cut.assistant_mask, 0)
    assert entry_features(entry, cut.id, cut.input_ids, start).shape[0] == len(cut.input_ids) - 1 - start
    torch.testing.assert_close(entry_features(entry, cut.id, cut.input_ids, start),
                               entry_features(entry, full.id, full.input_ids, start)[: len(cut.input_ids) - 1 - start])
    other = list(cut.input_ids)
    other[-1] += 1
    with pytest.raises(ValueError, match="other token ids"):
        entry_features(entry, cut.id, other, start)


def test_feature_pass_extends_the_answer_pass_cache_with_what_it_lacks(tok, tiny_target, tmp_path):
    cache = FeatureCache.create(tmp_path / "f", fingerprint="fp", layers=[0, 1], data="answers", prompt_context=0)
    done = generate_answers(tiny_target, tok, _prompts(3), tmp_path / "g.jsonl", max_new_tokens=5, feature_cache=cache,
                            progress=False)
    shards = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "f").glob("shard-*")}
    more = generate_answers(tiny_target, tok, _prompts(5), tmp_path / "g.jsonl", max_new_tokens=5, progress=False)
    examples = [encode_generated(tok, rec) for rec in more.values()]
    extended = build_feature_cache(tiny_target, examples, tmp_path / "f", fingerprint="fp", layers=[0, 1],
                                   prompt_context=0, progress=False, extend=True)
    assert extended.ids() == set(more) and len(more) == len(done) + 2
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "f").glob("shard-*") if p.name in shards} == shards
    with pytest.raises(ValueError, match="layers"):  # extending is for the same layers only
        build_feature_cache(tiny_target, examples, tmp_path / "f", fingerprint="fp", layers=[0, 0], prompt_context=0,
                            progress=False, extend=True)


def test_a_time_budget_keeps_the_answers_so_far_and_a_later_run_resumes(tok, tiny_target, tmp_path, monkeypatch):
    from specdistill.budget import Deadline
    from specdistill.pipeline.stages.answers import harness

    prompts, out = _prompts(12), tmp_path / "answers.jsonl"
    monkeypatch.setattr(harness, "SORT_CHUNK", 1)  # sorted by length within each batch only
    clock = iter([False, False, True])  # two batches of 4 fit into the budget, the third does not start
    budget = Deadline(0.0)
    monkeypatch.setattr(Deadline, "expired", lambda self, now=None: next(clock))
    monkeypatch.setattr(Deadline, "remaining", lambda self, now=None: 1e9)  # a batch always fits while it lasts
    cut = generate_answers(tiny_target, tok, prompts, out, batch_size=4, max_new_tokens=3, progress=False, deadline=budget)
    assert set(cut) == {p.id for p in prompts[:8]}  # the first prompts in the given order, not the shortest
    assert len(read_done(out)) == 8
    monkeypatch.setattr(Deadline, "expired", lambda self, now=None: False)
    full = generate_answers(tiny_target, tok, prompts, out, batch_size=4, max_new_tokens=3, progress=False, deadline=budget)
    assert set(full) == {p.id for p in prompts} and [full[p.id] for p in prompts[:8]] == [cut[p.id] for p in prompts[:8]]
    assert Deadline(None).expired() is False


def test_no_batch_starts_that_would_end_past_the_deadline(tok, tiny_target, tmp_path, monkeypatch):
    """A batch of 128 answers takes ~40 s on 2 cores: starting one a second before the deadline overran it."""
    from specdistill.budget import Deadline
    from specdistill.pipeline.stages.answers import harness

    ticks = iter(range(0, 1000, 5))  # every batch takes 5 s by this clock
    monkeypatch.setattr(harness.time, "monotonic", lambda: next(ticks))
    for left, answered in ((4.0, 4), (6.0, 12)):  # 4 s left after a 5 s batch: the next one does not start
        monkeypatch.setattr(Deadline, "remaining", lambda self, now=None, left=left: left)
        done = generate_answers(tiny_target, tok, _prompts(12), tmp_path / f"{left}.jsonl", batch_size=4,
                                max_new_tokens=3, progress=False, deadline=Deadline(1e12))
        assert len(done) == answered
