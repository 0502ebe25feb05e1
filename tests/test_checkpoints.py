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


@pytest.fixture
def tiny_run(tmp_path):
    """A tiny target and a few of its 'answers' (random ids): a distillation config that checkpoints every step."""
    import json
    import random

    from specdistill.distill.distill_recipe import load_config
    from tests.conftest import save_tiny_target

    target = save_tiny_target(tmp_path / "target")
    rng = random.Random(0)
    with open(tmp_path / "answers.jsonl", "w") as f:
        for i in range(4):
            f.write(json.dumps({"id": f"a{i}", "prompt_ids": [rng.randrange(3, 290) for _ in range(6)],
                                "response_ids": [rng.randrange(3, 290) for _ in range(8)]}) + "\n")

    def overrides(out, *extra):
        return [f"target={target}", "layers=0,3", "draft_vocab=null", f"data.path={tmp_path / 'answers.jsonl'}",
                f"out_dir={out}", "optim.max_steps=2", "optim.batch_size=2", "optim.warmup_steps=0",
                "checkpoint_every=1", "progress=false", "freeze=[]", "threads=1", *extra]

    def config(out, *extra):
        return load_config(None, overrides(out, *extra))
    config.overrides = overrides
    return config


def test_an_unfinished_checkpoint_is_ignored_and_cleaned_and_a_failed_write_says_why(tiny_run, tmp_path, one_thread):
    """A checkpoint whose write died (a file-size limit, a full disk, a kill mid-save) never blocks a later
    run: it is not a checkpoint, the next run removes it and resumes from the last complete one."""
    import resource

    from specdistill.distill.checkpoints import CheckpointWriteError, checkpoint_dirs
    from specdistill.distill.train import distill

    out = tmp_path / "run"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))  # `ulimit -f`: the draft's weights do not fit
    try:
        with pytest.raises(CheckpointWriteError) as caught:
            distill(tiny_run(out))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    message = str(caught.value)
    assert "step-0000001" in message and "file too large" in message.lower() and "ulimit -f" in message
    assert len(message.splitlines()) == 1
    assert not list((out / "checkpoints").iterdir())  # no half checkpoint left behind
    distill(tiny_run(out, "optim.max_steps=1"))  # the limit lifted: the same command runs
    assert [p.name for p in checkpoint_dirs(out)] == ["step-0000001"]
    # a kill mid-save (SIGKILL): the temporary directory and a torn file in it
    torn = out / "checkpoints" / "step-0000002.tmp"
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"\x10\x00\x00")
    (torn / "state.json").write_text('{"step": 2')
    assert [p.name for p in checkpoint_dirs(out)] == ["step-0000001"]
    result = distill(tiny_run(out))  # resumes from step 1, not from the torn one
    assert result.steps == 2 and sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000001", "step-0000002"]


def test_a_full_disk_while_checkpointing_is_one_sentence(tmp_path, monkeypatch):
    import errno

    from specdistill.distill import checkpoints
    from specdistill.distill.checkpoints import CheckpointWriteError, save_checkpoint
    from specdistill.distill.distill_recipe import load_config

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoints.torch, "save", full)
    module = torch.nn.Linear(3, 2)
    order = type("Order", (), {"state": lambda self: {}})()
    with pytest.raises(CheckpointWriteError, match=r"step-0000005.*no space left on device.*free space"):
        save_checkpoint(tmp_path, 5, module, torch.optim.AdamW(module.parameters()), order, {},
                        load_config(None, ["data.path=x"]))
    assert not list((tmp_path / "checkpoints").iterdir())


def test_resuming_with_another_draft_shape_is_one_sentence_before_the_target_loads(tiny_run, tmp_path, capsys, monkeypatch,
                                                                                   one_thread):
    """A rerun into the same out_dir with other `layers` met a raw `load_state_dict` error after loading the target."""
    from specdistill.distill.train import distill

    out = tmp_path / "run"
    distill(tiny_run(out, "optim.max_steps=1"))
    config = tiny_run(out, "layers=0,2,3")
    monkeypatch.setattr("specdistill.modeling.models.load_model", lambda *a, **k: pytest.fail("refused before loading"))
    with pytest.raises(ValueError) as caught:
        distill(config)
    message = str(caught.value)
    assert "step-0000001" in message and "layers" in message and "'0,3'" in message and "'0,2,3'" in message
    assert len(message.splitlines()) == 1 and "state_dict" not in message


def test_a_checkpoint_that_does_not_fit_the_draft_is_named_not_a_state_dict_dump(tmp_path):
    module = torch.nn.Linear(3, 2)
    ckpt = tmp_path / "checkpoints" / "step-0000004"
    ckpt.mkdir(parents=True)
    save_file(torch.nn.Linear(5, 2).state_dict(), str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(ckpt, module, torch.optim.AdamW(module.parameters()))
    message = str(caught.value)
    assert message.startswith(f"{ckpt / 'model.safetensors'}: ") and "weight" in message and len(message.splitlines()) == 1


def test_a_resume_with_no_step_left_reports_the_last_loss_as_json(tiny_run, tmp_path, capsys, one_thread):
    """A resumed `distill --json` with nothing left to train printed `"loss": NaN`, which is not JSON."""
    import json

    out = tmp_path / "run"
    argv = ["distill", "--json", *tiny_run.overrides(out, "optim.max_steps=1")]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(argv) == 0  # resumed at step 1 of 1: no step runs
    again = json.loads(capsys.readouterr().out, parse_constant=lambda name: pytest.fail(f"{name} in JSON"))
    assert again["steps"] == 1 and again["loss"] == pytest.approx(first["loss"])


@pytest.mark.parametrize("kind", ["file", "symlink", "dangling symlink", "directory"])
def test_a_stale_unfinished_checkpoint_of_any_type_is_removed_and_never_followed(tiny_run, tmp_path, one_thread, kind):
    """Round four: a `step-N.tmp` that was a file blocked resume for good ("file exists ... run the same command
    again", every time). Whatever is at an unfinished checkpoint's name goes; a link is unlinked, not followed."""
    from specdistill.distill.checkpoints import checkpoint_dirs
    from specdistill.distill.train import distill

    out = tmp_path / "run"
    distill(tiny_run(out, "optim.max_steps=1"))
    users = tmp_path / "users"
    users.mkdir()
    (users / "thesis.tex").write_text("years of work")
    stale = out / "checkpoints" / "step-0000002.tmp"
    if kind == "file":
        stale.write_text("half a checkpoint")
    elif kind == "symlink":
        stale.symlink_to(users, target_is_directory=True)
    elif kind == "dangling symlink":
        stale.symlink_to(tmp_path / "gone")
    else:
        stale.mkdir()
        (stale / "state.json").write_text('{"step": 2')
    result = distill(tiny_run(out))
    assert result.steps == 2 and [p.name for p in checkpoint_dirs(out)] == ["step-0000001", "step-0000002"]
    assert not stale.exists() and not stale.is_symlink()
    assert (users / "thesis.tex").read_text() == "years of work"


def test_a_run_directorys_files_are_never_written_through_symlinks(tiny_run, tmp_path, one_thread, capsys, monkeypatch):
    """Round four: with result.json and config.yaml replaced by links to a user's files, a resume overwrote the
    user's files; metrics.jsonl and train_log.jsonl were appended through. A link at any name the run writes is
    refused before the target loads, with a sentence naming it; the user's file is untouched."""
    from specdistill.distill.train import distill

    out = tmp_path / "run"
    heldout = f"data.heldout_path={tmp_path / 'answers.jsonl'}"
    distill(tiny_run(out, "optim.max_steps=1", heldout))
    monkeypatch.setattr("specdistill.modeling.models.load_model", lambda *a, **k: pytest.fail("refused before loading"))
    for name in ("result.json", "config.yaml", "metrics.jsonl", "train_log.jsonl", "checkpoints"):
        users = tmp_path / f"users-{name}"
        users.write_text("the user's\n")
        (out / name).rename(tmp_path / f"ours-{name}")
        (out / name).symlink_to(users)
        assert main(["distill", *tiny_run.overrides(out, "optim.max_steps=2", heldout)]) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("specdistill: error: ") and str(out / name) in last and "symbolic link" in last, last
        assert users.read_text() == "the user's\n"
        (out / name).unlink()
        (tmp_path / f"ours-{name}").rename(out / name)


def test_the_run_directorys_writers_replace_a_link_or_refuse_it_never_write_through(tiny_run, tmp_path):
    """What a run replaces (result.json, config.yaml, reports, serving.json: `paths.atomic_write_*`) renames over a
    link; what it appends to (`paths.open_append`) refuses one, dangling too."""
    from specdistill import paths
    from specdistill.distill.distill_recipe import save_config

    users = tmp_path / "users.txt"
    users.write_text("mine")
    for write in (lambda p: save_config(tiny_run(tmp_path / "o"), p), lambda p: paths.atomic_write_json(p, {"a": 1}),
                  lambda p: paths.atomic_write_text(p, "new")):
        link = tmp_path / "out.file"
        link.unlink(missing_ok=True)
        link.symlink_to(users)
        write(link)
        assert users.read_text() == "mine" and not link.is_symlink() and link.read_text() != "mine"
    for target in (users, tmp_path / "gone"):
        log = tmp_path / "log.jsonl"
        log.unlink(missing_ok=True)
        log.symlink_to(target)
        with pytest.raises(paths.UnsafeFileError, match=f"{log} is a symbolic link"):
            paths.open_append(log)
        assert users.read_text() == "mine" and not (tmp_path / "gone").exists()
