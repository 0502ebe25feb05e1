"""Target versions: register, history, change detection by fingerprint."""

from __future__ import annotations

import json

import pytest
import torch

from specdistill.ops.targets import (
    current_target,
    detect_change,
    history_path,
    register_target,
    target_history,
)
from tests.conftest import save_tiny_target


def test_register_records_the_current_version_and_keeps_history(tmp_path):
    a = save_tiny_target(tmp_path / "a", seed=0)
    b = save_tiny_target(tmp_path / "b", seed=1)
    assert current_target() is None and target_history() == []
    va = register_target(a)
    assert current_target() == va and va.path == str(a) and len(va.fingerprint) == 16
    assert register_target(a) == va  # registering the current version again adds nothing
    vb = register_target(b)
    assert vb.fingerprint != va.fingerprint
    assert [v.fingerprint for v in target_history()] == [va.fingerprint, vb.fingerprint]
    register_target(a)  # a rollback is a new current version
    assert current_target().fingerprint == va.fingerprint and len(target_history()) == 3
    assert json.loads(history_path().read_text())["versions"][0]["ref"] == str(a)


def test_detect_change_notices_new_weights_and_records_them(tmp_path):
    a = save_tiny_target(tmp_path / "a")
    changed, cur, prev = detect_change(a)
    assert (changed, prev) == (False, None) and current_target() == cur  # first sighting: recorded, no drift
    assert detect_change(a)[0] is False
    # the same directory, retrained in place: the fingerprint (cached beside the weights) is recomputed
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(a)
    with torch.no_grad():
        model.model.layers[-1].mlp.down_proj.weight.add_(0.01)
    model.save_pretrained(a)
    changed, new, previous = detect_change(a)
    assert changed and previous == cur and new.fingerprint != cur.fingerprint
    assert current_target() == new
    assert detect_change(a)[0] is False


def test_corrupt_history_is_a_clear_error(tmp_path):
    history_path().parent.mkdir(parents=True, exist_ok=True)
    history_path().write_text("{not json")
    with pytest.raises(ValueError, match="corrupt target history"):
        current_target()


def test_cli_target_register_prints_the_version(tmp_path, capsys):
    from specdistill.cli import main

    a = save_tiny_target(tmp_path / "a")
    assert main(["target", "register", str(a), "--no-event", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["path"] == str(a) and out["fingerprint"] == current_target().fingerprint
    assert main(["target", "history", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["versions"]) == 1
