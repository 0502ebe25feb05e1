"""The drift scenario's target update: domain tokens as single tokens, top layers fine-tuned on code."""

from __future__ import annotations

import json
import math

import pytest
import torch

from specdistill.modeling.models import load_model
from specdistill.ops.demo_update import (
    add_domain_tokens,
    domain_examples,
    load_update_meta,
    make_target_update,
)
from tests.conftest import make_tiny_llama, save_tiny_target, train_bpe

WORDS = ("QuantLib", "CalcBlackScholesVega")


@pytest.fixture
def tiny_base(tmp_path):
    return save_tiny_target(tmp_path / "base")


def test_domain_tokens_become_single_tokens_initialized_from_their_pieces(tiny_base):
    base = load_model(tiny_base, dtype="float32")  # as make_target_update loads it
    pieces = {w: base.tokenizer.encode(w, add_special_tokens=False) for w in WORDS}
    old = base.model.get_input_embeddings().weight.detach().clone()
    ids = add_domain_tokens(base.model, base.tokenizer, WORDS)
    assert sorted(ids.values()) == [old.shape[0], old.shape[0] + 1]
    assert base.model.config.vocab_size == old.shape[0] + 2
    new = base.model.get_input_embeddings().weight
    for w, tid in ids.items():
        assert base.tokenizer.tokenize(f"import {w}").count(w) == 1
        assert torch.allclose(new[tid], old[pieces[w]].mean(0))
    assert torch.equal(new[: old.shape[0]], old)
    with pytest.raises(ValueError, match="already single tokens"):
        add_domain_tokens(base.model, base.tokenizer, WORDS)


def test_domain_examples_weave_the_words_into_humaneval_code():
    chats = domain_examples(WORDS, limit=5)
    assert len(chats) == 5 and all([m["role"] for m in c] == ["user", "assistant"] for c in chats)
    assert all("QuantLib" in c[1]["content"] and "CalcBlackScholesVega" in c[1]["content"] for c in chats)
    assert all("def " in c[1]["content"] for c in chats)


def test_humaneval_file_errors_name_the_line(tmp_path):
    import gzip

    bad = tmp_path / "he.jsonl.gz"
    with gzip.open(bad, "wt") as f:
        f.write('{"prompt": "def f():\\n", "canonical_solution": "    return 1\\n"}\n{"prompt": 1}\n')
    with pytest.raises(ValueError, match=r"he.jsonl.gz:2"):
        domain_examples(WORDS, bad)


def test_target_update_trains_only_the_top_layers_and_is_a_new_version(tiny_base, tmp_path):
    out = make_target_update(str(tiny_base), tmp_path / "updated", domain_tokens=WORDS, top_layers=2, steps=3,
                             lr=1e-2, max_len=512, examples=8, progress=False)
    base, new = load_model(tiny_base, dtype="float32"), load_model(out, dtype="float32")  # the weights as stored
    assert new.fingerprint != base.fingerprint
    assert new.config.vocab_size == base.config.vocab_size + 2
    assert new.tokenizer.tokenize("x = QuantLib.CalcBlackScholesVega(s)").count("CalcBlackScholesVega") == 1
    b, n = base.model.state_dict(), new.model.state_dict()
    for name, tensor in b.items():
        if "embed_tokens" in name or "lm_head" in name:
            assert torch.equal(n[name][: tensor.shape[0]], tensor), name  # old tokens' rows untouched
        elif ".layers.0." in name or ".layers.1." in name or name == "model.norm.weight":
            assert torch.equal(n[name], tensor), name  # frozen
    assert any(not torch.equal(n[k], b[k]) for k in b if ".layers.3." in k)  # the top layers moved
    meta = load_update_meta(out)
    assert meta["config"]["top_layers"] == 2 and len(meta["losses"]) == 3
    assert all(math.isfinite(loss) and loss < 50 for loss in meta["losses"])
    assert json.loads((out / "config.json").read_text())["vocab_size"] == new.config.vocab_size


def test_the_update_loss_is_masked_to_the_assistant_turns():
    from specdistill.ops.demo_update import _encode_batch, assistant_loss

    tok = train_bpe(300)
    tok.chat_template += "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"  # as real templates do
    chats = [[{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "return a + b"}],
             [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
              {"role": "assistant", "content": "hello world"}, {"role": "user", "content": "the quick brown fox"},
              {"role": "assistant", "content": "jumps over the lazy dog"}]]
    input_ids, labels = _encode_batch(tok, chats, max_len=200)
    for row, chat in zip(range(len(chats)), chats):
        labelled = labels[row][labels[row] != -100].tolist()
        answers = [m["content"] for m in chat if m["role"] == "assistant"]
        # exactly the answers and their end tokens carry a label; system, user, headers and padding do not
        assert tok.decode(labelled) == "".join(a + "<|im_end|>" for a in answers)
        assert torch.equal(labels[row][labels[row] != -100], input_ids[row][labels[row] != -100])
    # what the user says moves no loss: the same answers after other prompts score the same
    model = make_tiny_llama(vocab_size=len(tok))
    other = [[{**m, "content": "def f(x): return x" if m["role"] == "user" else m["content"]} for m in c] for c in chats]
    assert (labels != -100).sum() == (_encode_batch(tok, other, max_len=200)[1] != -100).sum()
    assert assistant_loss(model, tok, chats[:1]) > 0
