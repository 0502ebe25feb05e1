"""Drafter specs: parsed once, written back as they were read, extended with a new kind in one place."""

from __future__ import annotations

import json

import pytest

from specdistill.speculative import NgramDrafter, SelfSpecDrafter
from specdistill.speculative.specs import (
    KINDS,
    DrafterSpec,
    DrafterSpecError,
    Kind,
    drafter_from_spec,
    register_kind,
    serving_modes,
)
from tests.conftest import make_tiny_llama


@pytest.mark.parametrize("text, mode, fields", [
    ("draft_model:/d/challenger", "draft", {"path": "/d/challenger", "exit_layer": None, "ngram_sizes": None}),
    ("eagle3:/d/head", "draft", {"path": "/d/head", "exit_layer": None, "ngram_sizes": None}),
    ("hybrid:self-spec:2,/c.bin,1.5", "hybrid", {"path": None, "corpus": "/c.bin"}),
    ("self-spec:8", "self-spec", {"path": None, "exit_layer": 8, "ngram_sizes": None}),
    ("ngram", "ngram", {"ngram_sizes": (1, 3)}),
    ("ngram:2,4", "ngram", {"ngram_sizes": (2, 4)}),
])
def test_a_spec_is_parsed_once_into_typed_fields_and_written_back_as_it_was(text, mode, fields):
    spec = DrafterSpec.parse(text)
    assert str(spec) == text and spec.mode == mode and DrafterSpec.parse(spec) is spec
    assert {name: getattr(spec, name) for name in fields} == fields
    run = spec.with_(gamma=3, tree_width=4)
    assert (run.gamma, run.tree_width, str(run)) == (3, 4, text)  # measured settings, not part of the text


def test_self_spec_has_one_spelling_and_records_written_before_still_read():
    old = DrafterSpec.parse("self_spec:8")  # a spec recorded before (MLflow, serving.json's record, a result)
    assert old == DrafterSpec.parse("self-spec:8") == DrafterSpec("self_spec", "8")
    assert (str(old), old.kind, old.exit_layer, old.mode) == ("self-spec:8", "self-spec", 8, "self-spec")


def test_the_layer_draft_has_one_name_and_specs_written_before_still_read():
    """`draft_model:DIR` (vLLM's method); a `draft:DIR` recorded before (a result, a report's spec, MLflow) reads
    as it, and is written back under the one name."""
    old = DrafterSpec.parse("draft:/d/challenger")
    assert old == DrafterSpec.parse("draft_model:/d/challenger") == DrafterSpec("draft", "/d/challenger")
    assert (str(old), old.kind, old.mode, old.of.draft_kind) == ("draft_model:/d/challenger", "draft_model", "draft",
                                                                   "draft_model")


def test_a_head_is_its_own_kind_and_a_draft_record_naming_one_reads_as_it(tmp_path):
    """`draft:DIR` was written for heads before they had a kind: read in the parser alone, as `eagle3:DIR` (and so is
    `draft_model:DIR` naming a head's directory)."""
    head, plain = tmp_path / "head", tmp_path / "plain"
    for d, arch in ((head, "LlamaForCausalLMEagle3"), (plain, "LlamaForCausalLM")):
        d.mkdir()
        config = {"architectures": [arch], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}}
        (d / "config.json").write_text(json.dumps(config))
    assert str(DrafterSpec.parse(f"draft:{head}")) == f"eagle3:{head}" == str(DrafterSpec.for_draft(head))
    assert str(DrafterSpec.parse(f"draft_model:{head}")) == f"eagle3:{head}"
    assert str(DrafterSpec.parse(f"draft:{plain}")) == f"draft_model:{plain}" == str(DrafterSpec.for_draft(plain))
    assert str(DrafterSpec.parse("draft:models:/draft@champion")) == "draft_model:models:/draft@champion"  # resolved when built
    assert DrafterSpec.parse(f"hybrid:{head},/c.bin").path == str(head)
    eagle3 = KINDS["eagle3"]
    assert DrafterSpec.parse(f"draft:{head}").serving_keys() == {"mode": "draft", "draft_kind": "eagle3"}
    assert eagle3.tree and eagle3.on_target and not KINDS["draft_model"].tree
    assert eagle3.feature_layers(str(head)) == [1, 3, 5] and KINDS["draft_model"].feature_layers(str(plain)) is None
    registered = DrafterSpec.parse("draft:models:/draft@champion")  # a reference, resolved to its directory when built
    assert str(registered.resolved(str(head))) == f"eagle3:{head}" and registered.resolved(str(plain)).kind == "draft_model"


def test_the_serving_modes_are_read_from_the_kinds():
    from specdistill.ops.serving import ServingConfig

    assert serving_modes() == ("draft", "self-spec", "ngram", "suffix", "off")  # hybrid is never served
    assert not DrafterSpec.parse("hybrid:/d,/c.safetensors").served and DrafterSpec.parse("suffix:/c").served
    register_kind(Kind("lookahead", "lookahead", "lookahead:N", str.isdigit, lambda target, s, key: None))
    try:
        assert "lookahead" in serving_modes() and ServingConfig(mode="lookahead").mode == "lookahead"
    finally:
        KINDS.pop("lookahead")
    with pytest.raises(ValueError, match="not one of"):
        ServingConfig(mode="lookahead")


@pytest.mark.parametrize("bad", ["draft:", "self-spec:x", "self_spec:x", "self-spec:", "ngram:2", "ngram:a,b", "medusa:3",
                                 ""])
def test_a_bad_spec_is_refused_naming_the_known_forms(bad):
    with pytest.raises(DrafterSpecError, match="unknown drafter spec .*draft_model:DIR, self-spec:K, ngram or ngram:MIN,MAX"):
        DrafterSpec.parse(bad)


def test_a_new_kind_is_one_registration():
    register_kind(Kind("lookup", "ngram", "lookup:N", str.isdigit, lambda target, s, fingerprint: NgramDrafter(1, int(s.arg))))
    try:
        spec = DrafterSpec.parse("lookup:5")
        assert spec.mode == "ngram" and drafter_from_spec(None, spec).max_n == 5
        with pytest.raises(ValueError, match="already registered"):
            register_kind(KINDS["lookup"])
    finally:
        KINDS.pop("lookup")


def test_specs_build_drafters_that_state_their_capabilities():
    target = make_tiny_llama(layers=4, seed=2)
    early = drafter_from_spec(target, DrafterSpec.parse("self_spec:2").with_(tree_width=3))
    assert isinstance(early, SelfSpecDrafter) and early.tree_width == 3 and early.model is not None
    assert early.feature_layers == ()  # drafts without the target's features
    ngram = drafter_from_spec(target, "ngram:2,4")
    assert (ngram.tree_width, ngram.model, tuple(ngram.feature_layers)) == (1, None, ())
    with pytest.raises(NotImplementedError, match="chains only"):
        ngram.propose_tree(None, 2)


def test_a_heads_kind_is_read_from_its_directory_without_torch(tmp_path):
    """`serving show` and every record read back parse specs: telling a head from a layer draft reads its
    config.json, and must not import torch (seconds of start-up) to do so."""
    import subprocess
    import sys

    head, layers = tmp_path / "head", tmp_path / "layers"
    for d, arch in ((head, "LlamaForCausalLMEagle3"), (layers, "LlamaForCausalLM")):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"architectures": [arch]}))
    code = ("import sys; from specdistill.speculative.specs import DrafterSpec; "
            f"print(DrafterSpec.parse('draft:{head}').kind, DrafterSpec.parse('draft:{layers}').kind, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["eagle3", "draft_model", "False"]
