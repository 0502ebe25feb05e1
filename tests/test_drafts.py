import pytest
import torch
from transformers import AutoModelForCausalLM

from specdistill.modeling.drafts import (
    init_draft_from_target,
    load_draft_meta,
    parse_layers,
    save_draft,
)
from specdistill.modeling.vocab import DraftVocab
from tests.conftest import make_tiny_llama, train_bpe


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("0,1,2,29", [0, 1, 2, 29]),
        ("evenly:4", [0, 10, 19, 29]),
        ("first:4", [0, 1, 2, 29]),
        ("0,-1", [0, 29]),
        ([3, 7], [3, 7]),
    ],
)
def test_parse_layers(spec, expected):
    assert parse_layers(spec, 30) == expected


@pytest.mark.parametrize("spec", ["0,30", "2,1", "1,1", "evenly:0", "a,b", ""])
def test_parse_layers_rejects_bad_specs(spec):
    with pytest.raises(ValueError, match="layer spec"):
        parse_layers(spec, 30)


def test_extracted_layers_equal_the_targets():
    target = make_tiny_llama(layers=6, tie=False)
    layers = [0, 2, 5]
    draft = init_draft_from_target(target, layers)
    assert draft.config.num_hidden_layers == 3
    assert target.config.num_hidden_layers == 6  # the target's config is not touched
    t_sd, d_sd = target.state_dict(), draft.state_dict()
    for j, i in enumerate(layers):
        for key, value in d_sd.items():
            if key.startswith(f"model.layers.{j}."):
                assert torch.equal(value, t_sd[key.replace(f"layers.{j}.", f"layers.{i}.")])
    for key in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(d_sd[key], t_sd[key])
    # weights are copies: training the draft does not change the target
    with torch.no_grad():
        draft.model.layers[0].mlp.up_proj.weight.add_(1.0)
    assert not torch.equal(draft.model.layers[0].mlp.up_proj.weight, target.model.layers[0].mlp.up_proj.weight)


def test_draft_of_all_layers_matches_target_logits():
    target = make_tiny_llama(layers=3)
    draft = init_draft_from_target(target, [0, 1, 2])
    ids = torch.tensor([[1, 5, 9, 11]])
    assert torch.allclose(draft(ids).logits, target(ids).logits, atol=1e-6)


def test_saved_draft_is_an_ordinary_hf_checkpoint(tmp_path):
    tok = train_bpe(300)
    target = make_tiny_llama(vocab_size=len(tok))
    draft = init_draft_from_target(target, [0, 3])
    vocab = DraftVocab(torch.arange(0, 300, 3), len(tok))
    out = save_draft(draft, tok, tmp_path / "draft", draft_vocab=vocab, meta={"layers": [0, 3]})
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert (out / "tokenizer.json").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[1, 4, 8]])
    assert torch.allclose(reloaded(ids).logits, draft(ids).logits, atol=1e-6)
    assert torch.equal(DraftVocab.load(out).token_ids, vocab.token_ids)
    assert load_draft_meta(out) == {"layers": [0, 3]}
    assert not list(tmp_path.glob("draft.tmp-*"))  # atomic write leaves no temporary directory

