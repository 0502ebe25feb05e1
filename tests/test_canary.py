"""A target that cannot be silently garbage: non-finite or flat canary logits are refused at load, and
the small random models the tests run on are not."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdistill.modeling.canary import DegenerateModelError, check_canary
from specdistill.modeling.models import load_model
from tests.conftest import lively, make_tiny_llama, save_tiny_target, train_bpe


def _rewrite_tensor(directory, name, value: float) -> None:
    """One tensor of a saved checkpoint set to `value` (what damaged bytes in a weights file read as)."""
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    tensors[name] = torch.full_like(tensors[name], value)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("tensor, value, why", [
    ("model.layers.1.mlp.down_proj.weight", float("nan"), r"not finite \(tensor model.layers.1.mlp.down_proj.weight"),
    ("model.layers.0.self_attn.v_proj.weight", float("inf"), "not finite"),
    ("model.norm.weight", 0.0, "the same for every token"),  # the finding's output_ids all 0
])
def test_a_damaged_target_is_refused_naming_its_file(tmp_path, tensor, value, why):
    target = save_tiny_target(tmp_path / "target")
    _rewrite_tensor(target, tensor, value)
    with pytest.raises(DegenerateModelError, match=rf"{target / 'model.safetensors'}: .*{why}"):
        load_model(target, dtype="float32")


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_generate_and_bench_refuse_a_damaged_target_before_measuring(tmp_path, capsys, command):
    """The finding: a damaged demo cache gave `generate` output_ids all 0 (exit 0), and `bench --suffix`
    acceptance 1.0 with speedups, because a broken target agrees with any drafter."""
    from specdistill.cli import main

    target = save_tiny_target(tmp_path / "target")
    _rewrite_tensor(target, "model.norm.weight", 0.0)
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["hello world"]}) + "\n")
    where = ["--prompt-ids", "1,2,3"] if command == "generate" else ["--prompts", str(prompts), "--repeats", "1"]
    assert main([command, "--target", str(target), "--ngram", "--max-new-tokens", "4", "--json", *where]) == 2
    captured = capsys.readouterr()
    assert "model.safetensors" in captured.err and "refusing it before anything is measured" in captured.err
    error = json.loads(captured.out)  # nothing measured: --json prints the error as its one object
    assert error["exit_code"] == 2 and "refusing it before anything is measured" in error["error"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tests_small_random_models_pass_the_canary(dtype):
    """Default-initialized tiny models repeat one token, and that is not refused: only non-finite or flat
    logits are."""
    for vocab in (96, 120, 300):
        tok = train_bpe(vocab)
        for seed in range(6):
            for layers, tie in ((1, True), (4, False)):
                model = make_tiny_llama(vocab_size=len(tok), layers=layers, seed=seed, tie=tie).to(dtype)
                check_canary(model, tok, "tiny")
            check_canary(lively(make_tiny_llama(vocab_size=len(tok), seed=seed), seed), tok, "lively")
