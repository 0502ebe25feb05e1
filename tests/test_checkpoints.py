"""Training checkpoints: a file that `torch.load(weights_only=True)` refuses is named, never a traceback."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from specdistill.cli import main
from specdistill.distill.checkpoints import CheckpointError, load_checkpoint


class _Payload:
    def __reduce__(self):
        return os.system, ("true",)


@pytest.mark.parametrize("content", ["pickle", "garbage", "missing"])
def test_an_unsafe_or_damaged_optimizer_file_is_one_named_line(tmp_path, content):
    module = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(module.parameters())
    ckpt = tmp_path / "checkpoints" / "step-0000004"
    ckpt.mkdir(parents=True)
    save_file(module.state_dict(), str(ckpt / "model.safetensors"))
    if content == "pickle":
        torch.save({"state": {}, "param_groups": [], "x": _Payload()}, ckpt / "optimizer.pt")
    elif content == "garbage":
        (ckpt / "optimizer.pt").write_bytes(b"not a torch file at all")
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(ckpt, module, optimizer)
    message = str(caught.value)
    assert message.startswith(f"{ckpt / 'optimizer.pt'}: ") and str(ckpt) in message
    assert len(message.splitlines()) == 1 and "Weights only load failed" not in message
    if content == "pickle":
        assert "refused by torch.load(weights_only=True)" in message and "posix.system" in message


def test_the_cli_prints_a_refused_checkpoint_as_one_line(tmp_path, monkeypatch, capsys):
    import specdistill.distill.train as train
    from specdistill.distill.checkpoints import load_tensors

    evil = tmp_path / "optimizer.pt"
    torch.save({"x": _Payload()}, evil)
    monkeypatch.setattr(train, "distill", lambda config: load_tensors(evil))  # what a resume loads first
    assert main(["distill", "data.path=x.jsonl"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"specdistill: error: {evil}: refused") and len(err.strip().splitlines()) == 1
