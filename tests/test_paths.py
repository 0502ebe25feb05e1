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
    from specdistill.ops import demo_update as drift

    monkeypatch.setattr(drift, "finetune_top_layers", lambda *a, **k: pytest.fail("refused before fine-tuning"))
    monkeypatch.setattr("specdistill.modeling.models.load_model", lambda *a, **k: pytest.fail("refused before loading"))
    victim = _victim(tmp_path / "victim")
    assert main(["demo", "target-update", "--out", str(victim), "--force"]) == 2
    assert "files this command did not write" in capsys.readouterr().err
    assert [p.name for p in victim.iterdir()] == ["thesis.tex"]


# --------------------------------------------------------------------------------------------
# the one guard, its places and its markers (issue: outputs that never eat user files)


def test_force_replaces_only_what_the_previous_output_wrote_and_keeps_what_the_user_added(tmp_path):
    out = _write(tmp_path / "d1", text="v1")
    marker = json.loads((out / paths.OUTPUT_MARKER).read_text())
    assert marker["kind"] == "draft" and marker["files"] == sorted(["weights", paths.OUTPUT_MARKER])
    (out / "NOTES.md").write_text("my notes")
    (out / "plots").mkdir()
    (out / "plots" / "curve.png").write_text("png")
    _write(out, force=True, text="v2")
    assert (out / "weights").read_text() == "v2"
    assert (out / "NOTES.md").read_text() == "my notes" and (out / "plots" / "curve.png").read_text() == "png"
    assert "NOTES.md" not in json.loads((out / paths.OUTPUT_MARKER).read_text())["files"]  # still the user's
    _write(out, force=True, text="v3")  # and again: kept every time
    assert (out / "NOTES.md").read_text() == "my notes" and (out / "weights").read_text() == "v3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d1"]


def test_a_user_file_named_like_one_the_command_writes_stops_the_replacement(tmp_path):
    out = tmp_path / "d1"
    with atomic_dir(out, "draft") as tmp:
        (tmp / "a").write_text("ours")
    (out / "b").write_text("the user's")
    with pytest.raises(UnsafeOutputError, match="your b has the name of a file this command writes"):
        with atomic_dir(out, "draft", force=True) as tmp:
            (tmp / "a").write_text("new")
            (tmp / "b").write_text("new")
    assert (out / "a").read_text() == "ours" and (out / "b").read_text() == "the user's"


def test_an_older_output_without_a_file_list_is_replaced_only_when_it_holds_nothing_else(tmp_path):
    out = tmp_path / "old"
    out.mkdir()
    (out / "weights").write_text("v0")
    (out / paths.OUTPUT_MARKER).write_text(json.dumps({"kind": "draft"}))  # as the previous version wrote it
    _write(out, force=True, text="v1")
    assert (out / "weights").read_text() == "v1"
    (out / paths.OUTPUT_MARKER).write_text(json.dumps({"kind": "draft"}))
    (out / "NOTES.md").write_text("mine")
    with pytest.raises(UnsafeOutputError, match="does not list as its own"):
        _write(out, force=True, text="v2")
    assert (out / "NOTES.md").read_text() == "mine" and (out / "weights").read_text() == "v1"


def test_the_registry_stores_are_never_an_output(tmp_path, monkeypatch):
    artifacts = paths.registry_artifacts_dir() / "demo" / "1" / "abc" / "artifacts" / "draft"
    copies = paths.registry_copies_dir() / "draft-demo" / "3" / "artifacts" / "draft"
    for out in (artifacts, copies):
        out.mkdir(parents=True)
        (out / "model.safetensors").write_text("registered")
        (out / paths.OUTPUT_MARKER).write_text(json.dumps({"kind": "draft", "files": ["model.safetensors"]}))
        for where in (out, out / "sub", out.parent):
            with pytest.raises(UnsafeOutputError, match="inside the (model registry's artifact store|registered drafts' local copies)"):
                check_output_dir(where, "draft", force=True)
        assert (out / "model.safetensors").read_text() == "registered"
    store = tmp_path / "mlruns"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    with pytest.raises(UnsafeOutputError, match="MLflow file store"):
        check_output_dir(store / "0" / "x", "draft", force=True)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    check_output_dir(store / "0" / "x", "draft", force=True)  # a server's store is the server's


def test_a_symlink_a_path_under_a_file_and_a_file_are_refused_before_any_work(tmp_path):
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "to-empty").symlink_to(tmp_path / "empty")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for out, why in ((tmp_path / "file.txt" / "sub", "file.txt is not a directory"),
                     (tmp_path / "file.txt" / "a" / "b", "file.txt is not a directory"),
                     (tmp_path / "to-empty", "is a symbolic link"), (tmp_path / "dangling", "is a symbolic link"),
                     (tmp_path / "file.txt", "not a directory")):
        with pytest.raises(UnsafeOutputError, match=why):
            check_output_dir(out, "draft", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "empty", "file.txt", "to-empty"]
    assert not any((tmp_path / "empty").iterdir())


def test_an_output_written_in_place_is_claimed_and_resumed_but_never_someone_elses(tmp_path):
    out = tmp_path / "run"
    assert paths.claim_output_dir(out, "distill", ["result.json"]) is False
    assert paths.output_kind(out) == "distill"
    (out / "result.json").write_text("{}")
    assert paths.claim_output_dir(out, "distill", ["result.json"]) is True  # its own previous output: resumes
    victim = _victim(tmp_path / "victim")
    with pytest.raises(UnsafeOutputError, match="files this command did not write"):
        paths.claim_output_dir(victim, "distill", ["result.json"])
    assert [p.name for p in victim.iterdir()] == ["thesis.tex"]
    with pytest.raises(UnsafeOutputError, match="state directory"):
        paths.claim_output_dir(paths.home(), "distill", ["result.json"])
    (tmp_path / "empty").mkdir()
    assert paths.claim_output_dir(tmp_path / "empty", "distill", []) is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "run", "victim"]


def test_draft_init_refuses_a_bad_destination_in_one_line_before_the_target_loads(tmp_path, capsys, monkeypatch):
    from specdistill.cli import main

    monkeypatch.setattr("specdistill.modeling.models.load_model", lambda *a, **k: pytest.fail("refused before loading"))
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "to-empty").symlink_to(tmp_path / "empty")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    registered = paths.registry_artifacts_dir() / "demo" / "1" / "r" / "artifacts" / "draft"
    registered.mkdir(parents=True)
    (registered / paths.OUTPUT_MARKER).write_text(json.dumps({"kind": "draft"}))
    for out, why in ((tmp_path / "file.txt" / "sub", "is not a directory"), (tmp_path / "to-empty", "symbolic link"),
                     (tmp_path / "dangling", "symbolic link"), (registered, "model registry's artifact store")):
        assert main(["draft", "init", "--target", "demo", str(out), "--force"]) == 2
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in registered.iterdir()) == [paths.OUTPUT_MARKER]


def test_draft_init_force_keeps_the_notes_a_user_added(tiny_target, tmp_path):
    from specdistill.cli import main

    out = tmp_path / "d1"
    assert main(["draft", "init", "--layers", "0,3", "--target", str(tiny_target), str(out)]) == 0
    (out / "NOTES.md").write_text("why this draft")
    assert main(["draft", "init", "--layers", "0,1", "--target", str(tiny_target), str(out), "--force"]) == 0
    assert (out / "NOTES.md").read_text() == "why this draft"
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2


def test_the_state_directory_is_not_listable_and_what_an_older_version_left_open_in_it_is_closed(tmp_path, capsys):
    home = paths.home()
    paths.ensure(home / "fallback")
    assert home.stat().st_mode & 0o777 == 0o711  # others can reach serving.json, not list what is there
    (home / "nightly").mkdir(mode=0o755)  # as an older version left it
    (home / "nightly").chmod(0o755)
    old = home / "nightly" / "answers.jsonl"
    old.write_text("an answer\n")
    old.chmod(0o644)
    assert paths.ensure_private(home / "nightly").stat().st_mode & 0o777 == 0o700
    assert home.stat().st_mode & 0o777 == 0o711
    with paths.open_private(old, "a") as f:
        f.write("another\n")
    assert old.stat().st_mode & 0o777 == 0o600 and old.read_text() == "an answer\nanother\n"
    outside = tmp_path / "elsewhere"
    outside.mkdir(mode=0o755)
    outside.chmod(0o755)
    paths.ensure(outside / "x")
    assert outside.stat().st_mode & 0o777 == 0o755  # only the state directory is ours to close
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("mode", [0o1777, 0o777, 0o755])
def test_an_existing_state_directory_is_never_chmodded_only_warned_about(tmp_path, monkeypatch, capsys, mode):
    """Round four: SPECDISTILL_HOME on a `chmod 1777` directory silently became 0711 (the same code would do it to
    /tmp); a shared directory inside it, or one given for private data, was chmod-ed 0700 too."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    monkeypatch.setenv("SPECDISTILL_HOME", str(shared))
    paths.ensure(paths.home() / "fallback")
    paths.create_private_file(paths.home() / "logs.db")
    assert shared.stat().st_mode & 0o7777 == mode
    err = capsys.readouterr().err
    if mode == 0o755:  # others may list it, not plant files in it: files are 0600 and private directories 0700
        assert err == ""
    else:
        assert err.count("\n") == 1 and err.startswith("specdistill: warning: ") and str(shared) in err and f"{mode:04o}" in err
    (shared / "nightly").mkdir()
    (shared / "nightly").chmod(0o1777)  # a shared directory where a private one goes: not ours to close
    paths.ensure_private(shared / "nightly")
    assert (shared / "nightly").stat().st_mode & 0o7777 == 0o1777 and "nightly" in capsys.readouterr().err
    assert (paths.ensure_private(shared / "teacher").stat().st_mode & 0o777) == 0o700  # one it creates is private


def test_a_state_directory_that_is_a_file_is_named_as_a_file(tmp_path, monkeypatch, capsys):
    """Round four: SPECDISTILL_HOME=afile said "file exists"."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    monkeypatch.setenv("SPECDISTILL_HOME", str(afile))
    for make in (lambda: paths.ensure(paths.home() / "fallback"), lambda: paths.ensure_private(paths.home() / "nightly"),
                 lambda: paths.create_private_file(paths.home() / "logs.db")):
        with pytest.raises(ValueError, match=f"{afile} is a file, not a directory"):
            make()
    assert afile.read_text() == "mine"
    from specdistill.cli import main

    traffic = tmp_path / "t.jsonl"
    traffic.write_text('{"prompt": "a", "response": "b"}\n')
    for argv in (["logs", "stats"], ["ingest", str(traffic), "--format", "jsonl"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{afile} is a file, not a directory" in err, (argv, err)


def test_an_output_directory_is_readable_by_a_serving_engine_running_as_another_user(tmp_path):
    import torch
    from safetensors.torch import save_file

    with atomic_dir(tmp_path / "draft", "draft") as tmp:
        save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))  # safetensors writes 0600
        (tmp / "sub").mkdir(mode=0o700)
    out = tmp_path / "draft"
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o644
    assert out.stat().st_mode & 0o777 == 0o755 and (out / "sub").stat().st_mode & 0o777 == 0o755
