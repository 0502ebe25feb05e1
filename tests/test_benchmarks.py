"""benchmarks/ is a suite: every maintained script imports, prints its --help, opens with the question it
answers and its command, and has its row in the index that opens benchmarks/README.md. The one-off records
in benchmarks/experiments/ each print their --help against today's library."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
MAINTAINED = sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "common")
EXPERIMENTS = sorted(p.stem for p in (BENCH / "experiments").glob("*.py"))


def docstring(name: str) -> str:
    return ast.get_docstring(ast.parse((BENCH / f"{name}.py").read_text(encoding="utf-8"))) or ""


def index_rows() -> list[str]:
    """The scripts named in the first table of benchmarks/README.md, in order."""
    lines = (BENCH / "README.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| script |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(re.match(r"\| \[`(\w+)\.py`\]", line).group(1))
    return rows


def test_the_suite_is_the_folder_and_the_experiments_stay_apart():
    assert len(MAINTAINED) >= 10 and "demo_nights" in MAINTAINED and "train_throughput" in EXPERIMENTS
    assert not set(MAINTAINED) & set(EXPERIMENTS)


def test_the_readme_opens_with_the_index_of_every_maintained_script():
    readme = (BENCH / "README.md").read_text(encoding="utf-8")
    assert readme.index("| script |") < readme.index("\n## "), "the index comes before the dated records"
    assert sorted(index_rows()) == MAINTAINED


@pytest.mark.parametrize("name", MAINTAINED)
def test_each_docstring_starts_with_its_question_and_its_command(name):
    question, command, *_ = docstring(name).split("\n\n")
    assert "?" in question, f"{name}: the first paragraph asks the question the script answers"
    assert command.strip().startswith(f"python benchmarks/{name}.py"), f"{name}: its command comes second"


@pytest.fixture
def as_a_script(monkeypatch):
    """benchmarks/ first on the path, as `python benchmarks/NAME.py` puts it; its `common` forgotten after."""
    monkeypatch.syspath_prepend(str(BENCH))
    yield
    sys.modules.pop("common", None)


@pytest.mark.parametrize("name", MAINTAINED)
def test_each_script_imports_and_prints_its_help(name, as_a_script, capsys):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and docstring(name).split("?")[0].split()[-1] in out


def test_a_script_runs_as_a_user_runs_it():
    """`python benchmarks/monitor_load.py --help` in a fresh process: `from common import` resolves from the script's folder."""
    out = subprocess.run([sys.executable, str(BENCH / "monitor_load.py"), "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--state" in out.stdout and "monitor run" in out.stdout


def runs_as_module(name: str) -> bool:
    """As benchmarks/experiments/README.md says to run it: as a module when it imports a sibling through
    `benchmarks.` without putting the checkout on the path itself, else by its path."""
    text = (BENCH / "experiments" / f"{name}.py").read_text(encoding="utf-8")
    return "from benchmarks." in text and "sys.path.insert" not in text


# Every experiment's --help, one after another in one fresh interpreter (torch is imported once, not fifteen
# times), each run as `__main__` the way its command line runs it; prints {name: {code, stdout, error}}.
HELP_ALL = """
import contextlib, io, json, runpy, sys, traceback
results = {}
for name, as_module, path in json.loads(sys.argv[1]):
    out, code, error = io.StringIO(), None, ""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [path, "--help"]
    if not as_module:
        sys.path.insert(0, path.rsplit("/", 1)[0])
    try:
        with contextlib.redirect_stdout(out):
            if as_module:
                runpy.run_module("benchmarks.experiments." + name, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        error = traceback.format_exc()[-2000:]
    sys.argv, sys.path[:] = saved_argv, saved_path
    results[name] = {"code": code, "stdout": out.getvalue()[:500], "error": error}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def experiments_help() -> dict[str, dict]:
    jobs = [(name, runs_as_module(name), str(BENCH / "experiments" / f"{name}.py")) for name in EXPERIMENTS]
    done = subprocess.run([sys.executable, "-c", HELP_ALL, json.dumps(jobs)], cwd=BENCH.parent, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_each_experiment_prints_its_help_against_todays_library(name, experiments_help):
    """The one-off records are not run here (several need a state or an engine, all take minutes); each must
    at least import and print its --help, in a fresh interpreter, as its command line runs it."""
    result = experiments_help[name]
    assert result["code"] in (0, None) and not result["error"], result["error"]
    assert result["stdout"].startswith("usage:"), result["stdout"]


def is_module(dotted: str) -> bool:
    try:
        return importlib.util.find_spec(dotted) is not None
    except ModuleNotFoundError:  # a parent that is a module, not a package, or is missing
        return False


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_each_experiment_imports_only_what_the_library_has(name):
    """Its imports from the library, those inside functions too (which --help never reaches), name modules
    and attributes that exist today."""
    tree = ast.parse((BENCH / "experiments" / f"{name}.py").read_text(encoding="utf-8"))
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "specdistill":
            module = importlib.import_module(node.module)
            missing += [f"{node.lineno}: {node.module}.{a.name}" for a in node.names
                        if not hasattr(module, a.name) and not is_module(f"{node.module}.{a.name}")]
        elif isinstance(node, ast.Import):
            missing += [f"{node.lineno}: {a.name}" for a in node.names
                        if a.name.split(".")[0] == "specdistill" and not is_module(a.name)]
    assert not missing, missing
