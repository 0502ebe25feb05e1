"""End-to-end on the real demo target (SmolLM2-135M-Instruct), loaded once through the safetensors cache."""

import json

import pytest

from specdistill.cli import main
from specdistill.modeling.drafts import (
    init_draft_from_target,
    measure_cost_ratio,
    save_draft,
)
from specdistill.modeling.models import load_model
from tests.conftest import save_tiny_target

pytestmark = pytest.mark.e2e


def _greedy(loaded, prompt: str, n: int = 12) -> list[int]:
    ids = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = loaded.model.generate(**ids, max_new_tokens=n, do_sample=False)
    return out[0, ids["input_ids"].shape[1]:].tolist()


def test_demo_target_greedy_is_nonempty_and_deterministic(demo_target):
    cfg = demo_target.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    first = _greedy(demo_target, "What is the capital of France?")
    second = _greedy(demo_target, "What is the capital of France?")
    assert first and first == second
    assert "Paris" in demo_target.tokenizer.decode(first)


def test_demo_fingerprint_is_stable_across_loads(demo_target):
    assert load_model("demo").fingerprint == demo_target.fingerprint


def test_draft_from_demo_target_and_vocab_check_cli(demo_target, tmp_path, capsys):
    draft = init_draft_from_target(demo_target.model, [0, 1, 2, 29])
    out = save_draft(draft, demo_target.tokenizer, tmp_path / "draft")
    assert main(["vocab", "check", str(demo_target.path), str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["identical"] and report["target_size"] == 49152

    c = measure_cost_ratio(demo_target.model, draft, repeats=5)
    assert 0.0 < c < 1.0  # 4 of 30 layers plus the head costs less than the whole target


def test_vocab_check_cli_exits_nonzero_when_tokenizers_differ(demo_target, tmp_path, capsys):
    other = save_tiny_target(tmp_path / "other")
    assert main(["vocab", "check", str(demo_target.path), str(other)]) == 1
    assert "NOT ALIGNED" in capsys.readouterr().out


def test_draft_init_cli_with_reduced_vocabulary(demo_target, tmp_path, capsys):
    from specdistill.modeling.vocab import DraftVocab

    traffic = tmp_path / "traffic.txt"
    traffic.write_text("def fibonacci(n):\n    return n\nHello, how are you today?\n" * 5)
    out = tmp_path / "draft"
    code = main(["draft", "init", "--target", str(demo_target.path), "--layers", "first:3",
                 "--draft-vocab", "64", "--traffic", str(traffic), str(out), "--json"])
    assert code == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["layers"] == [0, 1, 29]
    vocab = DraftVocab.load(out)
    assert vocab.size == 64 and demo_target.tokenizer.eos_token_id in vocab.token_ids.tolist()
    assert demo_target.tokenizer.encode(" fibonacci", add_special_tokens=False)[0] in vocab.token_ids.tolist()


def test_draft_init_cli_refuses_vocab_without_traffic(demo_target, tmp_path):
    with pytest.raises(SystemExit, match="--traffic"):
        main(["draft", "init", "--target", str(demo_target.path), "--draft-vocab", "64", str(tmp_path / "d")])


def test_vocab_transplant_cli_aligns_a_foreign_draft(demo_target, tmp_path, capsys):
    foreign = save_tiny_target(tmp_path / "foreign")
    out = tmp_path / "aligned"
    assert main(["vocab", "transplant", str(demo_target.path), str(foreign), str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["vocab_size"] == 49152
    assert main(["vocab", "check", str(demo_target.path), str(out)]) == 0
