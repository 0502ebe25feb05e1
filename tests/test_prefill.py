"""Labelling existing text by one prefill: the same teacher rows and features the answer pass records
while decoding, each response's likelihood, batches by length, and the time budget."""

from __future__ import annotations

import time

import pytest
import torch

from specdistill.budget import Deadline
from specdistill.distill.examples import Example
from specdistill.distill.features import FeatureCache, entry_features, feature_start
from specdistill.distill.prefill import label_by_prefill, length_batches
from specdistill.distill.teacher import TeacherCache
from specdistill.pipeline.stages.answers.harness import generate_answers
from tests.conftest import make_tiny_llama


class IdsTokenizer:
    """Prompts are raw ids (no chat template): `generate_answers` needs only these members."""

    chat_template = None
    pad_token_id = 0
    eos_token_id = 1

    def __call__(self, text):
        return {"input_ids": [int(t) for t in text.split()]}

    def decode(self, ids, **_):
        return " ".join(str(i) for i in ids)


def _prompts(n: int):
    from specdistill.data.prompts import Prompt

    g = torch.Generator().manual_seed(1)
    return [Prompt(id=f"p{i}", messages=[{"role": "user", "content": " ".join(
        str(int(t)) for t in torch.randint(2, 96, (3 + 2 * i,), generator=g))}]) for i in range(n)]


def _caches(directory, k=8, layers=(0, 1, 1), context=0):
    teacher = TeacherCache.create(directory / "t", fingerprint="fp", k=k, temperature=1.0, vocab="full", data="x")
    features = FeatureCache.create(directory / "f", fingerprint="fp", layers=list(layers), data="x", prompt_context=context)
    return teacher, features


def test_a_prefill_labels_what_the_answer_pass_recorded_while_decoding(tmp_path):
    """The target's own greedy answers, labelled again by one prefill, get the teacher rows and features the
    decode pass recorded (fp32, up to batch-shape rounding), a greedy share of 1 and the highest likelihood."""
    target = make_tiny_llama(vocab_size=96, hidden=32, layers=2, seed=3, tie=False).eval()
    tok = IdsTokenizer()
    decoded_teacher, decoded_features = _caches(tmp_path / "decoded")
    done = generate_answers(target, tok, _prompts(5), tmp_path / "a.jsonl", batch_size=2, max_new_tokens=6,
                            teacher_cache=decoded_teacher, feature_cache=decoded_features, progress=False)
    examples = [Example(pid, r["prompt_ids"] + r["response_ids"], [False] * len(r["prompt_ids"]) + [True] * len(r["response_ids"]))
                for pid, r in done.items()]
    teacher, features = _caches(tmp_path / "labelled")
    labelled = label_by_prefill(target, examples, teacher, features, tokens_per_batch=40, progress=False)

    assert sorted(labelled) == sorted(done)
    want_rows, got_rows = decoded_teacher.load_all(), teacher.load_all()
    want_features, got_features = decoded_features.load_all(), features.load_all()
    for ex in examples:
        assert labelled[ex.id].greedy_share == 1.0 and labelled[ex.id].tokens == sum(ex.assistant_mask)
        torch.testing.assert_close(got_rows[ex.id]["logprobs"], want_rows[ex.id]["logprobs"], atol=1e-4, rtol=1e-4)
        assert torch.equal(got_rows[ex.id]["indices"], want_rows[ex.id]["indices"])
        assert torch.equal(got_rows[ex.id]["input_ids"], want_rows[ex.id]["input_ids"])
        start = feature_start(ex.assistant_mask, 0)
        torch.testing.assert_close(entry_features(got_features[ex.id], ex.id, ex.input_ids, start).float(),
                                   entry_features(want_features[ex.id], ex.id, ex.input_ids, start).float(), atol=0.02, rtol=0.02)
        # the top-1 log-prob is the likelihood of a greedy token: the mean is the response's likelihood
        assert labelled[ex.id].mean_logprob == pytest.approx(float(want_rows[ex.id]["logprobs"][:, 0].mean()), abs=1e-4)

    # any other text is less likely under the target than its own greedy answer
    other = [Example(ex.id, ex.input_ids[: -sum(ex.assistant_mask)] + [(t + 7) % 94 + 2 for t in ex.input_ids[-sum(ex.assistant_mask):]],
                     ex.assistant_mask) for ex in examples]
    other_stats = label_by_prefill(target, other, *_caches(tmp_path / "other"), progress=False)
    for ex in examples:
        assert other_stats[ex.id].mean_logprob < labelled[ex.id].mean_logprob
        assert other_stats[ex.id].greedy_share < 1.0


def test_batches_group_lengths_within_a_token_budget_and_keep_every_index():
    lengths = [5, 50, 7, 6, 49, 200, 8]
    batches = length_batches(lengths, tokens_per_batch=100)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 100
    assert [5] in batches  # longer than the budget: alone
    assert batches == length_batches(lengths, tokens_per_batch=100)  # the same batches on a rerun


def test_no_batch_starts_after_the_deadline_and_what_was_labelled_is_kept(tmp_path):
    target = make_tiny_llama(vocab_size=96, hidden=32, layers=2, seed=3, tie=False).eval()
    examples = [Example(f"e{i}", list(range(2, 12 + i)), [False] * 4 + [True] * (6 + i)) for i in range(4)]
    teacher, _ = _caches(tmp_path)
    expired = Deadline(time.time() - 1)
    assert label_by_prefill(target, examples, teacher, deadline=expired, progress=False) == {}
    out = label_by_prefill(target, examples, teacher, tokens_per_batch=16, progress=False)
    assert sorted(out) == sorted(teacher.load_all()) == [f"e{i}" for i in range(4)]


def test_a_teacher_cache_of_another_temperature_or_vocabulary_is_refused(tmp_path):
    target = make_tiny_llama(vocab_size=96, hidden=32, layers=2, seed=3, tie=False).eval()
    cache = TeacherCache.create(tmp_path / "t", fingerprint="fp", k=4, temperature=2.0, vocab="full", data="x")
    with pytest.raises(ValueError, match="temperature 1 over the full vocabulary"):
        label_by_prefill(target, [Example("e", [2, 3, 4], [False, True, True])], cache, progress=False)


def test_the_sampled_z_tells_the_targets_own_samples_from_text_it_would_not_write():
    """The statistics `own_text_check` holds a claimed answer to, on a known distribution: the target's own
    samples at a temperature score about N(0, 1) there; its greedy text scores high; uniform noise far below."""
    from specdistill.distill.prefill import authorship

    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(300, 64, generator=g) * 2.0, dim=-1)

    def sample(t: float) -> torch.Tensor:
        return torch.multinomial(torch.softmax(logp / t, dim=-1), 1, generator=g)[:, 0]

    greedy, noise = logp.argmax(-1), torch.randint(0, 64, (300,), generator=g)
    own_1, own_half = authorship(logp, sample(1.0), 1.0), authorship(logp, sample(0.5), 0.5)
    assert abs(own_1["sampled_z"]) < 3 and abs(own_half["sampled_z"]) < 3
    assert authorship(logp, sample(0.5), 1.0)["sampled_z"] > 3  # sharper than temperature 1: above its samples
    assert authorship(logp, greedy, 1.0)["sampled_z"] > 10 and authorship(logp, noise, 1.0)["sampled_z"] < -10
    assert authorship(logp, greedy, 0.0)["near_greedy_share"] == 1.0 > own_1["near_greedy_share"]
    assert own_1["top_k_share"] > authorship(logp, noise, 1.0)["top_k_share"]
    # a written control token (the template's end of turn after a cut response) is not the response's text
    ended = torch.cat([greedy[:-1], torch.tensor([int(logp[-1].argmin())])])
    assert authorship(logp, ended, 0.0)["near_greedy_share"] < 1.0
    assert authorship(logp, ended, 0.0, ignore=ended[-1:])["near_greedy_share"] == 1.0
