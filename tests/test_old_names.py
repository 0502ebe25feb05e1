"""One name per concept, written everywhere; the old names read where records and configs come in.

The layer draft (a small model built from some of the target's layers) is `draft_model`, vLLM's `method` for it:
its training kind (`train.kind`), its drafter spec (`draft_model:DIR`), serving.json's and the registry's
`draft_kind`, `draft init --kind`. It was `layers` there (a word the feature caches and draft metas keep for a
list of layer ids) and `draft` in its spec (the word for any draft, and the serving mode both drafts are served in).
Self-speculation is `self-spec`: its spec (`self-spec:K`), its serving mode, `--self-spec K`; it was also
`self_speculation` (the serving mode) and `self_spec:K` (an older spec).

Each place an old name comes in has its test: the spec (tests/test_specs.py), serving.json (tests/test_serving.py),
a registered version's tag (tests/test_registry.py), and here a distillation or nightly config, a result.json, a
checkpoint's saved config and the CLI. The last test keeps the old names from being written again.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from specdistill.cli import build_parser
from specdistill.distill.checkpoints import CheckpointError, check_resumable
from specdistill.distill.distill_recipe import load_config, save_config
from specdistill.distill.trained import Trained
from specdistill.pipeline.nightly_recipe import load_nightly_config

REPO = Path(__file__).resolve().parents[1]


def test_a_config_written_before_reads_train_kind_layers_as_draft_model(tmp_path):
    assert load_config(None, ["data.path=x", "kind=layers"]).kind == "draft_model"
    recipe = tmp_path / "nightly.yaml"
    recipe.write_text("train: {kind: layers, layers: '0,29'}\n")
    config = load_nightly_config(recipe)
    assert config.train.kind == "draft_model" and config.train.layers == "0,29"  # `layers` the ids keeps its key
    assert load_nightly_config(None, ["train.kind=layers"]).train.kind == "draft_model"
    save_config(load_config(None, ["data.path=x", "kind=layers"]), tmp_path / "config.yaml")
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["kind"] == "draft_model"  # written under its one name
    with pytest.raises(ValueError, match="draft_model"):
        load_config(None, ["data.path=x", "kind=medusa"])


def test_a_result_written_before_reads_its_kind_layers_as_draft_model():
    old = {"steps": 2, "tokens": 10, "train_minutes": 0.1, "loss": 1.0, "stop": "max_steps", "trainable_parameters": 10,
           "frozen_parameters": 20, "curve": [], "kind": "layers", "draft_vocab": None, "layers": [0, 3]}
    result = Trained.from_dict(old)
    assert result.kind == "draft_model" and result.layers == [0, 3]
    assert result.result_json()["kind"] == "draft_model"


def test_a_checkpoint_saved_with_kind_layers_resumes_as_draft_model(tmp_path):
    ckpt = tmp_path / "checkpoints" / "step-0000001"
    ckpt.mkdir(parents=True)
    config = load_config(None, ["data.path=x", "layers=0,3"])
    saved = yaml.safe_load(config.model_dump_json())
    (ckpt / "config.yaml").write_text(yaml.safe_dump({**saved, "kind": "layers"}))
    check_resumable(ckpt, config)  # the same draft: resumed
    with pytest.raises(CheckpointError, match="kind='eagle3'.*kind='draft_model'"):
        check_resumable(ckpt, load_config(None, ["data.path=x", "layers=0,3", "kind=eagle3", "teacher.mode=cache",
                                                 "teacher.cache_dir=c"]))


def test_draft_init_reads_kind_layers_as_draft_model(capsys):
    parser = build_parser()
    assert parser.parse_args(["draft", "init", "--kind", "layers", "out"]).kind == "draft_model"
    assert parser.parse_args(["draft", "init", "out"]).kind == "draft_model"
    with pytest.raises(SystemExit):
        parser.parse_args(["draft", "init", "--kind", "medusa", "out"])
    assert re.search("invalid choice: 'medusa' .*draft_model.*eagle3", capsys.readouterr().err)


# (an old name as written, the files that read it: none else may write it)
OLD_NAMES = [
    (r"self_speculation", {"specdistill/speculative/specs.py", "docs/serving.md", "tests/test_serving.py"}),
    (r"\bself_spec:", {"specdistill/speculative/specs.py", "docs/serving.md", "tests/test_specs.py"}),
    (r"""(?<![\w./-])draft:(?=[A-Z{/\w])""", {"specdistill/speculative/specs.py", "specdistill/speculative/kinds/draft_model.py",
                                             "specdistill/speculative/kinds/eagle3.py", "docs/serving.md",
                                             "tests/test_specs.py", "tests/test_eagle3_ops.py"}),
    (r"""kind["']?(=|:\s*|\s)["']?layers\b""", {"specdistill/modeling/eagle3_files.py", "specdistill/distill/checkpoints.py",
                                          "specdistill/cli/models.py", "docs/serving.md", "tests/test_serving.py",
                                          "tests/test_registry.py"}),
]
SCANNED = ("specdistill", "tasks", "flows", "tests", "docs", "deploy", "benchmarks", "scripts", "README.md")


@pytest.mark.parametrize("pattern, readers", OLD_NAMES)
def test_an_old_name_is_written_only_where_records_written_before_are_read(pattern, readers):
    found = set()
    for top in SCANNED:
        root = REPO / top
        for path in [root] if root.is_file() else root.rglob("*"):
            if path.suffix in (".py", ".md", ".yaml", ".yml", ".json", ".toml") and path.is_file():
                if re.search(pattern, path.read_text(encoding="utf-8", errors="replace")):
                    found.add(str(path.relative_to(REPO)))
    found.discard("tests/test_old_names.py")  # this file
    assert found <= readers, f"{pattern!r} written in {sorted(found - readers)}: write the one name"
