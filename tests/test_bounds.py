"""Every count that sizes memory or work has a range (`specdistill.bounds`), checked where it is read: a
config file, an override, serving.json, a command-line flag (tests/test_cli.py). A number is finite."""

from __future__ import annotations

import json

import pytest

from specdistill import bounds
from specdistill.cli import main
from specdistill.distill.distill_recipe import load_config
from specdistill.ops.serving import ServingConfigError, read_serving_config
from specdistill.pipeline.monitor_recipe import load_monitor_config
from specdistill.pipeline.nightly_recipe import load_nightly_config
from specdistill.recipe import ConfigError


@pytest.mark.parametrize("override, key", [
    ("bench.gamma=1000000000", "bench.gamma"),
    ("bench.tree_width=100000", "bench.tree_width"),
    ("bench.max_new_tokens=1000000000", "bench.max_new_tokens"),
    ("bench.repeats=1000000", "bench.repeats"),
    ("bench.threads=99999", "bench.threads"),
    ("bench.self_spec_layers=[4,100000]", "bench.self_spec_layers.1"),
    ("serving.max_gamma=1000000000", "serving.max_gamma"),
    ("serving.threads=99999", "serving.threads"),
    ("window.train_prompts=100000000000", "window.train_prompts"),
    ("generation.max_new_tokens=1000000000", "generation.max_new_tokens"),
    ("generation.parallel=100000000", "generation.parallel"),
    ("train.optim.batch_size=100000000", "train.optim.batch_size"),
    ("train.eagle3.steps=1000", "train.eagle3.steps"),
    ("train.optim.lr=inf", "train.optim.lr"),
    ("train.optim.lr=.nan", "train.optim.lr"),
    ("deadline_minutes=.inf", "deadline_minutes"),
    ("pool.keep_versions=1000000", "pool.keep_versions"),
    ("window.days=1e300", "window.days"),  # a timedelta that overflows, not a traceback
    ("deadline_minutes=1e300", "deadline_minutes"),
    ("train.optim.max_minutes=1e300", "train.optim.max_minutes"),
])
def test_a_nightly_count_out_of_range_or_a_number_not_finite_is_refused_naming_its_key(override, key):
    with pytest.raises(ConfigError) as caught:
        load_nightly_config(None, [override])
    message = str(caught.value)
    assert message.startswith(f"<overrides>: {key}: ") and len(message.splitlines()) == 1, message


def test_the_same_bounds_hold_in_a_yaml_file_the_distill_config_and_the_monitor(tmp_path):
    path = tmp_path / "nightly.yaml"
    path.write_text("bench:\n  gamma: 1000000000\n")
    with pytest.raises(ConfigError, match=rf"^{path}: bench.gamma: Input should be less than or equal to {bounds.MAX_GAMMA}"):
        load_nightly_config(path)
    for override in ("threads=99999", "optim.max_steps=1000000000000", "eagle3.layers=[0,100000]", "seed=-1",
                     "optim.lr=inf", "draft_vocab=1000000000"):
        with pytest.raises(ConfigError, match=override.split("=")[0].replace("[", "")):
            load_config(None, ["data.path=x", override])
    for override in ("gamma=1000000000", "max_new_tokens=1000000000", "replay_prompts=0", "fallback_exit_layers=[100000]"):
        with pytest.raises(ConfigError, match=override.split("=")[0]):
            load_monitor_config(None, [override])
    assert load_config(None, ["data.path=x", "threads=1", "optim.max_steps=100000"]).optim.max_steps == 100000


@pytest.mark.parametrize("field, value", [("num_speculative_tokens", 1_000_000_000), ("tree_width", 100_000),
                                          ("suffix_max_tree_depth", 10**12), ("suffix_max_cached_requests", 10**12),
                                          ("suffix_max_spec_factor", 1e12), ("prompt_lookup_max", 100_000),
                                          ("exit_layer", 10**9), ("updated_at", 1e300)])
def test_serving_json_out_of_range_is_refused_where_it_is_read(tmp_path, field, value, capsys):
    """What serving.json carries goes into vLLM's and SGLang's flags and the monitor's replay: a γ of 10^9 was
    OOM-killed at 9 GB; an `updated_at` of 1e300 was an OverflowError in `serving show`."""
    mode = {"num_speculative_tokens": "ngram", "prompt_lookup_max": "ngram", "exit_layer": "self-spec",
            "tree_width": "draft", "updated_at": "ngram"}.get(field, "suffix")
    data = {"mode": mode, "suffix_corpus": "/c", "draft_dir": "/d", "draft_kind": "eagle3", "exit_layer": 4, field: value}
    if mode != "suffix":
        data.pop("suffix_corpus")
    if mode != "draft":
        data.pop("draft_dir"), data.pop("draft_kind")
    if mode != "self-spec":
        data.pop("exit_layer")
    path = tmp_path / "serving.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ServingConfigError, match=rf"{path}: {field}: Input should be less than or equal to"):
        read_serving_config(path)
    assert main(["serving", "show", "--path", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdistill: error: serving config") and field in err and err.count("\n") == 1
