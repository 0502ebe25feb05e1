"""`draft import` / `draft export`: heads in the speculators format and the EAGLE-3/SpecForge layout, both ways.

The tests marked with `speculators_env` run speculators' own classes in its own venv (`make speculators`),
in a subprocess (tests/speculators_side.py): a checkpoint it builds imports and drafts the same logits
here, and speculators' config and model classes load what `draft export --format speculators` writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdistill.modeling.eagle3 import NORM_OPTIONS, Eagle3ShapeError
from specdistill.modeling.eagle3_files import META_FILE, WEIGHTS_FILE
from specdistill.modeling.eagle3_formats import HeadFormatError
from specdistill.modeling.eagle3_import import export_head, import_head
from specdistill.modeling.eagle3_init import init_eagle3_from_target
from specdistill.modeling.eagle3_io import load_eagle3, save_eagle3
from specdistill.modeling.models import load_model
from specdistill.modeling.vocab import DraftVocab
from tests import test_eagle3_train
from tests.conftest import save_tiny_target, train_bpe

pytestmark = pytest.mark.usefixtures("one_thread")
eagle_world = test_eagle3_train.eagle_world  # the fixture: a tiny target and its greedy answers
SIDE = Path(__file__).with_name("speculators_side.py")
AUX = [1, 3, 4]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("target"), layers=6, seed=1, tie=False)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir, dtype="float32")  # the exact-arithmetic tests


@pytest.fixture(scope="module")
def head_dir(target, tmp_path_factory):
    vocab = DraftVocab(torch.arange(40, 140), target.config.vocab_size)
    head = init_eagle3_from_target(target.model, vocab, AUX)
    with torch.no_grad():
        head.fc.weight.normal_(0, 0.1)
    meta = {"target_fingerprint": target.fingerprint, "target": str(target.path), "unroll_steps": 2}
    return save_eagle3(head, target.tokenizer, tmp_path_factory.mktemp("heads") / "head", meta)


def inputs(target, seed: int = 0, length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Features [1, T, 3H] and next tokens [1, T] for a head's training-time-test pass."""
    g = torch.Generator().manual_seed(seed)
    next_ids = torch.randint(3, target.config.vocab_size, (1, length), generator=g)
    features = torch.randn(1, length, 3 * target.config.hidden_size, generator=g)
    return features, next_ids


def unrolled(head_dir, target, features, next_ids, steps: int = 3) -> list[torch.Tensor]:
    head = load_eagle3(head_dir, target.model).head
    with torch.no_grad():
        return head.unroll(next_ids, features, steps, torch.ones_like(next_ids, dtype=torch.bool))


def test_speculators_round_trip_keeps_weights_logits_and_lineage(head_dir, target, tmp_path):
    exported = export_head(head_dir, tmp_path / "spec", format="speculators")
    config = json.loads((exported / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["transformer_layer_config"]["num_hidden_layers"] == 1
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX and config["draft_vocab_size"] == 100
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(target.path)
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2  # the head's trained depth
    names = set(load_file(str(exported / WEIGHTS_FILE)))
    assert "layers.0.self_attn.q_proj.weight" in names and not any(n.startswith("midlayer.") for n in names)
    assert {"d2t", "t2d", "fc.weight", "lm_head.weight"} <= names and "embed_tokens.weight" not in names

    done = import_head(exported, target, tmp_path / "back")
    assert done.source_format == "speculators" and len(done.source_sha256) == 64
    meta = json.loads((done.out / META_FILE).read_text())
    assert meta["imported_from"] == str(exported.resolve()) and meta["source_sha256"] == done.source_sha256
    assert meta["target_fingerprint"] == target.fingerprint and meta["unroll_steps"] == 2
    original, back = load_file(str(head_dir / WEIGHTS_FILE)), load_file(str(done.out / WEIGHTS_FILE))
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
    features, next_ids = inputs(target)
    for a, b in zip(unrolled(head_dir, target, features, next_ids), unrolled(done.out, target, features, next_ids)):
        assert torch.equal(a, b)
    # the default layout is today's: the same files back
    plain = export_head(head_dir, tmp_path / "plain")
    assert load_file(str(plain / WEIGHTS_FILE)).keys() == original.keys()
    assert import_head(plain, target, tmp_path / "plain-back").source_format == "eagle3"


def _edit(src: Path, dst: Path, config=None, tensors=None) -> Path:
    """A copy of a checkpoint directory with its config.json and/or weights edited."""
    import shutil

    shutil.copytree(src, dst)
    if config:
        data = json.loads((dst / "config.json").read_text())
        config(data)
        (dst / "config.json").write_text(json.dumps(data))
    if tensors:
        weights = load_file(str(dst / WEIGHTS_FILE))
        tensors(weights)
        save_file(weights, str(dst / WEIGHTS_FILE))
    return dst


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.update(qk_norm=True), r"`qk_norm: true` \(RMS norms on the attention's queries and keys\) is not implemented"),
    (lambda c: c.update(norm_before_fc=True, fc_norm=True), "norm_before_fc and fc_norm are both set, and they are exclusive"),
    (lambda c: c["transformer_layer_config"].update(num_hidden_layers=2), "num_hidden_layers 2: .* exactly one decoder layer"),
    (lambda c: c["transformer_layer_config"].update(model_type="qwen3"), "a 'qwen3' decoder layer is not implemented"),
    (lambda c: c.update(speculators_model_type="dflash"), "speculators model type 'dflash' is not an EAGLE-3 head"),
])
def test_options_the_head_lacks_are_refused_by_name(head_dir, target, tmp_path, edit, match):
    src = _edit(export_head(head_dir, tmp_path / "spec", format="speculators"), tmp_path / "edited", config=edit)
    with pytest.raises(HeadFormatError, match=match):
        import_head(src, target, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("config, tensors, match", [
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 3, 6]), None, "reads target layer 6, the target's final hidden state"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 3, 9]), None, r"reads target layers \[1, 3, 9\], the target has 6"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 3]), None, "reads 2 target layers"),
    (lambda c: c["transformer_layer_config"].update(vocab_size=512), None, "target vocabulary 300, head built for 512"),
    (lambda c: c["speculators_config"]["verifier"].update(architectures=["Qwen3ForCausalLM"]), None,
     "trained for a Qwen3ForCausalLM verifier"),
    (None, lambda w: w["d2t"].add_(400), "d2t maps draft token 0 to target id 440, outside the target tokenizer's 300 tokens"),
    (None, lambda w: w["t2d"].__setitem__(0, True), "t2d marks 101 target tokens and disagrees with d2t"),
    (None, lambda w: w.__setitem__("embed_tokens.weight", torch.randn(300, 32)), "own token embeddings .* differ"),
    (None, lambda w: w.__setitem__("fc_norm.0.weight", torch.ones(32)), r"do not hold the tensors .*'fc_norm.0.weight'"),
    (lambda c: c.update(norm_before_fc=True), None, r"do not hold the tensors .*'input_norm.weight'"),
])
def test_a_head_that_does_not_fit_the_target_is_refused_in_one_sentence(head_dir, target, tmp_path, config, tensors, match):
    src = _edit(export_head(head_dir, tmp_path / "spec", format="speculators"), tmp_path / "edited", config, tensors)
    with pytest.raises(Eagle3ShapeError, match=match) as err:  # HeadFormatError, or check_fits' own
        import_head(src, target, tmp_path / "out")
    assert "\n" not in str(err.value) and str(src) in str(err.value)
    assert not (tmp_path / "out").exists()


# Eagle 3.1: speculators 0.9's `train` default recipe, and each switch alone
DEFAULT_RECIPE = {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}
RECIPES = {"default-recipe": DEFAULT_RECIPE, **{name: {name: True} for name in NORM_OPTIONS}}


def _normed(head_dir: Path, dst: Path, options: dict[str, bool]) -> Path:
    """The head with Eagle 3.1 switches set in its config.json and the norms they add (random weights)."""
    g = torch.Generator().manual_seed(11)
    width = json.loads((head_dir / "config.json").read_text())["target_hidden_size"]
    added = {}
    if options.get("norm_before_fc"):
        added["input_norm.weight"] = 1 + 0.2 * torch.randn(3 * width, generator=g)
    if options.get("fc_norm"):
        added.update({f"fc_norm.{i}.weight": 1 + 0.2 * torch.randn(width, generator=g) for i in range(3)})
    return _edit(head_dir, dst, config=lambda c: c.update(options), tensors=lambda w: w.update(added))


@pytest.mark.parametrize("options", [DEFAULT_RECIPE, {"fc_norm": True, "norm_output": True}], ids=["default-recipe", "fc_norm"])
def test_the_engine_layout_and_speculators_format_carry_the_norm_switches(head_dir, target, tmp_path, options):
    """vLLM's llama_eagle3.py reads the switches from the EAGLE-3 layout's config.json at top level and loads
    `input_norm` / `fc_norm.N`, so the default export writes them as they are; both formats import back to
    the same drafts, which the switches change."""
    normed = _normed(head_dir, tmp_path / "normed", options)
    features, next_ids = inputs(target, seed=2)
    ours = unrolled(normed, target, features, next_ids)
    assert not torch.allclose(ours[1], unrolled(head_dir, target, features, next_ids)[1])
    for fmt in ("eagle3", "speculators"):
        exported = export_head(normed, tmp_path / fmt, format=fmt)
        config = json.loads((exported / "config.json").read_text())
        assert {name for name in NORM_OPTIONS if config.get(name)} == set(options)
        names = set(load_file(str(exported / WEIGHTS_FILE)))
        assert ("input_norm.weight" in names) == bool(options.get("norm_before_fc"))
        assert ("fc_norm.2.weight" in names) == bool(options.get("fc_norm"))
        back = import_head(exported, target, tmp_path / f"{fmt}-back")
        for a, b in zip(ours, unrolled(back.out, target, features, next_ids)):
            assert torch.equal(a, b)


def test_norm_before_fc_inside_eagle_config_is_read_as_vllm_reads_it(head_dir, target, tmp_path):
    """NVIDIA's checkpoints put `norm_before_fc` in `eagle_config`; vLLM reads it there first."""
    normed = _normed(head_dir, tmp_path / "normed", {"norm_before_fc": True})

    def nest(c):
        del c["norm_before_fc"]
        c["eagle_config"]["norm_before_fc"] = True

    nested = _edit(normed, tmp_path / "nested", config=nest)
    done = import_head(nested, target, tmp_path / "out")
    assert json.loads((done.out / "config.json").read_text())["norm_before_fc"] is True
    features, next_ids = inputs(target)
    for a, b in zip(unrolled(normed, target, features, next_ids), unrolled(done.out, target, features, next_ids)):
        assert torch.equal(a, b)


def test_a_specforge_checkpoint_with_its_own_embeddings_and_no_t2d_imports(head_dir, target, tmp_path):
    """SpecForge's layout: the target's embeddings saved with the head (in bf16), no t2d, no eagle_config (vLLM's
    default feature layers then: 2, N/2, N-3)."""
    def tensors(w):
        del w["t2d"]
        w["embed_tokens.weight"] = target.model.get_input_embeddings().weight.detach().to(torch.bfloat16)

    src = _edit(head_dir, tmp_path / "specforge", config=lambda c: c.pop("eagle_config"), tensors=tensors)
    (src / META_FILE).unlink()
    done = import_head(src, target, tmp_path / "out")
    head = load_eagle3(done.out, target.model).head
    assert head.aux_layers == [2, 3, 3] and int(head.t2d.sum()) == 100 and head.draft_vocab.token_ids[0] == 40
    assert "unroll_steps" not in done.meta  # nothing says how deep it was trained: no cap on γ


def test_a_tokenizer_beside_the_head_must_be_the_targets(head_dir, target, tmp_path):
    src = _edit(export_head(head_dir, tmp_path / "spec", format="speculators"), tmp_path / "edited")
    train_bpe(300, ["completely different words for another tokenizer"] * 50).save_pretrained(src)
    with pytest.raises(HeadFormatError, match="the tokenizer saved with the head differs from the target's"):
        import_head(src, target, tmp_path / "out")


def test_draft_import_and_export_commands(head_dir, target_dir, tmp_path, capsys):
    from specdistill.cli import main

    assert main(["draft", "export", str(head_dir), "--format", "speculators", "--out", str(tmp_path / "s"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"out": str(tmp_path / "s"), "format": "speculators"}
    assert main(["draft", "import", str(tmp_path / "s"), "--target", str(target_dir), "--out", str(tmp_path / "i"),
                 "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["source_format"] == "speculators" and payload["kind"] == "eagle3"
    bad = _edit(tmp_path / "s", tmp_path / "bad", config=lambda c: c.update(qk_norm=True))
    assert main(["draft", "import", str(bad), "--target", str(target_dir), "--out", str(tmp_path / "j")]) != 0
    assert "`qk_norm: true`" in capsys.readouterr().err and not (tmp_path / "j").exists()


def test_an_imported_head_is_registered_with_its_lineage(head_dir, target, tmp_path, monkeypatch):
    from specdistill.ops import registry

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    done = import_head(export_head(head_dir, tmp_path / "s", format="speculators"), target, tmp_path / "i")
    reg = registry.register_draft(done.out, target_name="tiny-import", tags={"target_fingerprint": target.fingerprint})
    tags = registry.client().get_model_version(reg.name, reg.version).tags
    assert tags["draft_kind"] == "eagle3" and tags["source_format"] == "speculators"
    assert tags["imported_from"] == str((tmp_path / "s").resolve()) and tags["source_sha256"] == done.source_sha256


# --------------------------------------------------------------------------------------------
# speculators' own classes, in their own venv


def _side(env, action: str, spec: dict, tmp_path: Path) -> dict:
    spec_file = tmp_path / f"{action}.json"
    spec_file.write_text(json.dumps(spec))
    done = env.run(str(SIDE), action, str(spec_file), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("reduced", [True, False])
def test_a_checkpoint_speculators_built_imports_and_drafts_the_same_logits(speculators_env, target_dir, target,
                                                                           tmp_path, reduced):
    """speculators' Eagle3DraftModel (eager attention, fp32) and the imported head give the same draft logits
    at each of 3 training-time-test steps on the same features and tokens."""
    features, next_ids = inputs(target, seed=3)
    save_file({"features": features, "next_ids": next_ids}, str(tmp_path / "inputs.safetensors"))
    draft_ids = list(range(20, 220)) if reduced else []
    spec = {"target": str(target_dir), "out": str(tmp_path / "speculators-head"), "aux_layers": AUX, "steps": 3,
            "draft_vocab_size": 200 if reduced else 300, "draft_ids": draft_ids, "seed": 5,
            "inputs": str(tmp_path / "inputs.safetensors"), "logits": str(tmp_path / "logits.safetensors")}
    ran = _side(speculators_env, "build", spec, tmp_path)
    assert ran["steps"] == 3 and ran["attn"] == "eager"
    theirs = load_file(str(tmp_path / "logits.safetensors"))
    done = import_head(spec["out"], target, tmp_path / "imported")
    assert done.meta["unroll_steps"] == 3  # the proposal's speculative_tokens
    ours = unrolled(done.out, target, features, next_ids)
    for j, logits in enumerate(ours):
        valid = next_ids.shape[1] - j  # speculators pads the shifted tokens with 0 past the end, as the head does
        torch.testing.assert_close(logits[:, :valid], theirs[f"step{j}"][:, :valid], rtol=1e-5, atol=1e-5)
    head = load_eagle3(done.out, target.model).head
    assert head.draft_vocab.token_ids.tolist() == (draft_ids or list(range(300)))


def _agree(ours: list[torch.Tensor], theirs: dict[str, torch.Tensor], length: int) -> None:
    """fp32 rounding only: logits of scale ~6 agree to 2e-5 by step 3 (leaving a switch out moves them by 3 to 9)."""
    for j, logits in enumerate(ours):
        valid = length - j  # speculators pads the shifted tokens with 0 past the end, as the head does
        torch.testing.assert_close(logits[:, :valid], theirs[f"step{j}"][:, :valid], rtol=1e-5, atol=5e-5)


@pytest.mark.parametrize("options", RECIPES.values(), ids=RECIPES.keys())
def test_an_eagle31_checkpoint_speculators_built_drafts_the_same_logits_and_exports_back(
        speculators_env, target_dir, target, tmp_path, options):
    """Eagle 3.1 heads as `speculators train` makes them (its default recipe, each switch alone): imported, the
    head drafts speculators' logits at 3 training-time-test steps; exported again, speculators' classes load it
    and draft the same."""
    features, next_ids = inputs(target, seed=4)
    save_file({"features": features, "next_ids": next_ids}, str(tmp_path / "inputs.safetensors"))
    spec = {"target": str(target_dir), "out": str(tmp_path / "speculators-head"), "aux_layers": AUX, "steps": 3,
            "draft_vocab_size": 200, "draft_ids": list(range(20, 220)), "seed": 6, "options": options,
            "inputs": str(tmp_path / "inputs.safetensors"), "logits": str(tmp_path / "logits.safetensors")}
    _side(speculators_env, "build", spec, tmp_path)
    done = import_head(spec["out"], target, tmp_path / "imported")
    config = json.loads((done.out / "config.json").read_text())
    assert {name for name in NORM_OPTIONS if config.get(name)} == set(options)
    ours = unrolled(done.out, target, features, next_ids)
    _agree(ours, load_file(spec["logits"]), next_ids.shape[1])

    exported = export_head(done.out, tmp_path / "export", format="speculators", target=str(target_dir))
    back = {**spec, "out": str(exported), "logits": str(tmp_path / "back.safetensors")}
    _side(speculators_env, "load", back, tmp_path)
    _agree(ours, load_file(back["logits"]), next_ids.shape[1])


def test_speculators_classes_load_the_export_and_agree(speculators_env, head_dir, target_dir, target, tmp_path):
    exported = export_head(head_dir, tmp_path / "spec", format="speculators", target=str(target_dir))
    features, next_ids = inputs(target, seed=7)
    save_file({"features": features, "next_ids": next_ids}, str(tmp_path / "inputs.safetensors"))
    spec = {"target": str(target_dir), "out": str(exported), "steps": 2,
            "inputs": str(tmp_path / "inputs.safetensors"), "logits": str(tmp_path / "logits.safetensors")}
    ran = _side(speculators_env, "load", spec, tmp_path)
    assert ran["d2t"] == [40, 40, 40]  # offsets: draft id i is target id 40 + i
    theirs = load_file(str(tmp_path / "logits.safetensors"))
    for j, logits in enumerate(unrolled(head_dir, target, features, next_ids, steps=2)):
        valid = next_ids.shape[1] - j
        torch.testing.assert_close(logits[:, :valid], theirs[f"step{j}"][:, :valid], rtol=1e-5, atol=1e-5)



# --------------------------------------------------------------------------------------------
# an imported head works wherever a head does: bench, warm start of a night


def test_an_imported_head_benches_and_warm_starts_a_night_as_the_original(eagle_world, tmp_path, capsys):
    """A head brought in (speculators format) is the head it was exported from: the same per-position acceptance
    in `bench` (lossless), and a night started from it trains exactly as one started from the original."""
    from specdistill.cli import main
    from specdistill.distill.train import distill
    _eagle_config = test_eagle3_train._eagle_config

    first = distill(_eagle_config(eagle_world, tmp_path / "night1", "optim.max_steps=30", "eval_every=15"))
    target = load_model(eagle_world / "target", dtype="float32")
    done = import_head(export_head(first.draft_dir, tmp_path / "s", format="speculators"), target, tmp_path / "imported")
    prompts = tmp_path / "question.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "c", "turns": [t]}) + "\n" for i, t in
                               enumerate(["hello world, the quick brown fox", "def add(a, b): return a + b",
                                          "speculative decoding drafts tokens"])))
    capsys.readouterr()  # what training printed
    benched = {}
    for name, head in (("original", first.draft_dir), ("imported", done.out)):
        assert main(["bench", "--target", str(eagle_world / "target"), "--draft", str(head), "--prompts", str(prompts),
                     "--dtype", "float32", "--gamma", "3", "--max-new-tokens", "12", "--repeats", "1", "--threads", "1",
                     "--json"]) == 0
        benched[name] = json.loads(capsys.readouterr().out)
    assert benched["imported"]["lossless"] is True and benched["imported"]["drafter"].startswith("eagle3:")
    assert benched["imported"]["first_position_acceptance"] > 0  # a trained head, so equality below says something
    assert benched["imported"]["per_position_acceptance"] == benched["original"]["per_position_acceptance"]

    nights = {name: distill(_eagle_config(eagle_world, tmp_path / name, "optim.max_steps=3", "eval_every=3",
                                          f"draft={start}"))
              for name, start in (("from-original", first.draft_dir), ("from-imported", done.out))}
    a, b = nights["from-original"], nights["from-imported"]
    assert b.steps == 3 and b.curve[0]["acceptance"] == pytest.approx(first.curve[-1]["acceptance"])
    assert [c["acceptance_per_position"] for c in b.curve] == [c["acceptance_per_position"] for c in a.curve]
    meta = json.loads((Path(b.draft_dir) / META_FILE).read_text())
    assert meta["warm_start"]["dir"] == str(done.out)


def test_a_night_warm_started_from_an_eagle31_head_keeps_its_switches(eagle_world, tmp_path):
    """The unroll trains the head it was given: the switches and their norms stay (trained) in what it saves."""
    from specdistill.distill.train import distill
    _eagle_config = test_eagle3_train._eagle_config

    first = distill(_eagle_config(eagle_world, tmp_path / "night1", "optim.max_steps=1", "eval_every=1"))
    normed = _normed(Path(first.draft_dir), tmp_path / "normed", DEFAULT_RECIPE)
    night = distill(_eagle_config(eagle_world, tmp_path / "night2", "optim.max_steps=2", "eval_every=2", f"draft={normed}"))
    config = json.loads((Path(night.draft_dir) / "config.json").read_text())
    assert {name for name in NORM_OPTIONS if config.get(name)} == set(DEFAULT_RECIPE)
    start, trained = load_file(str(normed / WEIGHTS_FILE)), load_file(str(Path(night.draft_dir) / WEIGHTS_FILE))
    assert start.keys() == trained.keys() and not torch.equal(start["input_norm.weight"], trained["input_norm.weight"])


def test_import_leaves_the_target_in_its_own_dtype(head_dir, target_dir, tmp_path):
    """The imported head is cast to its source's dtype; the target it shares embeddings with is not."""
    bf16 = load_model(target_dir, dtype="bfloat16")
    import_head(export_head(head_dir, tmp_path / "s", format="speculators"), bf16, tmp_path / "i")
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
