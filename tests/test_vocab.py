from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdistill.modeling.vocab import (
    DRAFT_VOCAB_FILE,
    LEGACY_DRAFT_VOCAB_FILE,
    DraftVocab,
    VocabAlignmentError,
    build_draft_vocab,
    check_vocab,
    draft_vocab_path,
    token_frequencies,
    transplant_vocab,
)
from tests.conftest import make_tiny_llama, train_bpe

DOMAIN = ["QuantLib CalcBlackScholesVega QuantLib CalcBlackScholesVega"] * 200


@pytest.fixture(scope="module")
def draft_tok():
    return train_bpe(300)


@pytest.fixture(scope="module")
def target_tok():
    # trained with a domain corpus and a larger vocabulary: ids shift and domain words become single tokens
    return train_bpe(360, extra_corpus=DOMAIN)


def test_identical_tokenizers_report_identical(draft_tok):
    report = check_vocab(draft_tok, draft_tok)
    assert report.identical
    assert report.id_mismatches == 0 and not report.segmentation_differences


def test_report_names_differences(target_tok, draft_tok):
    report = check_vocab(target_tok, draft_tok)
    assert not report.identical
    assert report.target_size == len(target_tok) and report.draft_size == len(draft_tok)
    assert report.only_in_target > 0
    seg = {d["text"]: d for d in report.segmentation_differences}
    probe = "QuantLib CalcBlackScholesVega implied volatility"
    assert probe in seg
    assert len(seg[probe]["target"]) < len(seg[probe]["draft"])  # target holds domain words in fewer tokens
    assert "NOT ALIGNED" in report.render()


def test_report_sees_template_and_special_token_changes(draft_tok):
    other = train_bpe(300)
    other.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    report = check_vocab(draft_tok, other)
    assert not report.chat_template_identical and not report.identical
    other2 = train_bpe(300)
    other2.eos_token = "<|endoftext|>"
    report2 = check_vocab(draft_tok, other2)
    assert "eos_token" in report2.special_tokens_differ


def test_transplant_keeps_shared_rows_and_means_new_pieces(target_tok, draft_tok):
    draft = make_tiny_llama(vocab_size=len(draft_tok), tie=False)
    old_in = draft.get_input_embeddings().weight.detach().clone()
    old_out = draft.get_output_embeddings().weight.detach().clone()
    transplant_vocab(draft, draft_tok, target_tok)

    new_in = draft.get_input_embeddings().weight
    new_out = draft.get_output_embeddings().weight
    assert new_in.shape[0] == len(target_tok) == draft.config.vocab_size
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()

    shared = [t for t in tv if t in dv and tv[t] != dv[t]]
    assert shared, "test needs tokens whose ids moved"
    for token in shared[:50]:  # a token present in both keeps its row, found by string, not id
        assert torch.equal(new_in[tv[token]], old_in[dv[token]])
        assert torch.equal(new_out[tv[token]], old_out[dv[token]])

    new_tokens = [t for t in tv if t not in dv]
    word = next(t for t in new_tokens if "Quant" in t)
    pieces = draft_tok.encode(target_tok.convert_tokens_to_string([word]), add_special_tokens=False)
    assert len(pieces) > 1
    assert torch.allclose(new_in[tv[word]], old_in[pieces].mean(0))
    assert torch.allclose(new_out[tv[word]], old_out[pieces].mean(0))
    assert draft.config.eos_token_id == target_tok.eos_token_id
    # the transplanted draft still runs over target ids
    logits = draft(torch.tensor([[tv[word], 5, 7]])).logits
    assert logits.shape[-1] == len(target_tok)


def test_transplant_tied_model_stays_tied(target_tok, draft_tok):
    draft = make_tiny_llama(vocab_size=len(draft_tok), tie=True)
    transplant_vocab(draft, draft_tok, target_tok)
    assert draft.get_input_embeddings().weight.data_ptr() == draft.get_output_embeddings().weight.data_ptr()


@settings(max_examples=30, deadline=None)
@given(
    vocab=st.integers(8, 200),
    data=st.data(),
)
def test_reduced_vocab_distribution_sums_to_one_and_is_zero_outside(vocab, data):
    n = data.draw(st.integers(1, vocab))
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n, unique=True))
    dv = DraftVocab(torch.tensor(ids), vocab)
    hidden = torch.randn(3, 16)
    weight = torch.randn(vocab, 16)
    probs = dv.logits(hidden, weight).softmax(-1)
    full = dv.to_full(probs)
    assert full.shape == (3, vocab)
    assert torch.allclose(full.sum(-1), torch.ones(3), atol=1e-5)
    outside = ~dv.t2d
    assert torch.all(full[:, outside] == 0)
    # logits over the kept set equal the full head's logits at those ids
    assert torch.allclose(dv.logits(hidden, weight), (hidden @ weight.T)[:, dv.token_ids], atol=1e-5)


def test_reduced_vocab_roundtrip_and_eagle3_convention(tmp_path):
    dv = DraftVocab(torch.tensor([7, 2, 40, 3]), 50)
    assert dv.token_ids.tolist() == [2, 3, 7, 40]
    assert (dv.d2t + torch.arange(4)).tolist() == [2, 3, 7, 40]
    assert dv.to_target_ids(torch.tensor([0, 3])).tolist() == [2, 40]
    dv.save(tmp_path)
    loaded = DraftVocab.load(tmp_path)
    assert torch.equal(loaded.token_ids, dv.token_ids) and loaded.target_vocab_size == 50
    assert DraftVocab.load(tmp_path / "nowhere") is None


def test_draft_vocab_is_not_a_weights_file_beside_the_checkpoint(tmp_path):
    """Serving engines load every *.safetensors beside the weights (vLLM's draft_model fails on `d2t`)."""
    DraftVocab(torch.tensor([1, 5]), 50).save(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    assert draft_vocab_path(tmp_path) == tmp_path / DRAFT_VOCAB_FILE


def test_draft_vocab_of_a_draft_saved_before_still_loads(tmp_path):
    from safetensors.torch import save_file

    dv = DraftVocab(torch.tensor([1, 5, 9]), 50)
    save_file({"d2t": dv.d2t.contiguous(), "t2d": dv.t2d.contiguous()}, str(tmp_path / LEGACY_DRAFT_VOCAB_FILE))
    assert DraftVocab.load(tmp_path).token_ids.tolist() == [1, 5, 9]


def test_build_draft_vocab_takes_most_frequent_and_keeps_eos(draft_tok):
    counts = token_frequencies(draft_tok, ["hello world hello world hello", "def add"])
    dv = build_draft_vocab(counts, 4, len(draft_tok), always_include=[draft_tok.eos_token_id])
    kept = set(dv.token_ids.tolist())
    assert draft_tok.eos_token_id in kept
    top = [t for t, _ in counts.most_common(3)]
    assert set(top) <= kept


def test_bad_draft_vocab_is_refused():
    with pytest.raises(VocabAlignmentError, match="outside"):
        DraftVocab(torch.tensor([1, 99]), 50)
    with pytest.raises(VocabAlignmentError, match="duplicate"):
        DraftVocab(torch.tensor([1, 1]), 50)
    with pytest.raises(VocabAlignmentError, match="exceeds"):
        build_draft_vocab(Counter({1: 3}), 100, 50)
