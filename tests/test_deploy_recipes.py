"""Every YAML under deploy/ is loaded here. A config recipe is validated by the code's strict config and
pinned against its defaults: it sets only what it changes, so a default moved in the code cannot leave a
stale copy behind. Every path a recipe names exists in a fresh clone or is made by the run it follows.
`specdistill demo` runs deploy/nightly/demo.yaml, and that resolves to the demo of before the file."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from specdistill.distill.distill_recipe import DistillConfig, load_config
from specdistill.pipeline.monitor_recipe import MonitorConfig, load_monitor_config
from specdistill.pipeline.nightly_recipe import DEMO_RECIPE, NightlyConfig, config_hash, load_nightly_config, run_root
from specdistill.pipeline.stages.answers.stage import link_latest

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"

# each config recipe, its loader and the config its keys are pinned against (the code's defaults)
RECIPES = {
    "nightly/demo.yaml": (load_nightly_config, NightlyConfig),
    "nightly/nightly.yaml": (load_nightly_config, NightlyConfig),
    "nightly/tiny.yaml": (load_nightly_config, NightlyConfig),
    "monitor/monitor.yaml": (load_monitor_config, MonitorConfig),
    "monitor/tiny.yaml": (load_monitor_config, MonitorConfig),
    "distill/demo.yaml": (load_config, lambda: DistillConfig(data={"path": "required"})),
}
# the other YAML files, each checked by its own test below (and prometheus/ by tests/test_prometheus_rules.py)
OTHER_YAML = {"prefect.yaml", "prometheus/prometheus.yml", "prometheus/rules.yml", "prometheus/rules_test.yml"}
# (recipe, key) set to its default on purpose, as documentation: none today; an entry here says why
DOCUMENTED: dict[tuple[str, str], str] = {}
DEMO_TRAFFIC = {"sharegpt", "humaneval"}  # a source path naming the traffic shipped in PyPI packages


def restated(raw: dict, loaded: BaseModel, default: BaseModel, prefix: str = "") -> list[str]:
    """The dotted keys of `raw` whose loaded value equals the default's: a section that is a config of its own
    is compared key by key, against the default's own section (a recipe section's defaults can differ from
    its class's, as `train.kind` does), anything else whole."""
    found = []
    for key, value in raw.items():
        got, default_value = getattr(loaded, key), getattr(default, key)
        if isinstance(value, dict) and isinstance(got, BaseModel) and isinstance(default_value, BaseModel):
            found += restated(value, got, default_value, f"{prefix}{key}.")
        elif got == default_value:
            found.append(f"{prefix}{key}")
    return found


def test_every_yaml_under_deploy_is_loaded_here():
    found = {p.relative_to(DEPLOY).as_posix() for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml")}
    assert found == set(RECIPES) | OTHER_YAML


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_recipe_sets_only_what_it_changes(name, monkeypatch):
    monkeypatch.chdir(REPO)  # the relative paths recipes name (monitor's nightly_config) are the checkout's
    loader, default = RECIPES[name]
    path = DEPLOY / name
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    loaded = loader(path)  # strict: an unknown key or a bad value fails here
    stale = [key for key in restated(raw, loaded, default()) if (name, key) not in DOCUMENTED]
    assert not stale, f"{name} restates the code's default of {stale}: drop the keys (or list them in DOCUMENTED)"


def test_a_restated_default_is_found_where_the_section_sets_it(tmp_path):
    """The check can fail: a default given again, at the top, in a section, and in a recipe section whose
    default differs from its class's (the nightly trains a head; DistillConfig's kind is a layer draft)."""
    path = tmp_path / "nightly.yaml"
    path.write_text("target: demo\nwindow: {eval_prompts: 10, train_prompts: 64}\ntrain: {kind: eagle3, layers: '0,29'}\n"
                    "gate: {profile: default}\n")
    raw = yaml.safe_load(path.read_text())
    assert restated(raw, load_nightly_config(path), NightlyConfig()) == ["target", "window.eval_prompts", "train.kind"]


def test_specdistill_demo_runs_the_deploy_recipe_and_resolves_to_the_demo_of_before():
    """`make demo` ran the code's defaults plus `generation.backend=auto` before it read a file: the same config."""
    assert DEMO_RECIPE.resolve() == (DEPLOY / "nightly" / "demo.yaml").resolve()
    demo = load_nightly_config(DEMO_RECIPE)
    before = load_nightly_config(None, ["generation.backend=auto"])
    assert demo == before and config_hash(demo) == config_hash(before)
    assert demo != NightlyConfig()  # the recipe changes something
    assert load_nightly_config(DEMO_RECIPE, ["generation.backend=harness"]).generation.backend == "harness"


def test_the_paths_the_flow_recipes_name_exist_in_a_checkout(monkeypatch):
    monkeypatch.chdir(REPO)
    for name in ("nightly/demo.yaml", "nightly/nightly.yaml", "nightly/tiny.yaml"):
        for source in load_nightly_config(DEPLOY / name).sources:
            assert source.path in DEMO_TRAFFIC or Path(source.path).is_file(), (name, source.path)
    for name in ("monitor/monitor.yaml", "monitor/tiny.yaml"):
        config = load_monitor_config(DEPLOY / name)
        assert (REPO / config.nightly_config).is_file() and config.fallback_suffix_corpus is None, name


def test_the_distill_recipe_reads_what_the_demo_answered(tmp_path, monkeypatch):
    """deploy/distill/demo.yaml reads the newest night's answers where the nightly links them
    (`data/latest`), relative to a checkout whose state directory is the default `.specdistill`."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SPECDISTILL_HOME", raising=False)
    config = load_config(DEPLOY / "distill" / "demo.yaml")
    inputs = [Path(config.data.path), Path(config.data.heldout_path), Path(config.teacher.cache_dir)]
    assert not any(p.exists() for p in inputs)
    for night in ("a1-fp-cfg-bfloat16", "b2-fp-cfg-bfloat16"):  # the second night's answers replace the first's
        answers = run_root() / "data" / night
        (answers / "teacher_cache").mkdir(parents=True)
        for split in ("train", "eval"):
            (answers / f"{split}_generated.jsonl").write_text(f'{{"id": "{night}"}}\n')
        link = link_latest(answers)
    assert link.is_symlink() and str(link.readlink()) == "b2-fp-cfg-bfloat16"  # relative: the state can move
    assert [p.exists() for p in inputs] == [True, True, True]
    assert '"b2-' in Path(config.data.path).read_text()
    assert Path(config.out_dir).resolve().is_relative_to(tmp_path / ".specdistill")


def _entrypoint(entrypoint: str):
    file, name = entrypoint.split(":")
    return getattr(importlib.import_module(file.removesuffix(".py").replace("/", ".")), name)


def test_the_prefect_deployments_name_flows_and_recipes_that_exist(monkeypatch):
    monkeypatch.chdir(REPO)
    deployments = {d["name"]: d for d in yaml.safe_load((DEPLOY / "prefect.yaml").read_text())["deployments"]}
    loaders = {"nightly": load_nightly_config, "monitor": load_monitor_config}
    assert set(deployments) == set(loaders)
    for name, deployment in deployments.items():
        assert (REPO / deployment["entrypoint"].split(":")[0]).is_file()
        flow = _entrypoint(deployment["entrypoint"])
        parameters = deployment["parameters"]
        assert set(parameters) <= set(inspect.signature(flow.fn).parameters), name
        loaders[name](parameters["config_path"])
        for trigger in deployment.get("triggers", []):
            assert set(trigger.get("parameters", {})) <= set(inspect.signature(flow.fn).parameters), name


def test_the_prometheus_files_name_rule_files_that_exist():
    for name in ("prometheus.yml", "rules_test.yml"):
        for rules in yaml.safe_load((DEPLOY / "prometheus" / name).read_text())["rule_files"]:
            assert (DEPLOY / "prometheus" / rules).is_file(), (name, rules)
    groups = yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())["groups"]
    assert groups and all(group["rules"] for group in groups)


def test_the_files_a_deploy_yaml_names_exist():
    """Comments and values alike: a file of the checkout that a YAML under deploy/ names (the code that holds
    its keys, the script that runs it) exists, so a moved module cannot leave a stale pointer behind."""
    named = re.compile(r"\b(?:specdistill|benchmarks|tests|scripts|flows|tasks|deploy|docs)/[\w./-]+\.(?:py|ya?ml|md|sh)\b")
    for path in sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml")):
        text = path.read_text(encoding="utf-8")
        missing = [name for name in named.findall(text) if not (REPO / name).is_file()]
        assert not missing, f"{path.relative_to(REPO)} names files that do not exist: {missing}"
    assert named.findall("(every key: specdistill/pipeline.py NightlyConfig)") == ["specdistill/pipeline.py"]
