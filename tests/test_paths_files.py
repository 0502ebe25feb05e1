"""Reading and writing one file (`specdistill.paths.files`): never through a link we did not make, never
blocked on a FIFO, never a huge or endlessly nested file read whole without naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specdistill import paths
from specdistill.cli import main

REPO = Path(__file__).resolve().parents[1]


def _cli(argv: list[str], tmp_path: Path, timeout: float = 90) -> subprocess.CompletedProcess:
    """The command line in a process of its own: a read that blocks is a timeout here, not a hung test run."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        return subprocess.run([sys.executable, "-m", "specdistill.cli", *argv], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{argv} blocked for {timeout} s")


def _one_sentence(err: str) -> str:
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith("specdistill: error: "), err[-2000:]
    return last


def test_a_fifo_as_a_config_file_is_refused_not_waited_on(tmp_path):
    """Round four: `--config FIFO` blocked forever (the read waited for a writer)."""
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    for argv in (["distill", "--config", str(fifo)], ["pipeline", "run", "--config", str(fifo)],
                 ["monitor", "run", "--config", str(fifo)]):
        proc = _cli(argv, tmp_path)
        last = _one_sentence(proc.stderr)
        assert proc.returncode == 2 and str(fifo) in last and "FIFO" in last and "not a regular file" in last, last


@pytest.mark.parametrize("kind", ["directory", "FIFO", "character device"])
def test_ingest_of_what_is_not_a_regular_file_says_what_it_is(tmp_path, capsys, kind):
    """Round four: `ingest` of a directory, a FIFO or /dev/zero said "no such file"."""
    if kind == "directory":
        path = tmp_path / "logs"
        path.mkdir()
    elif kind == "FIFO":
        path = tmp_path / "logs.jsonl"
        os.mkfifo(path)
    else:
        path = Path("/dev/zero")
    for fmt in ("openai", "sharegpt", "jsonl"):
        assert main(["ingest", str(path), "--format", fmt]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(path) in err and kind in err and "no such file" not in err, err
    with pytest.raises(ValueError, match=kind):
        from specdistill.data.readers import read_records

        list(read_records(path, "openai"))


def test_a_prompts_file_or_traffic_that_is_a_fifo_is_refused(tmp_path):
    from specdistill.data.prompt_files import PromptFileError, read_prompt_file
    from specdistill.distill.examples import read_examples

    fifo = tmp_path / "prompts.txt"
    os.mkfifo(fifo)
    with pytest.raises(PromptFileError, match="FIFO"):
        read_prompt_file(fifo)
    with pytest.raises(ValueError, match="FIFO"):
        read_examples(str(fifo), "generated", None, 16)
    with pytest.raises(paths.UnsafeFileError, match="character device"):
        paths.check_regular("/dev/zero", "traffic file")


def test_a_huge_serving_config_is_refused_by_its_size_before_it_is_read(tmp_path, capsys):
    """Round four: a 1 GB serving.json was read whole (1.3 GB RSS) before "corrupt"."""
    serving = paths.ensure(paths.home()) / "serving.json"
    with open(serving, "wb") as f:
        f.truncate(1 << 30)  # sparse: no disk, the size is what counts
    started = time.perf_counter()
    assert main(["serving", "show"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(serving) in err and "1.0 GiB" in err and "more than" in err, err
    assert time.perf_counter() - started < 5
    history = paths.home() / "targets.json"
    with open(history, "wb") as f:
        f.truncate(1 << 30)
    assert main(["target", "history"]) == 2
    err = capsys.readouterr().err
    assert str(history) in err and "more than" in err, err
    config = tmp_path / "big.yaml"
    with open(config, "wb") as f:
        f.truncate(1 << 30)
    assert main(["distill", "--config", str(config)]) == 2
    assert str(config) in (err := capsys.readouterr().err) and "more than" in err, err


def test_json_nested_too_deep_names_the_file(tmp_path, capsys):
    """Round four: a serving.json nested 100,000 deep said "maximum recursion depth exceeded", no file named."""
    deep = "[" * 100_000 + "]" * 100_000
    serving = paths.ensure(paths.home()) / "serving.json"
    serving.write_text(deep)
    assert main(["serving", "show"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(serving) in err and "nested too deep" in err and "recursion" not in err, err
    serving.unlink()
    history = paths.home() / "targets.json"
    history.write_text('{"versions": ' + deep + "}")
    assert main(["target", "history"]) == 2
    err = capsys.readouterr().err
    assert str(history) in err and "nested too deep" in err, err
    config = tmp_path / "deep.yaml"
    config.write_text("target: " + deep)
    assert main(["distill", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert str(config) in err and "nested too deep" in err and "recursion" not in err, err
    with pytest.raises(ValueError, match=f"corrupt record {tmp_path / 'r.json'}: nested too deep"):
        (tmp_path / "r.json").write_text(deep)
        paths.read_json(tmp_path / "r.json", "record")


def test_a_serving_config_written_over_a_link_replaces_the_link_not_the_users_file(tmp_path):
    from specdistill.ops.serving import ServingConfig, read_serving_config, write_serving_config

    users = tmp_path / "users.json"
    users.write_text('{"mine": true}')
    serving = paths.ensure(paths.home()) / "serving.json"
    serving.symlink_to(users)
    write_serving_config(ServingConfig("off", num_speculative_tokens=0))
    assert json.loads(users.read_text()) == {"mine": True} and not serving.is_symlink()
    assert read_serving_config().mode == "off" and serving.stat().st_mode & 0o777 == 0o644
