"""Import policing over the source text (`ast`, nothing is imported or run).

The library's layers form a graph (`MAY_IMPORT`); a module may import its own layer and the layers
that graph puts under it, nothing else:

    base (specdistill/__init__, recipe, acceptance, bounds, paths, state_lock, env, hardware, budget)
      <- data <- modeling
      <- distill | speculative | engines    siblings: none imports another (shared types live below them)
      <- ops (policy, registry, replay) <- pipeline <- cli

Imports inside functions count as much as those at the top of a file. Inside each package the modules
(a subpackage counts as one) import one another without a circle, through imports at the top or inside
functions alike: a circle is broken by moving what both need to the lower module, not hidden in a
function. An import inside a function, of the library or of any other package, says why on its line
or the line above, `# lazy: <reason>` (CLI start-up, an optional or heavy dependency kept off a light
module); every other import is at the top of the module. The library never imports
Prefect, `tasks` or `flows`; the one exception is `specdistill/cli`, which imports `flows.*` lazily to
run a flow. `tasks/` and `flows/` reach the library only through `specdistill.pipeline*`, plus
`specdistill.paths` (tasks/common.py keys Prefect's cache by the state directory); a type they name in an
annotation is imported under `if TYPE_CHECKING:` from the module that defines it. Inside the pipeline,
the stages (`specdistill/pipeline/stages/`, one module or subpackage each) do not import one another, and
nothing else in the pipeline imports a stage: what two stages share lives below them. Size limits: no
module in specdistill/ over MAX_LINES lines, at most MAX_TOP_LEVEL modules directly in specdistill/.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

LAYERS = ["base", "data", "modeling", "distill", "speculative", "engines", "ops", "pipeline", "cli"]
SIBLINGS = ("distill", "speculative", "engines")  # the three things done with models: train, decode, serve
# the layers each layer may import besides its own: the graph, not a line
MAY_IMPORT: dict[str, set[str]] = {
    "base": set(),
    "data": {"base"},
    "modeling": {"base", "data"},
    **{sibling: {"base", "data", "modeling"} for sibling in SIBLINGS},
    "ops": {"base", "data", "modeling", *SIBLINGS},
    "pipeline": {"base", "data", "modeling", *SIBLINGS, "ops"},
    "cli": {"base", "data", "modeling", *SIBLINGS, "ops", "pipeline"},
}
BASE_MODULES = {"recipe", "acceptance", "bounds", "paths", "state_lock", "env", "hardware", "budget"}
ORCHESTRATION_MAY_IMPORT = ("specdistill.pipeline", "specdistill.paths", "specdistill.state_lock")  # for tasks/ and flows/
STAGES = "specdistill.pipeline.stages"  # one module (or subpackage) per stage
MAX_LINES = 400
MAX_TOP_LEVEL = 8  # modules directly in specdistill/, __init__.py not counted
LAZY_REASON = re.compile(r"#\s*lazy:\s*\S")  # `# lazy: <why>` on a function-level import's line or the line above


@dataclass(frozen=True)
class Import:
    file: str  # relative to the root that was scanned
    line: int
    module: str  # absolute dotted name


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _known_submodule(root: Path, dotted: str) -> bool:
    rel = Path(*dotted.split("."))
    return (root / rel).is_dir() or (root / rel).with_suffix(".py").is_file()


def imports_of(root: Path, path: Path) -> list[Import]:
    """Every module `path` imports, anywhere in the file, as absolute dotted names.

    `from pkg import name` counts as importing `pkg.name` when that is a module or package under root;
    relative imports are resolved; `importlib.import_module("literal")` counts too."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    here = module_name(root, path)
    package = here if _is_package(path) else here.rpartition(".")[0]
    rel = str(path.relative_to(root))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(rel, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".") if package else []
                base_parts = base_parts[: len(base_parts) - (node.level - 1)] if node.level > 1 else base_parts
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                candidate = f"{base}.{alias.name}" if base else alias.name
                found.append(Import(rel, node.lineno, candidate if _known_submodule(root, candidate) else base))
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if (name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)):
                found.append(Import(rel, node.lineno, node.args[0].value))
    return found


def layer_of(dotted: str) -> str | None:
    """The layer of a `specdistill` module; None for anything outside the library."""
    parts = dotted.split(".")
    if parts[0] != "specdistill":
        return None
    if len(parts) == 1 or parts[1] in BASE_MODULES:
        return "base"
    if parts[1] in LAYERS:
        return parts[1]
    return f"unlayered:{parts[1]}"


def _sources(root: Path, top: str) -> list[Path]:
    return sorted(p for p in (root / top).rglob("*.py") if "__pycache__" not in p.parts)


def layering_violations(root: Path) -> list[str]:
    """Imports inside the library that the layer graph does not allow (upward, or across siblings), and
    modules that belong to no layer."""
    out = []
    for path in _sources(root, "specdistill"):
        own = layer_of(module_name(root, path))
        if own is None or own.startswith("unlayered"):
            out.append(f"{path.relative_to(root)}: {own or 'outside the library'}; put it in one of the layers {LAYERS}")
            continue
        for imp in imports_of(root, path):
            theirs = layer_of(imp.module)
            if theirs is None:
                continue
            if theirs.startswith("unlayered"):
                out.append(f"{imp.file}:{imp.line} imports {imp.module}, which belongs to no layer")
            elif theirs != own and theirs not in MAY_IMPORT[own]:
                why = "a sibling: move what both need below them" if {own, theirs} <= set(SIBLINGS) else "a higher layer"
                out.append(f"{imp.file}:{imp.line} imports {imp.module}: {own} must not import {theirs} ({why})")
    return out


def orchestration_violations(root: Path) -> list[str]:
    """The library importing Prefect/tasks/flows (cli may import flows), and tasks/flows going around pipeline."""
    out = []
    for path in _sources(root, "specdistill"):
        in_cli = layer_of(module_name(root, path)) == "cli"
        for imp in imports_of(root, path):
            top = imp.module.split(".")[0]
            if top == "prefect" or top == "tasks" or (top == "flows" and not in_cli):
                out.append(f"{imp.file}:{imp.line} imports {imp.module}: the library never imports {top}"
                           + ("" if top != "flows" else " (only specdistill/cli may, to run a flow)"))
    for top_dir in ("tasks", "flows"):
        if not (root / top_dir).is_dir():
            continue
        for path in _sources(root, top_dir):
            annotations_only = _type_checking_lines(path)
            for imp in imports_of(root, path):
                if layer_of(imp.module) is None or imp.line in annotations_only:
                    continue
                if not any(imp.module == ok or imp.module.startswith(ok + ".") for ok in ORCHESTRATION_MAY_IMPORT):
                    out.append(f"{imp.file}:{imp.line} imports {imp.module}: {top_dir}/ may use only "
                               f"{' and '.join(ORCHESTRATION_MAY_IMPORT)} (go through specdistill.pipeline)")
    return out


def stage_violations(root: Path) -> list[str]:
    """A stage importing another stage, or a pipeline module outside the stages importing one: the stages
    sit side by side on top of the pipeline, and what two of them share lives below them."""
    out = []
    for path in _sources(root, "specdistill/pipeline"):
        own = _child_of(STAGES, module_name(root, path))
        for imp in imports_of(root, path):
            theirs = _child_of(STAGES, imp.module)
            if theirs is None or theirs == own:
                continue
            if own is None:
                out.append(f"{imp.file}:{imp.line} imports {imp.module}: only the stages' callers (tasks/, flows/, "
                           "the CLI) import a stage; move what it needs below the stages")
            else:
                out.append(f"{imp.file}:{imp.line} imports {imp.module}: stages do not import one another; move what "
                           "both need below them (specdistill/pipeline/ or a lower layer)")
    return out


def _type_checking_lines(path: Path) -> set[int]:
    """The lines of the imports under `if TYPE_CHECKING:`: names for annotations, which never run."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    lines = set()
    for node in ast.walk(tree):
        test = node.test if isinstance(node, ast.If) else None
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            lines |= {sub.lineno for stmt in node.body for sub in ast.walk(stmt) if isinstance(sub, (ast.Import, ast.ImportFrom))}
    return lines


def size_violations(root: Path) -> list[str]:
    out = []
    for path in _sources(root, "specdistill"):
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_LINES:
            out.append(f"{path.relative_to(root)}: {n} lines (at most {MAX_LINES})")
    top_level = sorted(p.name for p in (root / "specdistill").glob("*.py") if p.name != "__init__.py")
    if len(top_level) > MAX_TOP_LEVEL:
        out.append(f"specdistill/ holds {len(top_level)} modules directly (at most {MAX_TOP_LEVEL}): {top_level}")
    return out


def _function_level(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements inside a function (at any depth), in source order."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return sorted(found, key=lambda n: n.lineno)


def function_level_imports(root: Path) -> list[tuple[Import, bool]]:
    """Every import inside a function in specdistill/ (of the library or any other package), whether it
    says why (`# lazy: ...` on one of its lines or on the line above)."""
    out = []
    for path in _sources(root, "specdistill"):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        tree = ast.parse(text, filename=str(path))
        modules = {(imp.line, imp.module) for imp in imports_of(root, path)}
        for node in _function_level(tree):
            said = any(LAZY_REASON.search(lines[i - 1]) for i in range(max(1, node.lineno - 1), node.end_lineno + 1))
            out += [(Import(str(path.relative_to(root)), node.lineno, m), said)
                    for m in sorted({m for line, m in modules if line == node.lineno})]
    return out


def unexplained_function_level_imports(root: Path) -> list[str]:
    """Function-level imports that do not say why."""
    return [f"{imp.file}:{imp.line} imports {imp.module} inside a function without a reason: move it to the top of the "
            "module, or say why on its line (`# lazy: CLI start-up`, `# lazy: keeps torch off import`)"
            for imp, said in function_level_imports(root) if not said]


def _child_of(package: str, dotted: str) -> str | None:
    """The direct child of `package` (module or subpackage) that `dotted` is or lies in; None outside it."""
    prefix = package + "."
    if not dotted.startswith(prefix):
        return None
    return prefix + dotted[len(prefix):].split(".")[0]


def import_cycles(root: Path) -> list[str]:
    """A circle of imports among the modules of one package (a subpackage is one node of its parent),
    counting imports at the top, inside functions and under TYPE_CHECKING alike; one circle per
    strongly connected set, each arrow with the file:line that draws it."""
    imports = {module_name(root, p): imports_of(root, p) for p in _sources(root, "specdistill")}
    packages = {m for m, p in ((module_name(root, p), p) for p in _sources(root, "specdistill")) if _is_package(p)}
    out = []
    for package in sorted(packages):
        edges: dict[str, dict[str, Import]] = {}
        for importer, found in imports.items():
            a = _child_of(package, importer)
            if a is None:
                continue
            for imp in found:
                b = _child_of(package, imp.module)
                if b is not None and b != a:
                    edges.setdefault(a, {}).setdefault(b, imp)
        out += [f"{package}: " + " -> ".join(f"{a.rpartition('.')[2]} ({edges[a][b].file}:{edges[a][b].line})"
                                             for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1].rpartition('.')[2]}"
                for cycle in _cycles(edges)]
    return out


def _cycles(edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """One circle (first node repeated at the end) through each strongly connected set of the graph (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, {})):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(edges):
        if v not in index:
            connect(v)
    cycles = []
    for component in components:  # walk inside the set from its first node until a node repeats
        path, seen = [min(component)], {}
        while path[-1] not in seen:
            seen[path[-1]] = len(path) - 1
            path.append(min(w for w in edges[path[-1]] if w in component))
        cycles.append(path[seen[path[-1]]:])
    return cycles


def _report(violations: list[str]) -> str:
    return "\n".join(["", *violations])


# --------------------------------------------------------------------------------------------
# The checker on a synthetic tree: it must catch what it is there to catch.


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checker_catches_upward_imports_at_any_depth(tmp_path):
    root = _write(tmp_path, {
        "specdistill/__init__.py": "from specdistill.env import x\n",
        "specdistill/env.py": "",
        "specdistill/data/__init__.py": "",
        "specdistill/data/ok.py": "import json\nfrom specdistill import paths\nfrom . import sibling\n",
        "specdistill/data/sibling.py": "",
        "specdistill/data/in_function.py": "def f():\n    if True:\n        from specdistill.ops.monitor import decide\n",
        "specdistill/data/relative.py": "from ..pipeline import nightly\n",
        "specdistill/data/package_attr.py": "from specdistill import modeling\n",
        "specdistill/data/dynamic.py": "import importlib\nimportlib.import_module('specdistill.cli')\n",
        "specdistill/ops/__init__.py": "",
        "specdistill/ops/monitor.py": "import specdistill.modeling.vocab\n",
        "specdistill/pipeline/__init__.py": "",
        "specdistill/pipeline/nightly.py": "",
        "specdistill/modeling/__init__.py": "",
        "specdistill/cli/__init__.py": "",
        "specdistill/extras/__init__.py": "",
    })
    found = _report(layering_violations(root))
    assert "data/in_function.py:3 imports specdistill.ops.monitor: data must not import ops" in found
    assert "data/relative.py:1 imports specdistill.pipeline.nightly: data must not import pipeline" in found
    assert "data/package_attr.py:1 imports specdistill.modeling: data must not import modeling" in found
    assert "data/dynamic.py:2 imports specdistill.cli: data must not import cli" in found
    assert "extras/__init__.py: unlayered:extras" in found
    for clean in ("specdistill/__init__.py", "data/ok.py", "ops/monitor.py"):
        assert clean not in found, found


def test_checker_catches_imports_across_sibling_layers(tmp_path):
    root = _write(tmp_path, {
        "specdistill/__init__.py": "",
        "specdistill/data/__init__.py": "",
        "specdistill/data/results.py": "",
        "specdistill/distill/__init__.py": "",
        "specdistill/distill/teacher.py": "from specdistill.data import results\n",
        "specdistill/speculative/__init__.py": "",
        "specdistill/speculative/bench.py": "",
        "specdistill/engines/__init__.py": "",
        "specdistill/engines/bench.py": "from specdistill.speculative.bench import Prompt\nfrom specdistill.data.results import x\n",
        "specdistill/engines/answers.py": "def f():\n    from specdistill.distill import teacher\n",
        "specdistill/ops/__init__.py": "",
        "specdistill/ops/policy.py": "from specdistill.engines import bench\nfrom specdistill.speculative import bench\n",
    })
    found = _report(layering_violations(root))
    assert "engines/bench.py:1 imports specdistill.speculative.bench: engines must not import speculative (a sibling" in found
    assert "engines/answers.py:2 imports specdistill.distill.teacher: engines must not import distill (a sibling" in found
    for clean in ("engines/bench.py:2", "distill/teacher.py", "ops/policy.py"):
        assert clean not in found, found


def test_the_layer_graph_is_acyclic_and_names_every_layer():
    assert set(MAY_IMPORT) == set(LAYERS) and all(deps <= set(LAYERS) for deps in MAY_IMPORT.values())
    for layer in LAYERS:  # no layer reaches itself through the graph
        seen, todo = set(), list(MAY_IMPORT[layer])
        while todo:
            nxt = todo.pop()
            assert nxt != layer, f"{layer} reaches itself"
            if nxt not in seen:
                seen.add(nxt)
                todo += MAY_IMPORT[nxt]
    for a in SIBLINGS:
        assert not set(SIBLINGS) & MAY_IMPORT[a]


def test_checker_catches_prefect_and_orchestration_shortcuts(tmp_path):
    root = _write(tmp_path, {
        "specdistill/__init__.py": "",
        "specdistill/paths.py": "",
        "specdistill/ops/__init__.py": "",
        "specdistill/ops/bad.py": "def f():\n    from prefect import flow\n",
        "specdistill/ops/runs_flow.py": "def f():\n    from flows.nightly import nightly\n",
        "specdistill/cli/__init__.py": "def f():\n    from flows.nightly import nightly\n    import prefect.events\n",
        "specdistill/pipeline/__init__.py": "",
        "specdistill/pipeline/nightly.py": "",
        "tasks/__init__.py": "",
        "tasks/good.py": "from specdistill.pipeline import nightly\nfrom specdistill import paths\n",
        "tasks/bad.py": "from specdistill.ops.bad import f\n",
        "tasks/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from specdistill.ops.bad import Verdict\n",
        "flows/__init__.py": "",
        "flows/nightly.py": "from prefect import flow\nfrom tasks import good\nimport specdistill.recipe\n",
    })
    found = _report(orchestration_violations(root))
    assert "ops/bad.py:2 imports prefect" in found
    assert "ops/runs_flow.py:2 imports flows.nightly" in found
    assert "cli/__init__.py:3 imports prefect.events" in found
    assert "cli/__init__.py:2" not in found  # the CLI may run a flow
    assert "tasks/bad.py:1 imports specdistill.ops.bad" in found
    assert "flows/nightly.py:3 imports specdistill.recipe" in found
    assert "tasks/good.py" not in found and "flows/nightly.py:1" not in found and "flows/nightly.py:2" not in found
    assert "tasks/typed.py" not in found  # a type for annotations only, from where it is defined


def test_checker_catches_a_stage_importing_another_and_the_pipeline_importing_a_stage(tmp_path):
    root = _write(tmp_path, {
        "specdistill/__init__.py": "",
        "specdistill/pipeline/__init__.py": "",
        "specdistill/pipeline/layout.py": "",
        "specdistill/pipeline/report.py": "def f():\n    from specdistill.pipeline.stages.corpus import x  # lazy: a reason\n",
        "specdistill/pipeline/stages/__init__.py": "",
        "specdistill/pipeline/stages/corpus.py": "from specdistill.pipeline.layout import x\n",
        "specdistill/pipeline/stages/pool.py": "from specdistill.pipeline.stages.answers import stage\n",
        "specdistill/pipeline/stages/monitor.py": "from . import corpus\n",
        "specdistill/pipeline/stages/answers/__init__.py": "",
        "specdistill/pipeline/stages/answers/stage.py": "from specdistill.pipeline.stages.answers import harness\n",
        "specdistill/pipeline/stages/answers/harness.py": "from ..corpus import y\n",
    })
    found = _report(stage_violations(root))
    assert "stages/pool.py:1 imports specdistill.pipeline.stages.answers.stage: stages do not import one another" in found
    assert "stages/monitor.py:1 imports specdistill.pipeline.stages.corpus: stages do not import one another" in found
    assert "answers/harness.py:1 imports specdistill.pipeline.stages.corpus: stages do not import one another" in found
    assert "pipeline/report.py:2 imports specdistill.pipeline.stages.corpus: only the stages' callers" in found
    for clean in ("stages/corpus.py", "answers/stage.py"):  # a stage's own modules import one another
        assert clean not in found, found


def test_checker_counts_lines_and_top_level_modules(tmp_path):
    files = {"specdistill/__init__.py": "", "specdistill/data/big.py": "x = 1\n" * (MAX_LINES + 1),
             "specdistill/data/fits.py": "x = 1\n" * MAX_LINES}
    files.update({f"specdistill/m{i}.py": "" for i in range(MAX_TOP_LEVEL + 1)})
    found = _report(size_violations(_write(tmp_path, files)))
    assert f"data/big.py: {MAX_LINES + 1} lines" in found and "fits.py" not in found
    assert f"holds {MAX_TOP_LEVEL + 1} modules directly" in found


def test_checker_catches_a_circle_inside_a_package_however_it_is_hidden(tmp_path):
    root = _write(tmp_path, {
        "specdistill/__init__.py": "",
        "specdistill/speculative/__init__.py": "",
        "specdistill/speculative/drafters.py": "def make():\n    from specdistill.speculative.eagle import E  # lazy: a reason\n",
        "specdistill/speculative/eagle.py": "from specdistill.speculative import suffix\n",
        "specdistill/speculative/suffix.py": "from .drafters import Drafter\n",
        "specdistill/speculative/decode.py": "from specdistill.speculative.drafters import Drafter\n",
        "specdistill/pipeline/__init__.py": "",
        "specdistill/pipeline/answers/__init__.py": "",
        "specdistill/pipeline/answers/stage.py": "from specdistill.pipeline.outputs import X\n",
        "specdistill/pipeline/outputs.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                          "    from specdistill.pipeline.answers.stage import Y\n",
        "specdistill/ops/__init__.py": "",
        "specdistill/ops/monitor.py": "from specdistill.ops.serving import S\n",
        "specdistill/ops/serving.py": "",
    })
    found = _report(import_cycles(root))
    assert ("specdistill.speculative: drafters (specdistill/speculative/drafters.py:2) -> eagle (specdistill/speculative/eagle.py:1) "
            "-> suffix (specdistill/speculative/suffix.py:1) -> drafters") in found
    assert ("specdistill.pipeline: answers (specdistill/pipeline/answers/stage.py:1) -> outputs (specdistill/pipeline/outputs.py:3) "
            "-> answers") in found
    for clean in ("decode", "ops"):
        assert clean not in found, found


def test_checker_catches_a_function_level_import_that_does_not_say_why(tmp_path):
    root = _write(tmp_path, {
        "specdistill/__init__.py": "",
        "specdistill/paths.py": "",
        "specdistill/ops/__init__.py": "",
        "specdistill/ops/serving.py": "from specdistill import paths\n",
        "specdistill/ops/quiet.py": "def f():\n    import json\n    from specdistill.ops import serving\n",
        "specdistill/ops/said.py": "def f():\n    from specdistill.ops import serving  # lazy: keeps torch off import\n",
        "specdistill/ops/above.py": "def f():\n    # lazy: CLI start-up\n    from specdistill import paths\n",
        "specdistill/ops/multi.py": "class C:\n    def f(self):\n        from specdistill.ops.serving import (  # lazy: mlflow\n"
                                    "            a,\n        )\n        from . import serving\n",
        "specdistill/ops/empty.py": "def f():\n    from specdistill.ops import serving  # lazy:\n",
        "specdistill/ops/third.py": "def f():\n    import torch\n",
        "specdistill/ops/top.py": "import torch\n\ndef f():\n    return torch\n",
        "specdistill/ops/lazy_torch.py": "def f():\n    import torch  # lazy: keeps torch off `serving show`\n",
    })
    found = _report(unexplained_function_level_imports(root))
    assert "ops/quiet.py:3 imports specdistill.ops.serving inside a function without a reason" in found
    assert "ops/quiet.py:2 imports json inside a function without a reason" in found  # any package, not only ours
    assert "ops/third.py:2 imports torch inside a function" in found
    assert "ops/multi.py:6 imports specdistill.ops.serving" in found
    assert "ops/empty.py:2" in found  # a reason must say something
    for clean in ("ops/serving.py", "ops/said.py", "ops/above.py", "ops/multi.py:3", "ops/top.py", "ops/lazy_torch.py"):
        assert clean not in found, found


# --------------------------------------------------------------------------------------------
# The repository


@pytest.mark.parametrize("check", [
    layering_violations,  # library layers import only downward
    orchestration_violations,  # Prefect stays in tasks/ and flows/, which use the library through pipeline
    stage_violations,  # stages do not import one another; what they share lives below them
    size_violations,  # modules stay small and the top level stays short
    import_cycles,  # no package imports itself in a circle
    unexplained_function_level_imports,  # imports inside functions say why
], ids=lambda check: check.__name__)
def test_the_repository_keeps_the_house_rules(check):
    violations = check(REPO)
    if violations:
        pytest.fail(_report(violations), pytrace=False)
