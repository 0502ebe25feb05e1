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


def test_a_relative_target_path_is_recorded_absolute(tmp_path, monkeypatch):
    """`target register t2` stored "path": "t2", so a monitor run elsewhere failed with `model not found: t2`."""
    save_tiny_target(tmp_path / "t2")
    monkeypatch.chdir(tmp_path)
    version = register_target("t2")
    assert version.path == version.ref == str(tmp_path / "t2")
    monkeypatch.chdir(tmp_path / "t2")  # another directory: what was recorded still names the target
    assert register_target(version.ref) == version  # the same version again: nothing new
    assert detect_change(current_target().ref)[0] is False
    assert register_target("demo", fingerprint="fp-demo", model_dir="cache/demo").ref == "demo"
    assert current_target().path == str(tmp_path / "t2" / "cache" / "demo")


def test_a_served_name_belongs_to_one_version_at_a_time_from_its_registration_on(tmp_path):
    """Two versions registered under one served name both held it: an old version's logs counted as the new one's."""
    from datetime import datetime, timedelta

    from specdistill.ops.targets import name_holder, served_name_periods

    old = register_target("old", fingerprint="fp-old", model_dir=tmp_path / "old", served_names=["acme"])
    new = register_target("new", fingerprint="fp-new", model_dir=tmp_path / "new", served_names=["acme"])
    moved = datetime.fromisoformat(new.registered_at)
    assert served_name_periods("fp-new") == {"acme": [(moved, None)]}
    assert served_name_periods("fp-old") == {"acme": [(datetime.fromisoformat(old.registered_at), moved)]}
    before, after = moved - (moved - datetime.fromisoformat(old.registered_at)) / 2, moved + timedelta(seconds=1)
    assert name_holder("acme", before) == "fp-old" and name_holder("acme", after) == "fp-new"
    assert name_holder("acme", datetime.fromisoformat(old.registered_at) - timedelta(days=1)) is None  # before any claim
    # a name added to the current version later holds from then on, not from the version's registration
    register_target("new", fingerprint="fp-new", model_dir=tmp_path / "new", served_names=["acme-eu"])
    ((since, until),) = served_name_periods("fp-new")["acme-eu"]
    assert since > moved and until is None
    # a rollback to the old version does not take the name back unless it is given again
    register_target("old", fingerprint="fp-old", model_dir=tmp_path / "old")
    assert name_holder("acme", datetime.now(moved.tzinfo)) == "fp-new"
    register_target("old", fingerprint="fp-old", model_dir=tmp_path / "old", served_names=["acme"])
    assert name_holder("acme", datetime.now(moved.tzinfo) + timedelta(seconds=1)) == "fp-old"


def test_the_cli_says_when_a_served_name_moves_to_the_new_version(tmp_path, capsys):
    from specdistill.cli import main

    a, b = save_tiny_target(tmp_path / "a", seed=0), save_tiny_target(tmp_path / "b", seed=1)
    assert main(["target", "register", str(a), "--no-event", "--served-name", "acme"]) == 0
    capsys.readouterr()
    assert main(["target", "register", str(b), "--no-event", "--served-name", "acme"]) == 0
    err = capsys.readouterr().err
    assert "acme" in err and "moves from target" in err and "logged under it before now stay" in err


def test_a_moved_served_name_is_listed_by_its_new_version_only_and_kept_as_the_old_ones_history(tmp_path, capsys):
    """Round four: after `target register NEW --served-name acme`, the old version still listed acme in targets.json."""
    import json
    from datetime import datetime

    from specdistill.cli import main
    from specdistill.ops.targets import history_path, name_holder, served_name_periods

    old = register_target("old", fingerprint="fp-old", model_dir=tmp_path / "old", served_names=["acme", "acme-eu"])
    new = register_target("new", fingerprint="fp-new", model_dir=tmp_path / "new", served_names=["acme"])
    first, second = target_history()
    assert first.served_names == ("acme-eu",) and second.served_names == ("acme",)
    assert first.served_until == {"acme": new.registered_at}  # its history: it held acme until then
    moved = datetime.fromisoformat(new.registered_at)
    assert served_name_periods("fp-old") == {"acme": [(datetime.fromisoformat(old.registered_at), moved)],
                                             "acme-eu": [(datetime.fromisoformat(old.registered_at), None)]}
    assert name_holder("acme", moved) == "fp-new"
    # a name added to the current version later moves too
    register_target("new", fingerprint="fp-new", model_dir=tmp_path / "new", served_names=["acme-eu"])
    listed = [name for v in json.loads(history_path().read_text())["versions"] for name in v["served_names"]]
    assert sorted(listed) == ["acme", "acme-eu"]  # each name once, in the file itself
    assert main(["target", "history"]) == 0
    out = capsys.readouterr().out
    assert out.count("acme-eu") == 1 and out.splitlines()[0].count("served as") == 0, out


def test_a_history_written_before_names_moved_lists_each_name_once_when_read(tmp_path):
    import json

    from specdistill.ops.targets import history_path, served_name_periods

    versions = [{"fingerprint": fp, "path": str(tmp_path / fp), "ref": fp, "registered_at": at, "served_names": ["acme"],
                 "served_since": {}} for fp, at in (("fp-a", "2026-01-01T00:00:00+00:00"), ("fp-b", "2026-02-01T00:00:00+00:00"),
                                                     ("fp-a", "2026-03-01T00:00:00+00:00"))]
    history_path().parent.mkdir(parents=True, exist_ok=True)
    history_path().write_text(json.dumps({"versions": versions}))
    a1, b, a2 = target_history()
    assert (a1.served_names, b.served_names, a2.served_names) == ((), (), ("acme",))
    assert a1.served_until == {"acme": "2026-02-01T00:00:00+00:00"} and b.served_until == {"acme": "2026-03-01T00:00:00+00:00"}
    assert [(s.month, u and u.month) for s, u in served_name_periods("fp-a")["acme"]] == [(1, 2), (3, None)]
