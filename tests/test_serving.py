import json
import threading

import pytest

from specdistill.ops.serving import (
    ServingConfig,
    read_serving_config,
    write_serving_config,
)


def test_draft_mode_gives_vllm_and_sglang_settings(tmp_path):
    cfg = ServingConfig(mode="draft", draft_dir="/models/draft-v3", draft_version="3", num_speculative_tokens=5)
    assert cfg.vllm() == {"method": "draft_model", "model": "/models/draft-v3", "num_speculative_tokens": 5}
    flags = cfg.sglang()
    assert flags[:2] == ["--speculative-algorithm", "STANDALONE"]
    assert flags[flags.index("--speculative-num-draft-tokens") + 1] == "6"
    path = write_serving_config(cfg, tmp_path / "serving.json")
    on_disk = json.loads(path.read_text())
    assert on_disk["vllm"]["speculative_config"]["method"] == "draft_model"
    assert read_serving_config(path) == cfg


def test_a_new_kind_brings_its_engine_settings_and_what_its_mode_needs():
    """A kind registered once is written for vLLM and SGLang and checked, with no edit to ServingConfig."""
    from specdistill.speculative.specs import KINDS, Kind, register_kind, serving_modes

    register_kind(Kind("mtp", "mtp", "mtp", lambda arg: not arg, lambda target, s, key: None,
                       vllm=lambda c: {"method": "mtp", "num_speculative_tokens": c.num_speculative_tokens},
                       sglang=lambda c: ["--speculative-algorithm", "EAGLE"], needs=("draft_dir", "a draft directory")))
    try:
        assert "mtp" in serving_modes()
        cfg = ServingConfig(mode="mtp", draft_dir="/d", num_speculative_tokens=2)
        assert cfg.vllm() == {"method": "mtp", "num_speculative_tokens": 2} and cfg.sglang() == ["--speculative-algorithm", "EAGLE"]
        with pytest.raises(ValueError, match="serving mode 'mtp' needs a draft directory"):
            ServingConfig(mode="mtp")
    finally:
        KINDS.pop("mtp")


def test_draft_kind_says_the_kind_served_and_older_records_are_read(tmp_path):
    """serving.json's `draft_kind` names the served kind; one written before said `layers` whatever was served."""
    suffix = ServingConfig(mode="suffix", suffix_corpus="/c.bin")
    assert suffix.draft_kind == "suffix" and ServingConfig(mode="off").draft_kind is None
    assert ServingConfig(mode="self-spec", draft_dir="/d", exit_layer=4).draft_kind == "self-spec"
    assert ServingConfig(mode="draft", draft_dir="/d").draft_kind == "draft_model"
    old = {"mode": "suffix", "num_speculative_tokens": 8, "draft_dir": None, "draft_version": None, "draft_kind": "layers",
           "target_fingerprint": "fp", "suffix_corpus": "/c.bin", "suffix_corpus_tokens": 120, "reason": "nightly: fastest",
           "measured": {"suffix": 1.44, "ngram": 1.27}, "engine": "harness", "updated_at": 1764900000.0,
           "vllm": {"speculative_config": {"method": "suffix"}}, "sglang": ["--speculative-algorithm", "NGRAM"]}
    path = tmp_path / "serving.json"
    path.write_text(json.dumps(old))
    read = read_serving_config(path)
    assert read.draft_kind == "suffix" and read.vllm()["method"] == "suffix"
    assert json.loads(write_serving_config(read, path).read_text())["draft_kind"] == "suffix"
    with pytest.raises(ValueError, match="draft_kind 'eagle3' is served in draft mode, not 'suffix'"):
        ServingConfig(mode="suffix", suffix_corpus="/c.bin", draft_kind="eagle3")


def test_a_file_written_under_the_old_names_is_read_and_written_back_under_the_new(tmp_path):
    """Before each concept had one name, serving.json said `mode: self_speculation` and `draft_kind: layers` for a
    layer draft: both are read as today's (`self-spec`, `draft_model`), and written back so."""
    path = tmp_path / "serving.json"
    base = {"num_speculative_tokens": 4, "draft_dir": "/d", "target_fingerprint": "fp", "updated_at": 1764900000.0}
    for old, new in (({"mode": "self_speculation", "draft_kind": "self-spec", "exit_layer": 8}, ("self-spec", "self-spec")),
                     ({"mode": "self_speculation", "draft_kind": "layers", "exit_layer": 8}, ("self-spec", "self-spec")),
                     ({"mode": "draft", "draft_kind": "layers"}, ("draft", "draft_model"))):
        path.write_text(json.dumps({**base, **old}))
        read = read_serving_config(path)
        assert (read.mode, read.draft_kind) == new and read.vllm()["method"] == "draft_model"
        written = json.loads(write_serving_config(read, path).read_text())
        assert (written["mode"], written["draft_kind"]) == new


def test_ngram_and_off_modes():
    ngram = ServingConfig(mode="ngram", prompt_lookup_min=1, prompt_lookup_max=3, num_speculative_tokens=4)
    assert ngram.vllm() == {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, "num_speculative_tokens": 4}
    assert "NGRAM" in ngram.sglang()
    off = ServingConfig(mode="off")
    assert off.vllm() is None and off.sglang() == []
    assert "no speculation" in off.render()


def test_the_ngram_window_has_one_default_and_only_ngram_mode_carries_it(tmp_path):
    from specdistill.acceptance import NGRAM_WINDOW
    from specdistill.speculative.specs import DrafterSpec

    # plain `ngram` measures NGRAM_WINDOW, and serving.json says so when no window is given
    assert DrafterSpec.parse("ngram").ngram_sizes == NGRAM_WINDOW
    ngram = ServingConfig(mode="ngram")
    assert (ngram.prompt_lookup_min, ngram.prompt_lookup_max) == NGRAM_WINDOW
    assert read_serving_config(write_serving_config(ngram, tmp_path / "ngram.json")) == ngram
    # a suffix serving.json carries no prompt-lookup window it never measured
    suffix = ServingConfig(mode="suffix", suffix_corpus="/c.safetensors", suffix_corpus_tokens=10)
    on_disk = json.loads(write_serving_config(suffix, tmp_path / "suffix.json").read_text())
    assert not [k for k in on_disk if k.startswith("prompt_lookup")]
    assert read_serving_config(tmp_path / "suffix.json") == suffix


@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "eagle"}, "not one of"),
    ({"mode": "draft"}, "needs a draft"),
    ({"mode": "ngram", "num_speculative_tokens": 0}, "at least 1"),
])
def test_bad_configs_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServingConfig(**kwargs)


def test_write_is_atomic_under_concurrent_readers(tmp_path):
    path = tmp_path / "serving.json"
    write_serving_config(ServingConfig(mode="off"), path)
    errors, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            try:
                read_serving_config(path)
            except Exception as exc:  # a torn read would fail to parse
                errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for i in range(200):
        mode = "draft" if i % 2 else "ngram"
        write_serving_config(ServingConfig(mode=mode, draft_dir="/d" * 200 if mode == "draft" else None), path)
    stop.set()
    for t in threads:
        t.join()
    assert not errors
    assert not list(tmp_path.glob("*.tmp"))


def test_missing_config_reads_as_none_and_corrupt_names_the_file(tmp_path):
    assert read_serving_config(tmp_path / "none.json") is None
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        read_serving_config(bad)


def test_serving_show_cli(tmp_path, capsys):
    from specdistill.cli import main

    path = tmp_path / "serving.json"
    assert main(["serving", "show", "--path", str(path)]) == 1
    write_serving_config(ServingConfig(mode="ngram"), path)
    capsys.readouterr()
    assert main(["serving", "show", "--path", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["vllm"]["speculative_config"]["method"] == "ngram"


def test_measured_speedups_travel_in_the_serving_config(tmp_path):
    cfg = ServingConfig(mode="ngram", measured={"ngram": 1.33, "challenger": 0.74}, measured_on="harness bf16")
    assert read_serving_config(write_serving_config(cfg, tmp_path / "s.json")) == cfg
    assert "ngram 1.33x, challenger 0.74x (harness bf16)" in cfg.render()


# --------------------------------------------------------------------------------------------
# the schema: one typed model for read and write


@pytest.mark.parametrize("content, message", [
    ('{"mode": "ngram", "num_speculative_tokens": tr', "corrupt serving config"),
    ('[1, 2]', "expected a JSON object, got list"),
    ('{"num_speculative_tokens": 4}', "mode: Field required"),
    ('{"mode": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens: Input should be a valid integer"),
    ('{"mode": "ngram", "num_speculative_tokens": "4"}', "num_speculative_tokens"),
    ('{"mode": "draft", "draft_dir": 7}', "draft_dir"),
    ('{"mode": "ngram", "measured": {"ngram": "fast"}}', "measured.ngram"),
    (b'\xff\xfe\x00binary', "corrupt serving config"),
])
def test_a_bad_serving_file_names_the_file_and_the_key(tmp_path, content, message):
    from specdistill.ops.serving import ServingConfigError

    path = tmp_path / "serving.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ServingConfigError, match=message) as err:
        read_serving_config(path)
    assert str(path) in str(err.value)


def test_serving_show_on_a_bad_file_is_one_line_not_a_traceback(tmp_path, capsys):
    from specdistill.cli import main

    path = tmp_path / "serving.json"
    path.write_text('{"mode": "ngram", "num_speculative_tokens": true}')
    assert main(["serving", "show", "--path", str(path)]) == 2
    err = capsys.readouterr().err
    assert "num_speculative_tokens" in err and str(path) in err and "Traceback" not in err


def test_keys_from_a_newer_version_are_kept_and_not_fatal(tmp_path):
    path = tmp_path / "serving.json"
    on_disk = {**ServingConfig(mode="ngram").to_dict(), "draft_tree": {"depth": 3}, "future_flag": True}
    path.write_text(json.dumps(on_disk))
    cfg = read_serving_config(path)
    assert cfg.mode == "ngram" and cfg.extras == {"draft_tree": {"depth": 3}, "future_flag": True}
    write_serving_config(cfg, path)  # written back by this version: the newer keys survive
    assert json.loads(path.read_text())["draft_tree"] == {"depth": 3}


def test_serving_file_is_readable_by_the_serving_engine(tmp_path):
    path = write_serving_config(ServingConfig(mode="off"), tmp_path / "serving.json")
    assert path.stat().st_mode & 0o777 == 0o644


def test_pasted_command_lines_are_shell_quoted():
    import shlex

    evil = "/models/it's; touch /tmp/pwned"
    cfg = ServingConfig(mode="draft", draft_dir=evil, num_speculative_tokens=3)
    lines = dict(line.split(None, 1) for line in cfg.render().splitlines() if line.startswith(("vLLM", "SGLang")))
    vllm = shlex.split(lines["vLLM"])
    assert vllm[0] == "--speculative-config" and json.loads(vllm[1])["model"] == evil and len(vllm) == 2
    sglang = shlex.split(lines["SGLang"])
    assert sglang[sglang.index("--speculative-draft-model-path") + 1] == evil
    assert sglang == cfg.sglang()


@pytest.mark.parametrize("key, value, message", [
    ("suffix_max_tree_depth", -1, "greater than or equal to 1"),
    ("suffix_max_tree_depth", 0, "greater than or equal to 1"),
    ("suffix_min_token_prob", 7.5, "less than or equal to 1"),
    ("suffix_min_token_prob", -0.1, "greater than or equal to 0"),
    ("suffix_max_cached_requests", -10, "greater than or equal to 0"),
    ("suffix_max_spec_factor", -2.0, "greater than or equal to 0"),
    ("suffix_max_spec_factor", True, "valid number"),
    ("suffix_corpus_tokens", -5, "greater than or equal to 0"),
    ("num_speculative_tokens", -3, "greater than or equal to 0"),
    ("prompt_lookup_max", 0, "greater than or equal to 1"),
    ("tree_width", 0, "greater than or equal to 1"),
    ("updated_at", -1.0, "greater than or equal to 0"),
    ("measured", {"suffix": -1.4}, "measured.suffix"),
])
def test_every_field_is_checked_to_its_range_when_read_and_when_written(tmp_path, capsys, key, value, message):
    from specdistill.cli import main
    from specdistill.ops.serving import ServingConfigError

    good = ServingConfig(mode="suffix", suffix_corpus="/c.safetensors", suffix_corpus_tokens=10).to_dict()
    path = tmp_path / "serving.json"
    path.write_text(json.dumps({**good, key: value}))
    with pytest.raises(ServingConfigError, match=message) as err:
        read_serving_config(path)
    assert key in str(err.value) and str(path) in str(err.value)
    assert main(["serving", "show", "--path", str(path)]) == 2  # never a --speculative-config with the bad value
    out, err_text = capsys.readouterr()
    assert "speculative" not in out and key in err_text and err_text.count("\n") == 1
    with pytest.raises(ValueError, match=key):
        ServingConfig(**{**ServingConfig(mode="suffix", suffix_corpus="/c").model_dump(), key: value})
    written = tmp_path / "written.json"
    config = ServingConfig.model_construct(**{**ServingConfig(mode="suffix", suffix_corpus="/c").model_dump(), key: value})
    with pytest.raises(ServingConfigError, match=key):
        write_serving_config(config, written)  # built without validation: refused at the write too
    assert not written.exists()


def test_nan_and_infinity_are_refused(tmp_path):
    from specdistill.ops.serving import ServingConfigError

    path = tmp_path / "serving.json"
    for text in ('{"mode": "suffix", "suffix_corpus": "/c", "suffix_min_token_prob": NaN}',
                 '{"mode": "ngram", "measured": {"ngram": Infinity}}'):
        path.write_text(text)
        with pytest.raises(ServingConfigError, match="finite number"):
            read_serving_config(path)
