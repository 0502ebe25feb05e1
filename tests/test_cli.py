"""The console script without a model: its parsers, its dispatch and its exit codes (each test well under a second)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest

from specdistill.cli import build_parser, main
from specdistill.cli.flows import cmd_demo_target_update, cmd_nightly
from specdistill.pipeline.nightly_recipe import DEMO_RECIPE

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _wide_help(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # help text unwrapped, so that names are not split at hyphens


def _handler_parsers(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()):
    """(command words, parser) for every parser that runs a handler."""
    if parser.get_default("func") is not None:
        yield words, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _handler_parsers(sub, (*words, name))


def _one_json(capsys) -> dict:
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1, out
    payload = json.loads(out)
    assert isinstance(payload, dict)
    return payload


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_help_lists_every_command_and_demo_target_update(capsys):
    top = _help([], capsys)
    for command in ("vocab", "draft", "ingest", "logs", "generate", "bench", "distill", "pipeline", "demo", "target",
                    "monitor", "serving"):
        assert f"    {command} " in top
    assert "demo target-update" in top
    demo = _help(["demo"], capsys)
    assert "target-update" in demo and "run" in demo
    update = _help(["demo", "target-update"], capsys)
    assert "--top-layers" in update and "--threads" in update


def test_every_handler_documents_an_example_that_parses_to_it():
    commands = list(_handler_parsers(build_parser()))
    assert len(commands) == 23  # draft import, draft export, logs prune and logs forget among them
    for words, parser in commands:
        handler = parser.get_default("func")
        assert handler.__annotations__["return"] == "int", handler
        assert parser.epilog.startswith("example: specdistill "), words
        argv = shlex.split(parser.epilog.removeprefix("example: specdistill "))
        assert tuple(argv[: len(words)]) == words, (words, argv)
        assert build_parser().parse_args(argv).func is handler, argv


def test_demo_target_update_is_an_ordinary_subcommand():
    args = build_parser().parse_args(["demo", "target-update", "--steps", "3", "--json"])
    assert args.func is cmd_demo_target_update and (args.steps, args.top_layers, args.base, args.json) == (3, 4, "demo", True)


@pytest.fixture
def fake_nightly(monkeypatch):
    """flows.nightly.nightly replaced: records its arguments, returns a result shaped like the flow's."""
    calls = []

    from specdistill.ops.policy import GateVerdict
    from specdistill.ops.registry import RegisteredDraft
    from specdistill.pipeline.outputs import NightlyRun, TargetInfo
    from specdistill.pipeline.stages.choose_mode import ServingDecision

    def nightly(config_path=None, overrides=None):
        calls.append((config_path, list(overrides)))
        return NightlyRun(TargetInfo("demo", "/t", "fp", 30, 64, "float32"), "w", None, None, {}, GateVerdict(False),
                          RegisteredDraft("draft", "3", "run", "models:/draft/3"), None,
                          ServingDecision(mode="off", reason="nothing beats it", measured={}, measured_on="harness", gamma=4),
                          "| drafter |\nregistered: `draft` version 3 (alias `challenger`)\nchampion unchanged")

    monkeypatch.setitem(sys.modules, "flows.nightly", types.SimpleNamespace(nightly=nightly))
    return calls


@pytest.mark.parametrize("argv, config_path, overrides", [
    (["demo"], str(DEMO_RECIPE), []),
    (["demo", "train.optim.max_minutes=2"], str(DEMO_RECIPE), ["train.optim.max_minutes=2"]),
    (["demo", "run", "train.optim.max_minutes=2", "window.days=2"], str(DEMO_RECIPE), ["train.optim.max_minutes=2", "window.days=2"]),
    (["demo", "generation.backend=harness"], str(DEMO_RECIPE), ["generation.backend=harness"]),  # over the recipe's
    (["pipeline", "run", "train.optim.max_minutes=2"], None, ["train.optim.max_minutes=2"]),
])
def test_demo_and_pipeline_run_are_one_path(fake_nightly, capsys, argv, config_path, overrides):
    """One flow; the demo runs its recipe (deploy/nightly/demo.yaml), the user's overrides over it."""
    assert build_parser().parse_args(argv).func is cmd_nightly
    assert main(argv) == 0
    assert fake_nightly == [(config_path, overrides)]
    out = capsys.readouterr().out
    assert out.count("registered: `draft` version 3") == 1  # the report, once
    assert out.rstrip().endswith("serving.json")


@pytest.mark.parametrize("argv", [["demo", "--json", "train.optim.max_minutes=2"], ["demo", "train.optim.max_minutes=2", "--json"],
                                  ["demo", "--json"]])
def test_demo_json_before_or_after_the_overrides(fake_nightly, capsys, argv):
    assert main(argv) == 0
    assert _one_json(capsys)["registered"]["version"] == "3"


def test_demo_bad_key_fails_before_the_flow(fake_nightly, capsys):
    assert main(["demo", "train.max_minuts=2"]) == 2
    assert "train.max_minuts" in capsys.readouterr().err and fake_nightly == []


def test_logs_on_an_empty_store(tmp_path, capsys):
    from specdistill.data.logstore import LogStore

    db = f"sqlite:///{tmp_path / 'logs.db'}"
    LogStore(db).close()  # a writer creates it; the read commands below never do
    assert main(["logs", "stats", "--db", db, "--json"]) == 0
    assert _one_json(capsys)["conversations"] == 0
    assert main(["logs", "quarantine", "--db", db, "--json"]) == 0
    assert _one_json(capsys) == {"records": [], "shown": 0, "total": 0}
    assert main(["logs", "quarantine", "--db", db]) == 0
    assert capsys.readouterr().out.strip() == "quarantine is empty"


def test_serving_show_without_a_config_exits_1(tmp_path, capsys):
    assert main(["serving", "show", "--path", str(tmp_path / "none.json")]) == 1
    assert "no serving config" in capsys.readouterr().out
    assert main(["serving", "show", "--json"]) == 1
    assert _one_json(capsys)["config"] is None


def test_target_history_when_none_registered(capsys):
    assert main(["target", "history", "--json"]) == 0
    assert _one_json(capsys) == {"versions": []}
    assert main(["target", "history"]) == 0
    assert capsys.readouterr().out.strip() == "no target registered"


def test_distill_bad_key_is_a_named_error(capsys):
    assert main(["distill", "data.path=x.jsonl", "loss.temprature=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdistill: error:") and "loss.temprature" in err


def test_python_dash_m_runs_the_cli():
    proc = subprocess.run([sys.executable, "-m", "specdistill.cli", "demo", "--help"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "target-update" in proc.stdout


def test_bench_needs_exactly_one_prompt_source_and_both_commands_take_a_dtype(capsys):
    from specdistill.cli.decode import DTYPE_CHOICES
    from specdistill.modeling.models import DTYPE_CHOICES as MODEL_DTYPES

    assert DTYPE_CHOICES == MODEL_DTYPES
    for argv in (["bench", "--ngram"], ["bench", "--ngram", "--prompts", "p.txt", "--from-logs", "eval"]):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(argv)
        assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "one of the arguments --prompts --from-logs is required" in err and "not allowed with argument" in err
    assert build_parser().parse_args(["bench", "--ngram", "--from-logs", "eval"]).dtype == "auto"
    assert build_parser().parse_args(["generate", "--prompt", "hi", "--dtype", "bfloat16"]).dtype == "bfloat16"


@pytest.mark.parametrize("extra, message", [
    (["--engine", "openai"], "--engine openai needs --url (the speculative server) and --baseline-url"),
    (["--engine", "llamacpp", "--self-spec", "4"], "--engine llamacpp measures --draft"),
    (["--engine", "llamacpp", "--ngram", "--turns", "all"], "measures first turns of a --prompts file"),
    (["--engine", "llamacpp", "--ngram", "--temperature", "0.7"], "greedy decoding only"),
])
def test_bench_engine_errors_name_the_cause(tmp_path, capsys, extra, message):
    prompts = tmp_path / "p.txt"
    prompts.write_text("Name three colors.\n")
    assert main(["bench", "--prompts", str(prompts), *extra]) == 2
    assert message in capsys.readouterr().err


def test_tree_width_is_for_model_drafters():
    """--tree-width reaches a model drafter (here the target's early exit); n-gram lookup drafts a chain."""
    from specdistill.cli.decode import _drafter
    from tests.conftest import make_tiny_llama

    target = make_tiny_llama(vocab_size=32, hidden=16, layers=3, seed=0)
    ask = lambda **kw: argparse.Namespace(**{"draft": None, "self_spec": None, "ngram": False, "ngram_min": 1,  # noqa: E731
                                             "ngram_max": 3, "tree_width": 3, **kw})
    assert _drafter(ask(self_spec=1), target).tree_width == 3
    with pytest.raises(ValueError, match="only a model drafter drafts a tree"):
        _drafter(ask(ngram=True), target)


# --------------------------------------------------------------------------------------------
# first contact: every --help, numeric arguments, database URLs


def _all_parsers(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()):
    """(command words, parser) for every parser, groups included."""
    yield words, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _all_parsers(sub, (*words, name))


def test_every_subcommand_help_works(capsys):
    """A literal % in a help string crashed `monitor --help` (ValueError: incomplete format)."""
    walked = list(_all_parsers(build_parser()))
    assert len(walked) > 25 and ("monitor",) in [w for w, _ in walked]
    for words, _ in walked:
        text = _help(list(words), capsys)
        assert "usage:" in text, words
    assert "below 50%" in _help(["monitor"], capsys)


@pytest.mark.parametrize("argv, message", [
    (["bench", "--ngram", "--prompts", "p.txt", "--repeats", "0"], "--repeats: must be 1 to 1000, got 0"),
    (["bench", "--ngram", "--prompts", "p.txt", "--max-new-tokens", "0"], "--max-new-tokens: must be 1 to"),
    (["generate", "--ngram", "--prompt", "x", "--gamma", "-1"], "--gamma: must be 1 to 64"),
    # counts that size memory or work have an upper bound too (specdistill.bounds)
    (["generate", "--ngram", "--prompt", "x", "--gamma", "1000000000"], "--gamma: must be 1 to 64, got 1000000000"),
    (["generate", "--prompt", "x", "--threads", "99999"], "--threads: 99999: must be 1 to"),
    (["generate", "--draft", "d", "--prompt", "x", "--tree-width", "100000"], "--tree-width: must be 1 to 64"),
    (["generate", "--prompt", "x", "--max-new-tokens", "1000000000"], "--max-new-tokens: must be 1 to 32768"),
    (["generate", "--prompt", "x", "--seed", "-1"], "--seed: must be 0 to 4294967295"),
    (["generate", "--ngram", "--prompt", "x", "--ngram-max", "100000"], "--ngram-max: must be 1 to 64"),
    (["bench", "--ngram", "--prompts", "p.txt", "--repeats", "1000000"], "--repeats: must be 1 to 1000"),
    (["monitor", "sample", "--draft", "d", "--gamma", "1000000000"], "--gamma: must be 1 to 64"),
    (["demo", "target-update", "--top-layers", "1000000"], "--top-layers: must be 1 to 1024"),
    (["generate", "--ngram", "--prompt", "x", "--top-p", "0"], "--top-p: must be in (0, 1]"),
    (["generate", "--ngram", "--prompt", "x", "--temperature", "nan"], "--temperature: must be in"),
    (["monitor", "serve", "--interval", "0"], "--interval: must be in [0.1"),
    (["monitor", "serve", "--port", "0"], "--port: must be at least 1"),
    (["monitor", "sample", "--draft", "d", "--n", "0"], "--n: must be 1 to"),
    (["demo", "target-update", "--steps", "0"], "--steps: must be 1 to"),
    (["draft", "init", "--draft-vocab", "0", "out"], "--draft-vocab: must be 1 to"),
])
def test_numeric_arguments_are_checked_while_parsing(argv, message, capsys, monkeypatch):
    import specdistill.modeling.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("no model loads for a bad argument"))
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_ngram_window_is_checked_before_the_model_loads(capsys, monkeypatch):
    import specdistill.modeling.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("no model loads for a bad argument"))
    assert main(["generate", "--ngram", "--prompt", "x", "--ngram-min", "3", "--ngram-max", "2"]) == 2
    assert "--ngram-max 2 is below --ngram-min 3" in capsys.readouterr().err


@pytest.mark.parametrize("port, host, message", [
    ("70000", "127.0.0.1", "port 70000 is not a TCP port"),
    ("9464", "no such host!", "host 'no such host!' is not an address"),
])
def test_monitor_serve_refuses_a_bad_address_in_one_line(port, host, message, tmp_path, capsys):
    from specdistill.data.logstore import LogStore

    db = f"sqlite:///{tmp_path / 'logs.db'}"
    LogStore(db).close()
    assert main(["monitor", "serve", "--db", db, "--port", port, "--host", host]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_monitor_serve_on_a_port_in_use_is_a_clear_error(tmp_path, capsys):
    import socket

    from specdistill.data.logstore import LogStore

    db = f"sqlite:///{tmp_path / 'logs.db'}"
    LogStore(db).close()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["monitor", "serve", "--db", db, "--port", str(port), "--interval", "1"]) == 2
    assert f"cannot serve metrics on 127.0.0.1:{port}" in capsys.readouterr().err


@pytest.mark.parametrize("url, message", [
    ("notaurl", "not a database URL: 'notaurl'"),
    ("mysql://u:secret@127.0.0.1/x", "unsupported database 'mysql'"),
    ("postgresql://u:secret@127.0.0.1:1/x", "cannot open log store postgresql://u:***@127.0.0.1:1/x"),
    ("postgresql+psycopg://127.0.0.1:1/x?password=secret", "postgresql+psycopg://127.0.0.1:1/x?password=***"),
    ("postgresql+psycopg://127.0.0.1:1/x?user=a&password=secret", "password=***"),
    ("postgresql://u:secret@127.0.0.1:notaport/x",
     "not a database URL: 'postgresql://u:***@127.0.0.1:notaport/x': its port is not a number ('notaport')"),
])
def test_database_urls_are_checked_in_one_line(url, message, capsys):
    assert main(["logs", "stats", "--db", url]) == 2
    err = capsys.readouterr().err
    assert message in err and "secret" not in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_read_only_log_store_is_one_line_without_sql_or_traffic(tmp_path, capsys):
    from specdistill.data.logstore import LogStore

    db = tmp_path / "logs.db"
    LogStore(f"sqlite:///{db}").close()
    traffic = tmp_path / "t.jsonl"
    traffic.write_text(json.dumps({"prompt": "private question", "response": "private answer"}) + "\n")
    read_only = [f"sqlite:///file:{db}?mode=ro&uri=true"]  # refused to root too
    if os.geteuid() != 0:
        db.chmod(0o400)
        read_only.append(f"sqlite:///{db}")
    for url in read_only:
        assert main(["ingest", str(traffic), "--format", "jsonl", "--db", url, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("specdistill: error: log store sqlite:///") and "readonly database" in err
        assert len(err.strip().splitlines()) == 1 and "INSERT" not in err and "private" not in err
    assert not (tmp_path / "file:").exists()  # a SQLite URI is opened by SQLite, never created as a path


def test_a_missing_sqlite_file_is_an_error_for_readers_and_created_by_writers(tmp_path, capsys):
    missing = tmp_path / "no" / "dir" / "x.db"
    for argv in (["logs", "stats"], ["logs", "quarantine"], ["monitor", "serve", "--interval", "1"]):
        assert main([*argv, "--db", f"sqlite:///{missing}"]) == 2
        assert f"{missing} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()  # nothing created by a reader
    assert main(["logs", "stats", "--db", f"sqlite:///{tmp_path}"]) == 2
    assert "is a directory" in capsys.readouterr().err
    traffic = tmp_path / "t.jsonl"
    traffic.write_text(json.dumps({"prompt": "hi", "response": "hello"}) + "\n")
    assert main(["ingest", str(traffic), "--format", "jsonl", "--db", f"sqlite:///{missing}", "--no-progress"]) == 0
    assert missing.is_file() and (missing.stat().st_mode & 0o777) == 0o600  # it holds traffic: the owner only


def test_distill_config_that_is_a_directory_or_binary_is_named(tmp_path, capsys):
    assert main(["distill", "--config", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path} is a directory" in err and "Traceback" not in err
    binary = tmp_path / "config.yaml"
    binary.write_bytes(b"target: demo\n\xff\xfe\x00")
    assert main(["distill", "--config", str(binary)]) == 2
    err = capsys.readouterr().err
    assert str(binary) in err and "not a text (UTF-8) YAML file" in err
    for argv in (["pipeline", "run", "--config", str(tmp_path)], ["monitor", "run", "--config", str(binary)]):
        assert main(argv) == 2
        assert str(tmp_path) in capsys.readouterr().err


@pytest.mark.parametrize("argv, module, name", [(["monitor", "run"], "flows.monitor", "monitor"),
                                                (["pipeline", "run"], "flows.nightly", "nightly")])
def test_a_signal_during_a_flow_is_one_line_and_exit_128_plus_signal(argv, module, name, monkeypatch, capsys):
    import signal
    import time

    def flow(**parameters):
        os.kill(os.getpid(), signal.SIGTERM)  # as `kill PID` or a service manager's stop would
        time.sleep(5)
        raise AssertionError("the signal should have stopped the flow")

    monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(**{name: flow}))
    before = signal.getsignal(signal.SIGTERM)
    assert main(argv) == 128 + signal.SIGTERM
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"specdistill: the {name} flow stopped by SIGTERM: its flow runs are marked Crashed and nothing is "
                   "half-written; run the same command again to resume from the finished stages"]
    assert signal.getsignal(signal.SIGTERM) is before  # the command's handlers are its own, only while the flow runs
    assert main([*argv, "--json"]) == 128 + signal.SIGTERM  # and with --json, one object on stdout says so
    stopped = _strict_json(capsys.readouterr().out)
    assert stopped["exit_code"] == 128 + signal.SIGTERM and "stopped by SIGTERM" in stopped["error"]


def _strict_json(text: str):
    """One JSON object as the standard reads it: NaN and Infinity are not JSON."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    value = json.loads(text, parse_constant=refuse)
    assert isinstance(value, dict)
    return value


@pytest.mark.parametrize("argv, error", [
    (["serving", "show", "--path", "BAD", "--json"], "corrupt serving config"),  # a library refusal (ValueError)
    (["--GAMMA--"], "--gamma: must be 1 to 64"),  # argparse's own usage error, --json anywhere on the line
    (["distill", "--json", "data.path=x.jsonl", "optim.lr=inf"], "optim.lr"),  # a config refusal before any work
])
def test_json_on_an_error_prints_one_json_object_naming_it(argv, error, tmp_path, capsys):
    bad = tmp_path / "serving.json"
    bad.write_text("{not json")
    if argv == ["--GAMMA--"]:
        argv = ["generate", "--json", "--ngram", "--prompt", "x", "--gamma", "0"]
    argv = [str(bad) if a == "BAD" else a for a in argv]
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    out, err = capsys.readouterr()
    payload = _strict_json(out)
    assert error in payload["error"] and payload["exit_code"] == 2 and out.count("\n") == 1
    assert error in err  # and the sentence for a person, on stderr


def test_json_output_is_strict_json_a_nan_is_null(capsys):
    from specdistill.cli.common import emit

    emit(argparse.Namespace(json=True), {"loss": float("nan"), "curve": [{"tau": float("inf")}, {"tau": 1.5}]}, "text")
    assert _strict_json(capsys.readouterr().out) == {"loss": None, "curve": [{"tau": None}, {"tau": 1.5}]}


@pytest.mark.parametrize("code, words", [(28, "no space left on device"), (27, "file too large"), (30, "read-only"),
                                         (13, "permission denied")])
def test_an_os_error_is_one_sentence_naming_the_path(code, words, capsys, monkeypatch):
    import specdistill.cli.ops as ops

    def fails(args):
        raise OSError(code, os.strerror(code), "/somewhere/file.json")

    monkeypatch.setattr(ops, "cmd_serving_show", fails)
    assert main(["serving", "show", "--json"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("specdistill: error: /somewhere/file.json: ") and words in err.lower() and err.count("\n") == 1
    assert "Traceback" not in err and words in _strict_json(out)["error"].lower()


@pytest.mark.parametrize("fails", [False, True])
def test_json_stdout_holds_the_one_object_whatever_a_library_or_child_writes_there(fails, capfd, monkeypatch):
    """A monitor run that retrained printed nothing parseable: something on its way (MLflow's run links, a
    child process) wrote to stdout first. With --json, stdout is the one object, at the file descriptor."""
    import specdistill.cli.ops as ops
    from specdistill.cli.common import emit

    def noisy(args):
        print("a library's print")
        sys.stdout.write("🏃 View run at: http://127.0.0.1\n")
        subprocess.run([sys.executable, "-c", "print('a child process on fd 1')"], check=True)
        os.write(1, b"a C library on fd 1\n")
        if fails:
            raise ValueError("the command failed after all that")
        emit(args, {"mode": "ngram"}, "text")
        return 0

    monkeypatch.setattr(ops, "cmd_serving_show", noisy)
    assert main(["serving", "show", "--json"]) == (2 if fails else 0)
    out, err = capfd.readouterr()
    payload = _strict_json(out)
    assert payload == ({"error": "the command failed after all that", "exit_code": 2} if fails else {"mode": "ngram"})
    assert all(noise in err for noise in ("a library's print", "View run", "a child process", "a C library"))
    print("after the command")  # stdout is stdout again
    assert capfd.readouterr().out == "after the command\n"


def _run_read_only(home: Path, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`specdistill ARGV` with the state directory read-only: its mode for a user, a read-only mount for root
    (which writes through any mode), in a mount namespace of its own."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPECDISTILL_HOME": str(home)}
    command = [sys.executable, "-m", "specdistill.cli", *argv]
    if os.geteuid() == 0:
        script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
        command = ["unshare", "-m", "sh", "-c", script, str(home), *command]
    return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=240)


def test_a_read_only_state_directory_is_named_as_such(tmp_path):
    """`unable to open database file` (the log store) and raw OSError tracebacks (the state lock, the model
    cache) became one sentence saying the state directory is read-only, and which path."""
    home = tmp_path / "home"
    traffic = tmp_path / "t.jsonl"
    traffic.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPECDISTILL_HOME": str(home)}
    subprocess.run([sys.executable, "-m", "specdistill.cli", "ingest", str(traffic), "--format", "openai"], env=env,
                   check=True, capture_output=True, cwd=tmp_path)
    if os.geteuid() == 0 and subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("root without mount namespaces: no way to make a directory read-only")
    from tests.conftest import save_tiny_target

    target = save_tiny_target(tmp_path / "target")
    if os.geteuid() != 0:
        home.chmod(0o555)
    try:
        for argv in (["ingest", str(traffic), "--format", "openai"], ["pipeline", "run"],
                     ["monitor", "sample", "--draft", "d", "--n", "1"], ["target", "register", str(target), "--no-event"]):
            proc = _run_read_only(home, argv, tmp_path)
            last = proc.stderr.strip().splitlines()[-1]
            assert proc.returncode == 2 and "Traceback" not in proc.stderr, (argv, proc.stderr[-2000:])
            assert last.startswith("specdistill: error: ") and "read-only" in last and str(home) in last, (argv, last)
    finally:
        home.chmod(0o711)


def test_the_command_line_names_one_drafter_spec(tmp_path):
    """`--draft`, `--self-spec`, `--ngram` and `--suffix` become one spec, built by its kind as everywhere else."""
    from specdistill.cli.decode import drafter_spec

    def spec(*words: str):
        return drafter_spec(build_parser().parse_args(["generate", "--target", "demo", "--prompt", "x", *words]))

    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    assert spec() is None
    assert str(spec("--draft", "runs/draft")) == "draft_model:runs/draft"
    assert str(spec("--draft", str(head))) == f"eagle3:{head}"  # a head's directory is its own kind
    assert str(spec("--self-spec", "4")) == "self-spec:4"
    assert str(spec("--ngram", "--ngram-min", "2", "--ngram-max", "5")) == "ngram:2,5"
    suffix = spec("--suffix", "c.bin", "--tree-width", "3")
    assert str(suffix) == "suffix:c.bin" and suffix.tree_width == 3
    assert str(spec("--self-spec", "2", "--suffix", "c.bin", "--hybrid-threshold", "1.5")) == "hybrid:self-spec:2,c.bin,1.5"
    assert spec("--draft", str(head), "--suffix", "c.bin").path == str(head)
    with pytest.raises(ValueError, match="choose one drafting method, got --ngram and --suffix"):
        spec("--ngram", "--suffix", "c.bin")


def test_ctrl_c_mid_ingest_is_one_sentence_and_one_json_object_and_the_same_command_resumes(tmp_path):
    """Ctrl-C printed a KeyboardInterrupt traceback, and with --json no object."""
    import signal
    import sqlite3
    import time

    path = tmp_path / "big.jsonl"
    with path.open("w") as f:
        for i in range(60_000):
            f.write(json.dumps({"prompt": f"prompt {i}", "response": f"response {i}"}) + "\n")
    db = tmp_path / "logs.db"
    command = [sys.executable, "-m", "specdistill.cli", "ingest", str(path), "--format", "jsonl", "--db",
               f"sqlite:///{db}", "--json"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPECDISTILL_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:  # until its first batch is committed
        try:
            with sqlite3.connect(db) as conn:
                if conn.execute("SELECT count(*) FROM conversations").fetchone()[0]:
                    break
        except sqlite3.Error:
            pass
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "interrupted" in err and "run the same command again" in err and "big.jsonl" in err
    assert json.loads(out)["exit_code"] == 130 and "interrupted" in json.loads(out)["error"]
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT status FROM ingest_runs").fetchall() == [("interrupted",)]
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM conversations").fetchone()[0] == 60_000


def test_terminal_escapes_from_files_and_users_are_shown_escaped_in_every_human_output(tmp_path, capsys):
    """A file name, a served name or a reason holding ESC (or a bidi override) reached the terminal raw."""
    from specdistill.cli.common import printable

    evil = "x\x1b]0;owned\x07\x1b[2J\u202egnp.\x9b"
    path = tmp_path / f"log{evil[:12]}.jsonl"
    path.write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n"
                    + json.dumps({"prompt": "p2", "response": 5, "system": None}) + "\n")
    db = f"sqlite:///{tmp_path / 'logs.db'}"
    for argv in (["ingest", str(path), "--format", "jsonl", "--db", db, "--no-progress"], ["logs", "stats", "--db", db],
                 ["logs", "quarantine", "--db", db]):
        assert main(argv) == 0
        out, err = capsys.readouterr()
        assert not set("\x1b\x07\u202e\x9b") & set(out + err), (argv, out)
        assert "\\x1b" in out, (argv, out)
        assert main([*argv, "--json"]) == 0  # JSON output escapes them itself
        out = capsys.readouterr().out
        assert "\x1b" not in out and json.loads(out)
    assert printable(evil) == "x\\x1b]0;owned\\x07\\x1b[2J\\u202egnp.\\x9b" and printable("a\nb\tc") == "a\nb\tc"
    assert main(["logs", "stats", "--db", f"sqlite:///{tmp_path}/no\x1b[2J.db"]) == 2  # an error sentence too
    assert "\x1b" not in capsys.readouterr().err
