"""An EAGLE-3 head as any draft: built from a spec or a registered version, its cost ratio, the
serving config (vLLM method eagle3, SGLang EAGLE3), the registry's tags and smoke test, and the
monitor's replay on the same target and on an updated one with new tokens."""

from __future__ import annotations

import json
import math

import pytest
import torch

from specdistill.modeling.drafts import measure_cost_ratio
from specdistill.modeling.eagle3_init import init_eagle3_from_target
from specdistill.modeling.eagle3_io import is_eagle3_dir, save_eagle3
from specdistill.modeling.models import load_model
from specdistill.modeling.vocab import DraftVocab
from specdistill.ops.serving import ServingConfig, read_serving_config, write_serving_config
from specdistill.speculative import DrafterSpec, EagleDrafter, drafter_from_spec, generate
from specdistill.speculative.harness_bench import measure_drafter_cost
from tests.conftest import save_tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("target"), layers=6, seed=4, tie=False)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir)


@pytest.fixture(scope="module")
def head_dir(target, tmp_path_factory):
    vocab = DraftVocab(torch.arange(0, 200), target.config.vocab_size)
    head = init_eagle3_from_target(target.model, vocab)
    meta = {"target_fingerprint": target.fingerprint, "target": str(target.path)}
    return save_eagle3(head, target.tokenizer, tmp_path_factory.mktemp("heads") / "eagle-v1", meta)


def test_a_head_directory_gives_the_eagle_drafter(target, head_dir):
    assert str(DrafterSpec.for_draft(head_dir)) == f"eagle3:{head_dir}"  # what the code writes for a head
    # a record written before the head was its own kind (`draft:DIR`) reads as `eagle3:DIR`
    assert str(DrafterSpec.parse(f"draft:{head_dir}")) == f"eagle3:{head_dir}"
    for drafter in (drafter_from_spec(target.model, f"eagle3:{head_dir}"), drafter_from_spec(target.model, f"draft:{head_dir}")):
        assert isinstance(drafter, EagleDrafter) and drafter.name == "eagle3:eagle-v1"
        assert drafter.feature_layers == [2, 3, 3] and drafter.vocab.size == 200
    out = generate(target.model, [5, 8, 13, 21], max_new_tokens=12, drafter=drafter, gamma=3, stop_token_ids=[])
    assert len(out.output_ids) == 12 and out.stats.counts.rounds >= 1 and out.stats.counts.proposed >= 3


def test_cost_ratio_of_a_head_step(target, head_dir):
    drafter = drafter_from_spec(target.model, f"eagle3:{head_dir}")
    c = measure_cost_ratio(target.model, drafter.head, context=32, repeats=7)
    assert math.isfinite(c) and 0 < c < 1  # one layer against six, fc and a 200-token head included
    assert 0 < measure_drafter_cost(target.model, drafter, context=32, repeats=5) < 1


def test_serving_config_for_an_eagle3_head(tmp_path, capsys):
    cfg = ServingConfig(mode="draft", draft_dir="/models/eagle-v3", draft_version="3", draft_kind="eagle3",
                        num_speculative_tokens=5, target_fingerprint="fp")
    assert cfg.vllm() == {"method": "eagle3", "model": "/models/eagle-v3", "num_speculative_tokens": 5}
    flags = cfg.sglang()
    assert flags[:4] == ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/models/eagle-v3"]
    assert flags[flags.index("--speculative-num-steps") + 1] == "5"
    assert flags[flags.index("--speculative-num-draft-tokens") + 1] == "6"
    path = write_serving_config(cfg, tmp_path / "serving.json")
    assert json.loads(path.read_text())["vllm"]["speculative_config"]["method"] == "eagle3"
    assert read_serving_config(path) == cfg

    from specdistill.cli import main

    assert main(["serving", "show", "--path", str(path)]) == 0
    shown = capsys.readouterr().out
    assert "EAGLE-3 head, version 3" in shown and '"method": "eagle3"' in shown and "EAGLE3" in shown
    # measured as a tree of 4 first-position candidates: SGLang gets the same tree, vLLM the chain
    tree = ServingConfig(mode="draft", draft_dir="/models/eagle-v3", draft_kind="eagle3", num_speculative_tokens=2,
                         tree_width=4)
    flags = tree.sglang()
    assert [flags[flags.index(f) + 1] for f in ("--speculative-num-steps", "--speculative-eagle-topk",
                                                "--speculative-num-draft-tokens")] == ["2", "4", "6"]
    assert tree.vllm() == {"method": "eagle3", "model": "/models/eagle-v3", "num_speculative_tokens": 2}
    assert read_serving_config(write_serving_config(tree, tmp_path / "tree.json")).tree_width == 4
    for bad, match in (({"mode": "ngram", "draft_kind": "eagle3"}, "served in draft mode"),
                       ({"mode": "draft", "draft_dir": "/d", "draft_kind": "medusa"}, "not one of"),
                       ({"mode": "draft", "draft_dir": "/d", "tree_width": 3}, "needs an EAGLE-3 head")):
        with pytest.raises(ValueError, match=match):
            ServingConfig(**bad)


def test_nightly_serving_config_knows_a_head_by_its_directory(head_dir, tmp_path):
    from dataclasses import replace

    from specdistill.pipeline.outputs import ServingDecision, TargetInfo
    from specdistill.pipeline.serving import serving_config

    decision = ServingDecision(mode="draft", name="challenger", spec=DrafterSpec.parse(f"draft_model:{head_dir}"), gamma=3, speedup=1.4,
                               reason="fastest", measured={"challenger": 1.4}, measured_on="harness")
    target = TargetInfo("t", "/t", "fp", num_layers=6, vocab_size=300, dtype="float32")
    cfg = serving_config(decision, target, registered_version="1", registered_dir=str(head_dir))
    assert cfg.draft_kind == "eagle3" and cfg.vllm()["method"] == "eagle3"
    # measured in llama.cpp: the command line that ran the head's GGUF, as serving.json and `serving show` give it
    args = ["-m", "/t.gguf", "-t", "2", "-md", "/gguf/head.gguf", "--spec-type", "draft-eagle3", "--spec-draft-n-max", "3"]
    cfg = serving_config(replace(decision, engine="llamacpp", llamacpp_args=args), target, "1", str(head_dir))
    assert cfg.llamacpp()["command"] == ("llama-server -m /t.gguf -t 2 -md /gguf/head.gguf --spec-type draft-eagle3 "
                                         "--spec-draft-n-max 3 --metrics")
    assert cfg.llamacpp()["command"] in cfg.render() and cfg.to_dict()["llamacpp"]["args"] == args
    layers_dir = save_tiny_target(tmp_path / "plain")  # an ordinary HF checkpoint stays draft_model
    plain = serving_config(replace(decision, spec=DrafterSpec("draft_model", str(layers_dir))), target)
    assert plain.draft_kind == "draft_model" and plain.vllm()["method"] == "draft_model"


def test_registry_tags_download_and_smoke_test(head_dir, target, tmp_path, monkeypatch):
    import mlflow

    from specdistill.ops import registry

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    reg = registry.register_draft(head_dir, target_name="tiny-eagle", tags={"target_fingerprint": target.fingerprint})
    mv = registry.client().get_model_version(reg.name, reg.version)
    assert mv.tags["draft_kind"] == "eagle3" and mv.tags["feature_layers"] == "2,3,3"
    assert mv.tags["draft_vocab_size"] == "200" and mv.tags["target_fingerprint"] == target.fingerprint
    local = registry.download_draft(reg.model_uri)
    assert is_eagle3_dir(local)
    assert isinstance(drafter_from_spec(target.model, f"draft_model:{reg.model_uri}"), EagleDrafter)
    model = mlflow.pyfunc.load_model(reg.model_uri)  # the smoke test decodes with the head's target
    [text] = model.predict(["hello world"])  # 16 new tokens
    greedy = generate(target.model, target.tokenizer("hello world")["input_ids"], max_new_tokens=16)
    assert text == target.tokenizer.decode(greedy.output_ids, skip_special_tokens=True)


def test_monitor_replays_a_head_on_its_target_and_on_an_updated_one(head_dir, target_dir, tmp_path):
    from specdistill.data.logstore import LogStore
    from specdistill.ops.demo_update import add_domain_tokens
    from specdistill.ops.replay import replay_acceptance
    from tests.test_monitor import fill_store

    store = LogStore(f"sqlite:///{tmp_path / 'logs.db'}")
    fill_store(store)
    same = replay_acceptance(target_dir, str(head_dir), store, n_prompts=3, gamma=3, max_new_tokens=10,
                             min_draft_tokens=5, progress=False)
    assert same.ok and not same.vocab_transplanted and same.counts.proposed >= 5

    new = load_model(target_dir)
    add_domain_tokens(new.model, new.tokenizer, ("QuantLib", "CalcBlackScholesVega"))
    moved = replay_acceptance(new, str(head_dir), store, n_prompts=3, gamma=3, max_new_tokens=10,
                              min_draft_tokens=5, progress=False)
    assert moved.ok and moved.vocab_mismatch and moved.vocab_transplanted and "vocabulary" in moved.reason
    strict = replay_acceptance(new, str(head_dir), store, on_vocab_mismatch="zero", progress=False)
    assert strict.ok and strict.acceptance_rate == 0.0 and strict.reason.startswith("vocabulary mismatch")
    store.close()


def test_nightly_warm_start_carries_a_head_over_a_tokenizer_change_once(head_dir, tmp_path, monkeypatch):
    from specdistill.modeling import eagle3_io
    from specdistill.modeling.eagle3_io import load_eagle3
    from specdistill.pipeline.nightly_recipe import load_nightly_config, run_root
    from specdistill.pipeline.outputs import Champion
    from specdistill.pipeline.stages.align import align_champion
    from tests.conftest import make_tiny_llama, train_bpe

    new_tok = train_bpe(300)
    new_tok.add_tokens(["CalcBlackScholesVega"])
    new_target = tmp_path / "target-v2"
    make_tiny_llama(vocab_size=len(new_tok), layers=6, seed=1).save_pretrained(new_target)
    new_tok.save_pretrained(new_target)
    champion = Champion("draft-tiny", "1", str(head_dir))
    config = load_nightly_config(None, [f"target={new_target}"])
    warm = align_champion(config, champion)
    assert warm.transplanted and warm.dir.startswith(str(run_root() / "aligned"))
    assert not warm.vocab_report["identical"]
    head = load_eagle3(warm.dir, load_model(new_target).model).head  # now a head for the new target, as it is
    assert new_tok.convert_tokens_to_ids("CalcBlackScholesVega") in head.draft_vocab.token_ids.tolist()
    monkeypatch.setattr(eagle3_io, "save_eagle3", lambda *a, **k: pytest.fail("a carried-over head on disk is reused"))
    assert align_champion(config, champion) == warm


def test_nightly_starts_from_the_target_and_says_why_when_the_champion_head_does_not_fit(head_dir, tmp_path):
    from specdistill.pipeline.nightly_recipe import load_nightly_config
    from specdistill.pipeline.outputs import Champion, WarmStart
    from specdistill.pipeline.stages.align import align_champion
    from specdistill.pipeline.stages.champion import started_from
    from tests.conftest import make_tiny_llama, train_bpe

    wider = tmp_path / "target-wide"  # the update changed the width: no weight of the head fits any more
    make_tiny_llama(vocab_size=len(train_bpe(300)), hidden=48, layers=6, seed=1).save_pretrained(wider)
    train_bpe(300).save_pretrained(wider)
    champion = Champion("draft-tiny", "1", str(head_dir), {"target_fingerprint": "old"})
    warm = align_champion(load_nightly_config(None, [f"target={wider}"]), champion)
    assert not warm.usable and "target hidden size 48" in warm.unfit
    line = started_from(warm, champion, "new")
    assert line.startswith("training started from the target's weights") and "hidden size 48" in line
    assert warm.lineage_tags()["warm_start_target_fingerprint"] == "old" and "warm_start_unfit" in warm.lineage_tags()
    # a head that fits, trained for an earlier version, is carried over and says across which update
    fits = started_from(WarmStart(**vars(champion)), champion, "new")
    assert "from the champion, version 1 (trained for target old, before the update to new)" in fits
