"""The one YAML loader (`specdistill.recipe.load_yaml`): what a recipe file may expand to is bounded."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from specdistill.distill.distill_recipe import load_config
from specdistill.pipeline.monitor_recipe import load_monitor_config
from specdistill.pipeline.nightly_recipe import load_nightly_config
from specdistill.recipe import MAX_YAML_VALUES, ConfigError, YAMLTooLarge, load_yaml

REPO = Path(__file__).resolve().parents[1]


def alias_bomb(levels: int = 9, width: int = 9, top: str = "") -> str:
    """A few hundred bytes that expand to width**levels values ("billion laughs")."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]")
    if top:
        lines.append(f"{top}: *l{levels - 1}")
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_in_any_config_is_refused_at_once_naming_the_file(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    for text in (alias_bomb(), alias_bomb(top="train"), alias_bomb(levels=4, width=40), alias_bomb(levels=30, width=2)):
        bomb.write_text(text)
        for load in (load_config, load_nightly_config, load_monitor_config):
            began = time.perf_counter()
            with pytest.raises(ConfigError, match=r"bomb\.yaml: refused: line \d+: its aliases expand to more than"):
                load(bomb)
            assert time.perf_counter() - began < 5
    bomb.write_text("a: &a [1, *a]\n")  # an anchor inside itself (yaml builds a cycle, a walk over it never ends)
    with pytest.raises(ConfigError, match="recursive alias"):
        load_config(bomb)
    bomb.write_text("x: " + "[" * 50_000 + "]" * 50_000 + "\n")
    with pytest.raises(ConfigError, match="bomb.yaml: refused: nested too deeply"):
        load_config(bomb)


def test_the_cli_refuses_an_alias_bomb_in_seconds_with_one_sentence(tmp_path):
    """9 levels of x9 aliases as --config ran for minutes, 1.8 GB and growing."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb())
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPECDISTILL_HOME": str(tmp_path / "home")}
    done = subprocess.run([sys.executable, "-m", "specdistill.cli", "distill", "--config", str(bomb)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "alias bomb" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_aliases_within_the_bound_load_as_before_and_overrides_are_bounded_too():
    assert load_yaml("a: &a {x: 1, y: [1, 2]}\nb: *a\nc: {<<: *a, x: 2}\n") == {
        "a": {"x": 1, "y": [1, 2]}, "b": {"x": 1, "y": [1, 2]}, "c": {"x": 2, "y": [1, 2]}}
    assert load_yaml(alias_bomb(levels=3, width=9)) is not None  # 729 values: fine
    with pytest.raises(YAMLTooLarge):
        load_yaml(alias_bomb(levels=6, width=10))  # 10**6 values
    assert MAX_YAML_VALUES < 10**6
    with pytest.raises(yaml.YAMLError):  # what callers that read YAML besides configs already catch
        load_yaml(alias_bomb())
    bomb_override = "window.days=" + alias_bomb().replace("\n", ", ").join("{}")
    with pytest.raises(ConfigError):
        load_nightly_config(None, [bomb_override])
