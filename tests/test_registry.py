"""The registry on a local SQLite MLflow: versions, tags, aliases, promotion with the serving config."""

import json
import os
import threading
import types
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from specdistill.modeling.drafts import save_draft
from specdistill.modeling.models import load_model
from specdistill.ops import registry
from specdistill.ops.serving import ServingConfig, read_serving_config
from specdistill.pipeline.outputs import WarmStart
from tests.conftest import make_tiny_llama, train_bpe


@pytest.fixture(scope="module")
def _tracking_db(tmp_path_factory):
    """One MLflow database for the module (creating its tables takes seconds); tests use distinct targets."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture(autouse=True)
def _shared_tracking(_tracking_db, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", _tracking_db)


@pytest.fixture
def draft_dir(tmp_path):
    tok = train_bpe(300)
    return save_draft(make_tiny_llama(vocab_size=len(tok)), tok, tmp_path / "my-draft-v7")  # any directory name


def test_register_promote_and_download(draft_dir, tmp_path):
    reg = registry.register_draft(
        draft_dir, target_name="tiny-target", params={"lr": 1e-3}, metrics={"acceptance_rate": 0.61},
        curves={"train_loss": [3.0, 2.5, 2.1]}, tags={"target_fingerprint": "abc", "parent": ""},
    )
    assert reg.name == "draft-tiny-target" and reg.version == "1"
    assert str(registry.version_by_alias(reg.name, registry.CHALLENGER).version) == "1"
    assert registry.version_by_alias(reg.name, registry.CHAMPION) is None
    mv = registry.client().get_model_version(reg.name, "1")
    assert mv.tags["target_fingerprint"] == "abc"
    history = registry.client().get_metric_history(reg.run_id, "train_loss")
    assert [m.value for m in history] == [3.0, 2.5, 2.1]

    serving = ServingConfig(mode="draft", draft_dir=str(draft_dir), draft_version="1")
    registry.promote(reg.name, "1", serving, expected_champion=None)
    assert str(registry.version_by_alias(reg.name, registry.CHAMPION).version) == "1"
    assert read_serving_config().draft_version == "1"

    local = registry.download_draft(f"models:/{reg.name}@champion")
    assert (local / "config.json").is_file()
    AutoModelForCausalLM.from_pretrained(local)
    loaded = load_model(f"models:/{reg.name}@champion")  # a model reference like any other
    assert loaded.path == local


def test_stale_promotion_changes_nothing(draft_dir):
    target = "stale"
    a = registry.register_draft(draft_dir, target_name=target)
    b = registry.register_draft(draft_dir, target_name=target, tags={"parent": a.version})
    registry.promote(a.name, a.version, ServingConfig(mode="draft", draft_dir="/a"), expected_champion=None)
    # b was benchmarked when there was no champion: the comparison is stale now
    with pytest.raises(registry.PromotionConflict):
        registry.promote(b.name, b.version, ServingConfig(mode="draft", draft_dir="/b"), expected_champion=None)
    assert str(registry.version_by_alias(a.name, registry.CHAMPION).version) == a.version
    assert read_serving_config().draft_dir == "/a"


def test_failed_serving_write_rolls_back_the_alias(draft_dir, monkeypatch):
    target = "rollback"
    a = registry.register_draft(draft_dir, target_name=target)
    b = registry.register_draft(draft_dir, target_name=target)
    registry.promote(a.name, a.version, ServingConfig(mode="draft", draft_dir="/a"), expected_champion=None)

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(registry, "write_serving_config", broken)
    with pytest.raises(OSError):
        registry.promote(b.name, b.version, ServingConfig(mode="draft", draft_dir="/b"), expected_champion=a.version)
    assert str(registry.version_by_alias(a.name, registry.CHAMPION).version) == a.version
    assert read_serving_config().draft_dir == "/a"


def test_two_concurrent_promotions_only_one_wins(draft_dir):
    target = "race"
    a = registry.register_draft(draft_dir, target_name=target)
    b = registry.register_draft(draft_dir, target_name=target)
    outcomes = []

    def attempt(version):
        try:
            registry.promote(a.name, version, ServingConfig(mode="draft", draft_dir=f"/{version}"), expected_champion=None)
            outcomes.append(("won", version))
        except registry.PromotionConflict:
            outcomes.append(("lost", version))

    threads = [threading.Thread(target=attempt, args=(v,)) for v in (a.version, b.version)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(o for o, _ in outcomes) == ["lost", "won"]
    winner = next(v for o, v in outcomes if o == "won")
    assert str(registry.version_by_alias(a.name, registry.CHAMPION).version) == winner
    assert read_serving_config().draft_dir == f"/{winner}"


def test_bad_model_uri_is_refused():
    with pytest.raises(ValueError, match="not a registered model URI"):
        registry.download_draft("models:/")


@pytest.mark.e2e  # two fresh MLflow databases: ~10 s of table creation
def test_two_state_directories_never_share_a_registry(draft_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("SPECDISTILL_HOME", str(tmp_path / "a"))
    registry.register_draft(draft_dir, target_name="isolated")
    monkeypatch.setenv("SPECDISTILL_HOME", str(tmp_path / "b"))
    assert registry.client().search_registered_models() == []
    assert "MLFLOW_TRACKING_URI" not in __import__("os").environ


def test_a_promotion_replaces_an_unreadable_serving_file_and_keeps_a_copy(draft_dir, monkeypatch):
    """A bad serving.json used to block promotion (the read before the move raised)."""
    from specdistill import paths
    from specdistill.ops.serving import serving_path

    reg = registry.register_draft(draft_dir, target_name="bad-serving-file", params={}, metrics={}, curves={}, tags={})
    bad = serving_path()
    bad.parent.mkdir(parents=True, exist_ok=True)
    bad.write_text('{"mode": "draft", "num_speculative_tokens": true')
    registry.promote(reg.name, reg.version, ServingConfig(mode="draft", draft_dir=str(draft_dir)), expected_champion=None)
    assert read_serving_config().draft_dir == str(draft_dir)
    assert bad.with_name("serving.json.invalid").read_text() == '{"mode": "draft", "num_speculative_tokens": true'
    assert bad.stat().st_mode & 0o777 == 0o644
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert registry.tracking_uri() == f"sqlite:///{paths.home() / 'mlflow.db'}"
    assert (paths.home() / "mlflow.db").stat().st_mode & 0o777 == 0o600  # created before MLflow opens it


def _artifact_copy(reg) -> Path:
    """The registered version's checkpoint inside the artifact store (what `draft init --force` overwrote)."""
    from specdistill import paths

    (weights,) = (paths.home() / "mlartifacts").rglob("model.safetensors")
    return Path(weights.parent)


def test_a_registered_draft_changed_in_the_artifact_store_is_refused_naming_the_version(draft_dir):
    """A draft overwritten inside the artifact store loaded as if it were the version the gate approved."""
    from specdistill.modeling.models import resolve_model_dir

    reg = registry.register_draft(draft_dir, target_name="immutable")
    recorded = registry.client().get_model_version(reg.name, reg.version).tags[registry.FILES_TAG]
    assert set(json.loads(recorded)) >= {"config.json", "model.safetensors"}
    stored = _artifact_copy(reg)
    tok = train_bpe(300)
    make_tiny_llama(vocab_size=len(tok), layers=6, seed=9).save_pretrained(stored)  # a bigger draft, same names
    with pytest.raises(registry.RegisteredDraftChanged,
                       match=rf"models:/{reg.name}/1 \({reg.name} version 1\): \S+/my-draft-v7/config.json differs from the SHA-256"):
        load_model(f"models:/{reg.name}@challenger")
    with pytest.raises(registry.RegisteredDraftChanged, match="version 1"):  # the resolver every command uses
        resolve_model_dir(f"models:/{reg.name}/1")


def test_a_changed_or_added_file_in_the_local_copy_is_refused(draft_dir):
    reg = registry.register_draft(draft_dir, target_name="local-copy")
    local = registry.download_draft(reg.model_uri)
    load_model(reg.model_uri)  # a load writes its fingerprint record beside the weights: not a change
    assert registry.download_draft(reg.model_uri) == local
    (local / "extra.safetensors").write_bytes(b"x")
    with pytest.raises(registry.RegisteredDraftChanged, match=r"extra.safetensors was added after registration"):
        registry.download_draft(reg.model_uri)
    (local / "extra.safetensors").unlink()
    config = local / "config.json"
    stat = config.stat()
    config.write_text(config.read_text().replace('"num_hidden_layers": 4', '"num_hidden_layers": 2'))
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # mtime put back
    with pytest.raises(registry.RegisteredDraftChanged, match=r"config.json differs from the SHA-256 recorded"):
        registry.download_draft(f"models:/{reg.name}@challenger")


def test_a_version_without_its_file_hashes_is_refused_like_a_changed_one(draft_dir):
    """A draft whose checksum tag was removed loaded "unverified" with only a log line."""
    reg = registry.register_draft(draft_dir, target_name="before-hashes")
    registry.client().delete_model_version_tag(reg.name, reg.version, registry.FILES_TAG)
    with pytest.raises(registry.RegisteredDraftChanged,
                       match=rf"models:/{reg.name}/1 \({reg.name} version 1\): no {registry.FILES_TAG} tag.*register the draft again"):
        registry.download_draft(reg.model_uri)
    with pytest.raises(registry.RegisteredDraftChanged, match="cannot be verified"):  # a second try is refused too
        load_model(f"models:/{reg.name}/1")
    registry.client().set_model_version_tag(reg.name, reg.version, registry.FILES_TAG, "")
    with pytest.raises(registry.RegisteredDraftChanged, match="cannot be verified"):
        registry.download_draft(reg.model_uri)


def test_with_no_champion_of_its_kind_training_restarts_from_the_newest_draft_of_this_target_version_and_kind(draft_dir):
    from specdistill.pipeline.nightly_recipe import load_nightly_config
    from specdistill.pipeline.stages import champion as stage

    layers = load_nightly_config(None, ["target_name=restart", "train.kind=draft_model"])
    heads = load_nightly_config(None, ["target_name=restart", "train.kind=eagle3"])
    assert stage.training_start(layers, "fp-a", None) is None  # nothing registered yet
    first = registry.register_draft(draft_dir, target_name="restart", tags={"target_fingerprint": "fp-a", "gate_verdict": "fail"})
    newest = registry.register_draft(draft_dir, target_name="restart", tags={"target_fingerprint": "fp-a", "gate_verdict": "fail"})
    registry.register_draft(draft_dir, target_name="restart", tags={"target_fingerprint": "fp-b"})  # another target version
    previous = stage.training_start(layers, "fp-a", None)
    assert first.version == "1" and previous.version == newest.version == "2"
    assert (Path(previous.dir) / "config.json").is_file() and previous.tags["gate_verdict"] == "fail"
    assert stage.training_start(layers, "fp-c", None) is None  # a new target version starts from its weights
    assert stage.training_start(heads, "fp-a", None) is None  # no head registered
    line = stage.started_from(WarmStart(previous.name, previous.version, previous.dir, previous.tags), None)
    assert "version 2" in line and "gate fail" in line and "no champion" in line
    assert "target's weights" in stage.started_from(None, None)

    # a champion of the kind being trained is where training starts; one of the other kind is not
    champion = stage._registered(previous.name, registry.newest_version(previous.name, target_fingerprint="fp-b"))
    assert stage.draft_kind(champion) == "draft_model"
    assert stage.training_start(layers, "fp-a", champion) == champion
    assert "from the champion, version 3" in stage.started_from(WarmStart(**vars(champion)), champion)
    assert stage.training_start(heads, "fp-a", champion) is None  # a head does not start from a layer draft
    line = stage.started_from(None, champion)
    assert "target's weights" in line and "the champion, version 3, is of kind draft_model" in line
    line = stage.started_from(WarmStart(previous.name, previous.version, previous.dir, previous.tags), champion)
    assert "version 2, the newest draft of this kind" in line and "is of kind draft_model" in line


def test_a_newer_draft_benched_no_worse_than_the_champion_is_where_the_next_night_starts(draft_dir):
    """A night that trained depth and read under the red line on harder prompts, yet no worse than the champion
    on the same ones, is not thrown away: the next night goes on from it. Only a draft benched beside this
    champion (its parent), of this target version and kind, and newer than it."""
    from specdistill.pipeline.nightly_recipe import load_nightly_config
    from specdistill.pipeline.outputs import NO_WORSE_TAG
    from specdistill.pipeline.stages import champion as stage

    layers = load_nightly_config(None, ["target_name=compound", "train.kind=draft_model"])
    # versions registered before the layer draft took its one name carry `draft_kind: layers`: read as draft_model
    tags = {"target_fingerprint": "fp-a", "draft_kind": "layers"}
    v1 = registry.register_draft(draft_dir, target_name="compound", tags={**tags, "gate_verdict": "pass"})
    champion = stage._registered(v1.name, registry.newest_version(v1.name))
    assert stage.draft_kind(champion) == "draft_model" and registry.newest_version(v1.name, draft_kind="draft_model") is not None
    worse = {**tags, "gate_verdict": "fail", "parent": "1", NO_WORSE_TAG: "false"}
    registry.register_draft(draft_dir, target_name="compound", tags=worse)
    assert stage.training_start(layers, "fp-a", champion).version == "1"  # measured worse: the champion
    registry.register_draft(draft_dir, target_name="compound", tags={**worse, NO_WORSE_TAG: "true"})
    registry.register_draft(draft_dir, target_name="compound", tags={**worse, NO_WORSE_TAG: "true", "parent": "2"})
    registry.register_draft(draft_dir, target_name="compound", tags={**worse, NO_WORSE_TAG: "true",
                                                                     "target_fingerprint": "fp-b"})
    start = stage.training_start(layers, "fp-a", champion)
    assert start.version == "3" and start.tags["gate_verdict"] == "fail"  # not 4 (another parent), not 5 (fp-b)
    line = stage.started_from(WarmStart(**vars(start)), champion)
    assert "version 3, newer than the champion (version 1) and no worse than it" in line and "gate fail" in line


@pytest.mark.parametrize("challenger, champion, tau_held, expected", [
    (0.489, 0.445, True, "true"), (0.489, 0.445, False, "false"), (0.40, 0.445, True, "false"), (0.5, None, True, "")])
def test_no_worse_than_the_champion_reads_the_same_prompts_not_the_red_line(challenger, champion, tau_held, expected):
    from specdistill.ops.policy import Check, GateVerdict, Role
    from specdistill.pipeline.stages.register import no_worse_than_champion

    def result(first):
        return types.SimpleNamespace(per_position_acceptance=[first], first_position_acceptance=first)

    results = {Role.CHALLENGER: result(challenger), **({Role.CHAMPION: result(champion)} if champion else {})}
    verdict = GateVerdict(False, [Check("first-position acceptance", False, challenger, 0.5, ""),
                                  Check("accepted length vs champion", tau_held, 1.69, 1.64, "")])
    assert no_worse_than_champion(results, verdict) == expected
