"""State locations and output directories: a command never deletes what it did not create."""

from __future__ import annotations

import json

import pytest

from specdistill import paths
from specdistill.paths import UnsafeOutputError, atomic_dir, check_output_dir
from tests.conftest import save_tiny_target


def _victim(directory):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "thesis.tex").write_text("years of work")
    return directory


def _write(out, kind="draft", force=True, text="new"):
    with atomic_dir(out, kind, force=force) as tmp:
        (tmp / "weights").write_text(text)
    return out


def test_a_directory_of_someone_elses_files_is_never_replaced(tmp_path):
    victim = _victim(tmp_path / "victim")
    for force in (False, True):
        with pytest.raises(UnsafeOutputError, match="files this command did not write"):
            _write(victim, force=force)
    assert (victim / "thesis.tex").read_text() == "years of work" and not (victim / "weights").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim"]  # no temporary directory left behind


def test_force_replaces_only_a_previous_output_of_the_same_kind(tmp_path):
    out = _write(tmp_path / "draft", text="v1")
    assert paths.output_kind(out) == "draft"
    with pytest.raises(UnsafeOutputError, match="pass --force"):
        _write(out, force=False, text="v2")
    assert (out / "weights").read_text() == "v1"
    _write(out, force=True, text="v2")
    assert (out / "weights").read_text() == "v2"
    with pytest.raises(UnsafeOutputError, match="a draft output, not a target one"):
        _write(out, kind="target")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]


def test_an_empty_directory_or_a_new_path_is_written(tmp_path):
    (tmp_path / "empty").mkdir()
    _write(tmp_path / "empty", force=False)
    _write(tmp_path / "new" / "nested", force=False)
    assert (tmp_path / "empty" / "weights").is_file() and (tmp_path / "new" / "nested" / "weights").is_file()


def test_the_working_directory_the_state_directory_and_their_parents_are_refused(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("SPECDISTILL_HOME", str(tmp_path / "state"))
    (tmp_path / "state").mkdir()
    for out in (".", str(work), str(tmp_path), "/", str(tmp_path / "state"), "..", str(work / "..")):
        with pytest.raises(UnsafeOutputError, match="working directory|state directory"):
            check_output_dir(out, "draft", force=True)
    check_output_dir(work / "sub", "draft", force=False)  # inside them is fine
    check_output_dir(tmp_path / "state" / "targets" / "x", "target", force=False)


def test_a_file_is_not_an_output_directory(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UnsafeOutputError, match="not a directory"):
        check_output_dir(tmp_path / "f", "draft", force=True)


def test_keep_mode_never_replaces(tmp_path):
    out = _write(tmp_path / "cache", kind="model-cache", text="first")
    with atomic_dir(out, "model-cache", replace=False) as tmp:
        (tmp / "weights").write_text("second")
    assert (out / "weights").read_text() == "first"


def test_private_files_and_directories(tmp_path):
    db = paths.create_private_file(tmp_path / "a" / "logs.db")
    assert db.stat().st_mode & 0o777 == 0o600
    assert paths.ensure_private(tmp_path / "cache").stat().st_mode & 0o777 == 0o700
    written = paths.atomic_write_json(tmp_path / "x.json", {"a": 1})
    assert written.stat().st_mode & 0o777 == 0o600 and json.loads(written.read_text()) == {"a": 1}


# --------------------------------------------------------------------------------------------
# the commands that write a directory


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("target"))


@pytest.mark.parametrize("argv", [
    ["draft", "init", "--layers", "0,3"],
    ["draft", "init", "--kind", "eagle3", "--layers", "0,1,2"],
])
def test_draft_init_keeps_a_victim_directory_and_replaces_its_own_output_with_force(argv, tiny_target, tmp_path,
                                                                                    capsys, monkeypatch):
    from specdistill.cli import main

    victim = _victim(tmp_path / "victim")
    assert main([*argv, "--target", str(tiny_target), str(victim)]) == 2
    err = capsys.readouterr().err
    assert "files this command did not write" in err and str(victim) in err
    assert [p.name for p in victim.iterdir()] == ["thesis.tex"]

    out = tmp_path / "draft"
    assert main([*argv, "--target", str(tiny_target), str(out)]) == 0
    assert main([*argv, "--target", str(tiny_target), str(out)]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert main([*argv, "--target", str(tiny_target), str(out), "--force"]) == 0

    monkeypatch.chdir(victim)
    assert main([*argv, "--target", str(tiny_target), "."]) == 2  # deleted the working directory's files before
    assert "working directory" in capsys.readouterr().err and (victim / "thesis.tex").is_file()
    assert main([*argv, "--target", str(tiny_target), str(paths.home()), "--force"]) == 2
    assert "state directory" in capsys.readouterr().err


def test_vocab_transplant_keeps_a_victim_directory(tiny_target, tmp_path, capsys):
    from specdistill.cli import main

    victim = _victim(tmp_path / "victim")
    assert main(["vocab", "transplant", str(tiny_target), str(tiny_target), str(victim), "--force"]) == 2
    assert "files this command did not write" in capsys.readouterr().err
    assert [p.name for p in victim.iterdir()] == ["thesis.tex"]


def test_target_update_keeps_a_victim_directory_before_any_work(tmp_path, capsys, monkeypatch):
    from specdistill.cli import main
    from specdistill.ops import drift

    monkeypatch.setattr(drift, "finetune_top_layers", lambda *a, **k: pytest.fail("refused before fine-tuning"))
    monkeypatch.setattr("specdistill.modeling.models.load_model", lambda *a, **k: pytest.fail("refused before loading"))
    victim = _victim(tmp_path / "victim")
    assert main(["demo", "target-update", "--out", str(victim), "--force"]) == 2
    assert "files this command did not write" in capsys.readouterr().err
    assert [p.name for p in victim.iterdir()] == ["thesis.tex"]
