"""One run at a time per state directory (`specdistill.state_lock`): a second process is refused at once and
told which process holds the state; the process holding it may take it again (the monitor's nightly)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specdistill import paths
from specdistill.cli import main
from specdistill.state_lock import StateBusyError, state_lock

REPO = Path(__file__).resolve().parents[1]
HOLDER = textwrap.dedent("""
    import sys, time
    from specdistill.state_lock import state_lock
    with state_lock("pipeline run"):
        print("held", flush=True)
        time.sleep(120)
""")


@pytest.fixture
def held_elsewhere():
    """Another process holding this test's state directory; its pid."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_second_process_is_refused_and_told_which_holds_the_state(held_elsewhere):
    with pytest.raises(StateBusyError) as caught:
        with state_lock("monitor"):
            pytest.fail("two processes held one state directory")
    message = str(caught.value)
    assert f"process {held_elsewhere.pid} " in message and "(pipeline run, since " in message
    assert str(paths.home()) in message and "SPECDISTILL_HOME" in message
    held_elsewhere.kill()  # SIGKILL: the kernel releases the lock with the process
    held_elsewhere.wait()
    with state_lock("monitor"):
        pass


def test_the_holder_may_take_it_again_and_releases_it_once_done():
    with state_lock("monitor"), state_lock("nightly-distill"):  # the monitor's incremental run, in its process
        code = "from specdistill.state_lock import state_lock\nwith state_lock('x'): pass"
        proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                              capture_output=True, text=True)
        assert proc.returncode != 0 and f"in use by process {os.getpid()} " in proc.stderr and "(monitor," in proc.stderr
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("argv", [["pipeline", "run"], ["demo"], ["monitor", "run"], ["distill", "data.path=x.jsonl", "OUT"],
                                  ["demo", "target-update"]])
def test_every_command_that_writes_the_state_refuses_while_another_runs(argv, held_elsewhere, capsys, monkeypatch):
    monkeypatch.setattr("specdistill.modeling.models.load_model", lambda *a, **k: pytest.fail("refused before loading"))
    argv = [f"out_dir={paths.home() / 'runs' / 'd'}" if a == "OUT" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"is in use by process {held_elsewhere.pid} " in err and err.count("\n") == 1, err


def test_a_distillation_outside_the_state_directory_runs_beside_it(held_elsewhere, tmp_path, monkeypatch):
    from specdistill.distill.train import claim_out_dir  # what runs first under the lock

    monkeypatch.setattr("specdistill.distill.train._train", lambda *a, **k: "trained")
    from specdistill.distill.distill_recipe import load_config
    from specdistill.distill.train import distill

    assert distill(load_config(None, ["data.path=x.jsonl", f"out_dir={tmp_path / 'out'}", "device=cpu"])) == "trained"
    assert claim_out_dir(tmp_path / "out") is True


@pytest.mark.parametrize("dangling", [False, True])
def test_a_symlink_as_the_state_lock_is_refused_and_the_users_file_is_untouched(tmp_path, dangling, capsys):
    """Round four: a link at state.lock had the user's file truncated, overwritten and chmod-ed 0600; a dangling
    one said `[Errno 2]`."""
    users = tmp_path / "notes.txt"
    if not dangling:
        users.write_text("years of notes")
        users.chmod(0o644)
    lock = paths.ensure(paths.home()) / "state.lock"
    lock.symlink_to(users)
    with pytest.raises(ValueError, match="symbolic link"):
        with state_lock("distill"):
            pytest.fail("the lock was taken through a link")
    if dangling:
        assert not users.exists()
    else:
        assert users.read_text() == "years of notes" and users.stat().st_mode & 0o777 == 0o644
    argv = ["distill", "data.path=x.jsonl", f"out_dir={paths.home() / 'runs' / 'd'}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(lock) in err and "symbolic link" in err and "Errno" not in err, err
    assert lock.is_symlink()  # left for the user to look at; nothing was written through it
