"""Engines get local directories: a registered draft (`models:/NAME@ALIAS`) reaches every engine as the local directory the one resolver
(`modeling.models.resolve_model_dir`, with the registry's integrity check) gives: vLLM and llama.cpp were
handed the reference unresolved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdistill import paths
from specdistill.modeling.drafts import save_draft
from specdistill.ops import registry
from specdistill.speculative.specs import DrafterSpec
from tests.conftest import bench_result, make_tiny_llama, save_tiny_target, train_bpe


@pytest.fixture(scope="module")
def _tracking_db(tmp_path_factory):
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture
def registered(_tracking_db, monkeypatch, tmp_path):
    """A tiny target and a draft of it registered as `challenger` (each test its own registered model)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", _tracking_db)
    tok = train_bpe(300)
    target = save_tiny_target(tmp_path / "target", tokenizer=tok)
    draft = save_draft(make_tiny_llama(vocab_size=len(tok), layers=1), tok, tmp_path / "draft")
    reg = registry.register_draft(draft, target_name=tmp_path.name)
    return target, reg


def _local_registered_copy(path: str | Path, reg) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and path.is_relative_to(paths.home() / "registry" / reg.name / reg.version)


def _bench_vllm_argv(target: Path, ref: str, tmp_path: Path) -> list[str]:
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["hello world"]}) + "\n")
    return ["bench", "--engine", "vllm", "--target", str(target), "--draft", ref, "--prompts", str(prompts),
            "--max-new-tokens", "4", "--json"]


def test_bench_engine_vllm_hands_vllm_the_registered_drafts_directory(registered, monkeypatch, tmp_path, capsys):
    from specdistill.cli import main
    from specdistill.engines.vllm import bench as vllm_bench

    target, reg = registered
    seen = {}

    def fake_bench_vllm(target_ref, modes, prompts, config, **kw):  # vLLM is not installed here: what it is given
        seen.update(modes)
        seen["target"] = vllm_bench.target_dir(target_ref)
        return vllm_bench.VllmBench({"draft_model": bench_result("draft_model:x", speedup=1.1)}, version="test")

    monkeypatch.setattr(vllm_bench, "bench_vllm", fake_bench_vllm)
    assert main(_bench_vllm_argv(target, f"models:/{reg.name}@challenger", tmp_path)) == 0
    assert seen["draft_model"]["method"] == "draft_model" and _local_registered_copy(seen["draft_model"]["model"], reg)
    assert seen["target"] == target


def test_bench_engine_vllm_refuses_a_registered_draft_changed_since_registration(registered, monkeypatch, tmp_path,
                                                                                    capsys):
    from specdistill.cli import main
    from specdistill.engines.vllm import bench as vllm_bench

    target, reg = registered
    local = registry.download_draft(reg.model_uri)
    (local / "generation_config.json").write_text("{}")
    monkeypatch.setattr(vllm_bench, "bench_vllm", lambda *a, **k: pytest.fail("vLLM started on a changed draft"))
    assert main(_bench_vllm_argv(target, f"models:/{reg.name}@challenger", tmp_path)) == 2
    err = capsys.readouterr().err
    assert f"{reg.name} version {reg.version}" in err and "generation_config.json differs" in err


def test_llamacpp_mode_gets_the_registered_drafts_directory(registered, monkeypatch):
    from specdistill.engines.llamacpp import engine as llamacpp
    from specdistill.pipeline.stages.engine_bench import mode_for_spec

    _, reg = registered
    monkeypatch.setattr(llamacpp, "draft_mode", lambda draft, target, k: draft)  # the GGUF export is llama.cpp's test
    assert _local_registered_copy(mode_for_spec(DrafterSpec.parse(f"draft_model:models:/{reg.name}@challenger"), Path("t.gguf"), 4), reg)
    assert mode_for_spec(DrafterSpec.parse("draft_model:/d/draft.gguf"), Path("t.gguf"), 4) == "/d/draft.gguf"  # a GGUF draft as it is


def test_vllm_is_launched_with_the_registered_drafts_directory_on_its_command_line(registered, tmp_path):
    """Through the real server start (a stand-in launcher records its command line): the draft vLLM is
    given is the verified local copy, past the check that refused `models:/...` as 'not an HF directory'."""
    from specdistill.engines.vllm.bench import bench_vllm
    from specdistill.engines.vllm.server import VllmStartError
    from specdistill.pipeline.stages.engine_bench import mode_serving_config
    from tests.test_vllm_lifecycle import _env

    target, reg = registered
    argv = tmp_path / "argv.log"
    env = _env(tmp_path, f'echo "$@" >> {argv}; echo "ValueError: stand-in vLLM"; exit 1')
    mode = mode_serving_config(DrafterSpec.parse(f"draft_model:models:/{reg.name}@challenger"), 4, str(target)).vllm()
    with pytest.raises(VllmStartError, match="stand-in vLLM"):  # target-only could not start: nothing measured
        bench_vllm(target, {"draft": mode}, [], env=env, progress=False)
    launched = argv.read_text()
    local = registry.download_draft(reg.model_uri)
    assert launched.count("--speculative-config") == 1 and json.dumps(str(local)) in launched
    assert "models:/" not in launched


def test_each_kind_writes_its_own_serving_keys_and_a_new_kind_is_one_registration():
    """What vLLM is started with comes from the drafter's kind: the measured window, no prompt-lookup keys
    beside a suffix corpus, and a kind registered once (here a prompt lookup of its own) is written too."""
    from specdistill.acceptance import NGRAM_WINDOW
    from specdistill.pipeline.stages.engine_bench import mode_serving_config
    from specdistill.speculative import NgramDrafter
    from specdistill.speculative.specs import KINDS, Kind, register_kind

    ngram = mode_serving_config(DrafterSpec.parse("ngram:2,5"), 3, "unused").vllm()
    assert ngram == {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5, "num_speculative_tokens": 3}
    assert mode_serving_config(DrafterSpec.parse("ngram"), 3, "unused").vllm()["prompt_lookup_max"] == NGRAM_WINDOW[1]
    suffix = mode_serving_config(DrafterSpec.parse("suffix:/c.safetensors"), 3, "unused").to_dict()
    assert suffix["suffix_corpus"] == "/c.safetensors" and not [k for k in suffix if k.startswith("prompt_lookup")]
    with pytest.raises(ValueError, match="no serving engine runs a hybrid"):
        mode_serving_config(DrafterSpec.parse("hybrid:/d,/c.safetensors"), 3, "unused")
    register_kind(Kind("lookup", "ngram", "lookup:N", str.isdigit, lambda target, s, key: NgramDrafter(1, int(s.arg)),
                       serving=lambda s: {"prompt_lookup_min": 1, "prompt_lookup_max": int(s.arg)}))
    try:
        assert mode_serving_config(DrafterSpec.parse("lookup:6"), 2, "unused").vllm()["prompt_lookup_max"] == 6
    finally:
        KINDS.pop("lookup")
