"""The trainer on a tiny random target that uses the demo tokenizer (chat template included)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from specdistill.budget import Deadline
from specdistill.data.prompts import Prompt
from specdistill.distill import losses
from specdistill.distill.distill_recipe import load_config
from specdistill.distill.examples import read_examples
from specdistill.distill.features import build_cache
from specdistill.distill.teacher import TeacherCache
from specdistill.distill.train import NonFiniteLossError, distill, out_of_time
from specdistill.modeling.vocab import DRAFT_VOCAB_FILE
from specdistill.pipeline.stages.answers.harness import generate_answers
from specdistill.recipe import ConfigError
from tests.conftest import run_distill_ddp, save_tiny_target

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["Name a color.", "What is 2+2?", "Say hi.", "Give me a fruit.", "Count to three.", "Pick a number."]


@pytest.fixture(scope="module")
def tiny_world(tmp_path_factory, demo_tokenizer):
    """A tiny target directory with the demo tokenizer, and its greedy answers to a few prompts.

    The tests that train on it are in the slow (e2e) tier: the demo tokenizer comes from the converted
    demo target, and each training run takes seconds."""
    from specdistill.modeling.models import load_model

    root = tmp_path_factory.mktemp("tiny_world")
    tok = demo_tokenizer
    target_dir = save_tiny_target(root / "target", seed=1, tie=False, tokenizer=tok)
    target = load_model(target_dir, dtype="float32")  # the fp32 answers the trainer reads
    prompts = [Prompt(id=f"p{i}", messages=[{"role": "user", "content": t}]) for i, t in enumerate(PROMPTS)]
    cache = TeacherCache.create(root / "gen_cache", fingerprint=target.fingerprint, k=16, temperature=1.0,
                                vocab="full", data="generated")
    generate_answers(target.model, tok, prompts, root / "answers.jsonl", batch_size=4, max_new_tokens=10,
                     teacher_cache=cache, progress=False)
    return {"root": root, "target": str(target_dir), "answers": str(root / "answers.jsonl"),
            "fingerprint": target.fingerprint, "gen_cache": str(root / "gen_cache")}


def _config(world, out, *extra):
    return load_config(None, [
        f"target={world['target']}", "layers=0,3", "draft_vocab=null", f"data.path={world['answers']}",
        f"data.heldout_path={world['answers']}", f"out_dir={out}", "optim.max_steps=6", "optim.batch_size=2",
        "optim.warmup_steps=2", "optim.lr=3e-3", "eval_every=3", "checkpoint_every=3", "progress=false", "freeze=[]",
        "threads=1",
        *extra,
    ])


def _log(out):
    return [json.loads(line) for line in (Path(out) / "train_log.jsonl").read_text().splitlines()]


def test_unknown_or_mistyped_key_fails_naming_it(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("data: {path: x.jsonl}\noptim: {lr: 1e-3, learning_rate: 2}\n")
    with pytest.raises(ConfigError, match="unknown key 'optim.learning_rate'"):
        load_config(cfg)
    with pytest.raises(ConfigError, match="optim.max_steps"):
        load_config(None, ["data.path=x", "optim.max_steps=many"])
    with pytest.raises(ConfigError, match="needs a teacher"):
        load_config(None, ["data.path=x", "teacher.mode=none", "loss.kind=fkl"])


@pytest.mark.e2e
def test_distill_trains_saves_config_and_improves_heldout_agreement(tiny_world, tmp_path):
    out = tmp_path / "run"
    result = distill(_config(tiny_world, out, "optim.max_steps=60", "eval_every=20", "checkpoint_every=20",
                             "optim.lr=1e-2", "optim.warmup_steps=5"))
    curve = result.curve
    assert curve[0]["step"] == 0 and curve[-1]["step"] == 60
    # evaluated on the answers it trains on: it must fit them well past where it started
    assert curve[-1]["acceptance"] > max(0.6, curve[0]["acceptance"] + 0.2)
    assert 1.0 <= curve[-1]["tau"] <= 5.0
    log = _log(out)
    assert log[-1]["loss"] < log[0]["loss"]
    ckpt = sorted((out / "checkpoints").iterdir())[-1]
    assert (ckpt / "config.yaml").is_file() and (ckpt / "model.safetensors").is_file()
    assert load_config(ckpt / "config.yaml").optim.max_steps == 60
    assert (Path(result.draft_dir) / "config.json").is_file()


@pytest.mark.e2e
def test_a_deadline_bounds_the_whole_run_and_keeps_the_last_evaluation(tiny_world, tmp_path):
    result = distill(_config(tiny_world, tmp_path / "late", "optim.max_steps=60"), deadline=Deadline.after(0))
    assert (result.steps, result.stop) == (0, "deadline")  # loading alone spent it: not one step more
    assert [p["step"] for p in result.curve] == [0] and (Path(result.draft_dir) / "config.json").is_file()
    result = distill(_config(tiny_world, tmp_path / "run", "optim.max_steps=100000", "eval_every=100000"),
                     deadline=Deadline.after(0.1))
    assert result.stop == "deadline" and result.steps > 0 and result.curve[-1]["step"] == result.steps


def test_out_of_time_keeps_what_the_last_evaluation_needs():
    run = SimpleNamespace(world=1, device=torch.device("cpu"))
    assert not out_of_time(run, Deadline(), 1e9)  # no deadline
    soon = Deadline.after(10 / 60)
    assert not out_of_time(run, soon, 5.0) and out_of_time(run, soon, 15.0)


@pytest.mark.e2e
def test_resume_after_interruption_reproduces_the_loss_curve(tiny_world, tmp_path):
    full = tmp_path / "full"
    distill(_config(tiny_world, full))
    cut = tmp_path / "cut"
    # Stop after step 4 (a kill after a step): the last checkpoint is step 3, so the resume redoes step 4.
    first = distill(_config(tiny_world, cut, "optim.max_tokens=1"))
    assert first.steps == 1
    distill(_config(tiny_world, cut, "optim.max_tokens=" + str(_log(full)[3]["tokens"])))
    distill(_config(tiny_world, cut))
    want = {r["step"]: r["loss"] for r in _log(full)}
    got = {r["step"]: r["loss"] for r in _log(cut)}  # later lines (the resumed run) win
    assert sorted(got) == sorted(want)
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-7), step


@pytest.mark.e2e
def test_nan_loss_stops_with_step_and_keeps_last_checkpoint(tiny_world, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = losses.distill_loss

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        value = real(*args, **kwargs)
        return value * float("nan") if calls["n"] == 5 else value

    monkeypatch.setattr(losses, "distill_loss", poisoned)
    out = tmp_path / "nan"
    with pytest.raises(NonFiniteLossError, match=r"at step 4 .*examples \["):
        distill(_config(tiny_world, out, "checkpoint_every=2"))
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step-0000002", "step-0000004"] or ckpts[-1] == "step-0000004"
    assert not any(name.endswith(".tmp") for name in ckpts)


@pytest.mark.e2e
def test_cached_teacher_gives_the_online_loss(tiny_world, tmp_path):
    """Top-k cache with k = the whole vocabulary must reproduce the online teacher exactly."""
    from specdistill.modeling.models import load_model

    target = load_model(tiny_world["target"], dtype="float32")  # as the trainer loads it
    examples = read_examples(tiny_world["answers"], "generated", target.tokenizer, 512)
    cache_dir = tmp_path / "cache"
    build_cache(target.model, examples, cache_dir, fingerprint=target.fingerprint, k=target.config.vocab_size,
                batch_size=4, progress=False)
    online = distill(_config(tiny_world, tmp_path / "online", "optim.max_steps=1"))
    cached = distill(_config(tiny_world, tmp_path / "cached", "optim.max_steps=1", "teacher.mode=cache",
                             f"teacher.cache_dir={cache_dir}"))
    assert _log(tmp_path / "cached")[0]["loss"] == pytest.approx(_log(tmp_path / "online")[0]["loss"], rel=1e-4)
    assert online.steps == cached.steps == 1


@pytest.mark.e2e
def test_generation_time_cache_and_reduced_vocab_train(tiny_world, tmp_path):
    result = distill(_config(tiny_world, tmp_path / "r", "draft_vocab=64", "teacher.mode=cache",
                             f"teacher.cache_dir={tiny_world['gen_cache']}", "optim.max_steps=3"))
    assert result.draft_vocab == 64 and result.steps == 3
    assert (Path(result.draft_dir) / DRAFT_VOCAB_FILE).is_file()
    assert 0.0 <= result.curve[-1]["acceptance"] <= 1.0


@pytest.mark.e2e
def test_teacher_cache_from_another_fingerprint_is_refused(tiny_world, tmp_path):
    from specdistill.distill.teacher import StaleTeacherCacheError

    with pytest.raises(StaleTeacherCacheError, match="fingerprint"):
        TeacherCache.open(tiny_world["gen_cache"], fingerprint="0" * 16)
    cfg = _config(tiny_world, tmp_path / "x", "teacher.mode=cache", f"teacher.cache_dir={tiny_world['gen_cache']}")
    meta = Path(tiny_world["gen_cache"]) / "teacher_cache.json"
    saved = meta.read_text()
    try:
        meta.write_text(json.dumps({**json.loads(saved), "fingerprint": "feedfacefeedface"}))
        with pytest.raises(StaleTeacherCacheError, match="feedfacefeedface"):
            distill(cfg)
    finally:
        meta.write_text(saved)


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["draft_model", "eagle3"])
def test_a_stale_teacher_entry_is_dropped_and_counted_not_fatal(tiny_world, tmp_path, kind):
    """The answers file holds another answer to p1 than the one its cached teacher rows were written for
    (greedy answers that differ between nights): the run trains on the others and counts it."""
    records = [json.loads(line) for line in Path(tiny_world["answers"]).read_text().splitlines()]
    for rec in records:
        if rec["id"] == "p1":
            rec["response_ids"] = [rec["response_ids"][0] + 1, *rec["response_ids"][1:]]
    answers = tmp_path / "answers.jsonl"
    answers.write_text("".join(json.dumps(r) + "\n" for r in records))
    extra = ["layers=0,3"] if kind == "draft_model" else ["kind=eagle3", "eagle3.steps=1",
                                                     f"eagle3.feature_dir={tmp_path / 'features'}"]
    result = distill(_config(tiny_world, tmp_path / "r", *extra, f"data.path={answers}", "teacher.mode=cache",
                             f"teacher.cache_dir={tiny_world['gen_cache']}", "optim.max_steps=2"))
    assert result.stale_dropped == 1 and result.steps == 2


@pytest.mark.e2e
def test_warm_start_with_replay(tiny_world, tmp_path):
    first = distill(_config(tiny_world, tmp_path / "a", "optim.max_steps=2"))
    second = distill(_config(tiny_world, tmp_path / "b", f"draft={first.draft_dir}", "optim.max_steps=2",
                             f"data.replay_path={tiny_world['answers']}", "data.replay_share=0.5"))
    assert second.curve[0]["acceptance"] == pytest.approx(first.curve[-1]["acceptance"])


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_ddp_two_ranks_end_with_identical_weights(tiny_world, tmp_path):
    out = tmp_path / "ddp"
    cfg = tmp_path / "ddp.yaml"
    cfg.write_text(
        f"target: {tiny_world['target']}\nlayers: '0,3'\ndraft_vocab: null\nfreeze: []\n"
        f"data: {{path: {tiny_world['answers']}}}\nout_dir: {out}\nprogress: false\nthreads: 1\n"
        "optim: {max_steps: 3, batch_size: 1, warmup_steps: 1}\n"
    )
    result = run_distill_ddp(cfg, out)
    digests = result["rank_weight_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]
    assert result["steps"] == 3
    # and the weights moved (the check is not vacuous)
    from specdistill.modeling.models import load_model

    trained = load_file(str(Path(result["draft_dir"]) / "model.safetensors"))
    base = load_model(tiny_world["target"], dtype="float32").model.state_dict()
    assert not torch.equal(trained["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])


@pytest.mark.e2e
def test_online_topk_hidden_and_selective_paths_train(tiny_world, tmp_path):
    ref = distill(_config(tiny_world, tmp_path / "ref", "optim.max_steps=2"))
    for extra in (["loss.top_k=8", "loss.hidden_weight=0.5", "loss.kind=jsd"],
                  ["loss.selective_keep=0.5", f"loss.selective_reference={ref.draft_dir}"],
                  ["loss.kind=mix", "loss.alpha=0.3", "loss.temperature=2.0"],
                  ["loss.kind=ce", "teacher.mode=none", "optim.bf16=true"],
                  ["teacher.mode=cache", f"teacher.cache_dir={tiny_world['gen_cache']}", "loss.top_k=4", "draft_vocab=64"]):
        result = distill(_config(tiny_world, tmp_path / "_".join(e.split("=")[0] for e in extra), "optim.max_steps=2", *extra))
        log = _log(tmp_path / "_".join(e.split("=")[0] for e in extra))
        assert result.steps == 2 and all(r["loss"] > 0 for r in log), extra


def test_cli_distill_rejects_unknown_key_before_any_work(tmp_path, capsys):
    from specdistill.cli import main

    cfg = tmp_path / "bad.yaml"
    cfg.write_text("data: {path: nowhere.jsonl}\nloss: {kind: fkl, temprature: 2.0}\n")
    assert main(["distill", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'loss.temprature'" in err and str(cfg) in err
    assert main(["distill", "--config", str(cfg), "loss.temprature=null", "optim.lr=fast"]) == 2
    assert "optim.lr" in capsys.readouterr().err


def test_device_choice_and_a_missing_gpu_fail_clearly(monkeypatch):
    from specdistill.distill.train import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto") == torch.device("cpu") and pick_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device 'cuda' but torch sees no CUDA device"):
        pick_device("cuda")
    with pytest.raises(ConfigError, match="device"):
        load_config(None, ["data.path=x.jsonl", "device=tpu"])
    with pytest.raises(ConfigError, match="device.*'cuda:0' but torch sees no CUDA device"):
        load_config(None, ["data.path=x.jsonl", "device=cuda:0"])  # at config load, naming the key


def test_batches_and_teacher_rows_move_together():
    """What the training step moves to the rank's device keeps its shapes and values."""
    from specdistill.distill.examples import Example, collate

    batch = collate([Example("a", [1, 2, 3, 4], [False, False, True, True]), Example("b", [5, 6], [False, True])])
    moved = batch.to(torch.device("cpu"))
    assert moved.ids == ["a", "b"] and torch.equal(moved.labels, batch.labels) and moved.rows_per_example == [2, 1]
    top = losses.TopKTeacher(torch.log(torch.tensor([[0.5, 0.25]])), torch.tensor([[3, 1]]), torch.tensor([0.25]),
                             torch.tensor([[True, False]]))
    out = top.to(torch.device("cpu"))
    assert torch.equal(out.indices, top.indices) and torch.equal(out.valid, top.valid)


def test_batch_loss_is_the_same_with_the_online_teacher_and_a_full_cache(tmp_path):
    """The public one-batch loss (what benchmarks/experiments/teacher_cache_speed.py times), on a tiny random target."""
    from specdistill.distill.examples import Example, collate
    from specdistill.distill.layer_task import DraftWithHead, batch_loss
    from specdistill.distill.teacher import OnlineTeacher
    from specdistill.modeling.drafts import init_draft_from_target
    from tests.conftest import make_tiny_llama

    target = make_tiny_llama(vocab_size=96, layers=4, seed=2, tie=False)
    g = torch.Generator().manual_seed(0)
    examples = [Example(f"e{i}", torch.randint(3, 96, (8 + i,), generator=g).tolist(), [False] * 4 + [True] * (4 + i))
                for i in range(3)]
    rows = build_cache(target, examples, tmp_path / "cache", fingerprint="t" * 16, k=96, batch_size=2, progress=False).load_all()
    module = DraftWithHead(init_draft_from_target(target, [0, 3]), None, target.config.hidden_size)
    batch = collate(examples)
    cfg = load_config(None, ["data.path=unused", "loss.kind=jsd"])
    logits, hidden = module(batch.input_ids, batch.attention, batch.positions)
    online = batch_loss(cfg, logits, hidden, batch, teacher=OnlineTeacher(target), module=module)
    cached = batch_loss(cfg, logits, hidden, batch, cache_rows=rows, module=module)
    assert torch.isfinite(online) and online > 0
    assert cached.item() == pytest.approx(online.item(), rel=1e-5)
    online.backward()
    assert any(p.grad is not None for p in module.parameters())


def test_distill_refuses_an_out_dir_it_did_not_write_before_the_target_loads(tmp_path, capsys, monkeypatch):
    """A user's directory, the state root, the registry's store and a file: one line each, nothing written."""
    from specdistill import paths
    from specdistill.cli import main

    monkeypatch.setattr("specdistill.modeling.models.load_model", lambda *a, **k: pytest.fail("refused before loading"))
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "config.yaml").write_text("mine: true\n")
    (victim / "result.json").write_text('{"mine": true}')
    (tmp_path / "file.txt").write_text("x")
    paths.home().mkdir(parents=True)
    store = paths.registry_artifacts_dir() / "demo" / "1"
    store.mkdir(parents=True)
    cases = ((victim, "files this command did not write"), (paths.home(), "state directory"),
             (store / "run", "model registry's artifact store"), (tmp_path / "file.txt", "not a directory"),
             (tmp_path / "file.txt" / "sub", "not a directory"))
    for out, why in cases:
        assert main(["distill", "data.path=answers.jsonl", f"out_dir={out}"]) == 2
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1, err
    assert (victim / "config.yaml").read_text() == "mine: true\n" and (victim / "result.json").read_text() == '{"mine": true}'
    assert sorted(p.name for p in victim.iterdir()) == ["config.yaml", "result.json"]
    assert sorted(p.name for p in paths.home().iterdir()) == ["mlartifacts", "state.lock"] and not any(store.iterdir())


def test_distill_claims_its_out_dir_and_only_a_directory_our_marker_was_in_resumes(tmp_path):
    from specdistill import paths
    from specdistill.distill.train import DISTILL_OUTPUT, claim_out_dir

    out = tmp_path / "run"
    assert claim_out_dir(out) is False and paths.output_kind(out) == DISTILL_OUTPUT
    assert claim_out_dir(out) is True  # its own: a rerun resumes from the checkpoints
    for name, files in (("imitation", {"checkpoints/step-0000003/state.json": "{}", "train_log.jsonl": ""}),
                        ("names", {"checkpoints/x": "", "result.json": "{}"})):
        unmarked = tmp_path / name  # names and checkpoints a run writes, but no marker: not ours
        for rel, text in files.items():
            (unmarked / rel).parent.mkdir(parents=True, exist_ok=True)
            (unmarked / rel).write_text(text)
        with pytest.raises(paths.UnsafeOutputError, match="files this command did not write"):
            claim_out_dir(unmarked)
        assert paths.output_marker(unmarked) is None


def test_distill_into_a_users_directory_loses_nothing_and_a_failed_run_claims_nothing(tmp_path, capsys):
    """A user's config.yaml and result.json beside a checkpoint-like folder: refused, nothing claimed; refused
    again once the folder is gone. A run that fails before writing anything leaves no marker behind."""
    from specdistill import paths
    from specdistill.cli import main

    victim = tmp_path / "victim"
    (victim / "checkpoints" / "step-0000001").mkdir(parents=True)
    (victim / "checkpoints" / "step-0000001" / "state.json").write_text('{"step": 1}')
    (victim / "config.yaml").write_text("mine: true\n")
    (victim / "result.json").write_text('{"mine": true}')
    target = save_tiny_target(tmp_path / "target")
    capsys.readouterr()
    args = ["distill", f"target={target}", "data.path=missing.jsonl", f"out_dir={victim}", "progress=false"]
    assert main(args) == 2
    assert "files this command did not write" in capsys.readouterr().err
    assert paths.output_marker(victim) is None
    import shutil

    shutil.rmtree(victim / "checkpoints")
    assert main(args) == 2
    assert "files this command did not write" in capsys.readouterr().err
    assert sorted(p.name for p in victim.iterdir()) == ["config.yaml", "result.json"]
    assert (victim / "config.yaml").read_text() == "mine: true\n" and (victim / "result.json").read_text() == '{"mine": true}'
    for out in (tmp_path / "new", tmp_path / "empty"):  # a run that fails (no data) claims neither
        if out.name == "empty":
            out.mkdir()
        assert main([*args[:3], f"out_dir={out}", "progress=false"]) == 2
        assert "missing.jsonl" in capsys.readouterr().err
        assert not out.exists() if out.name == "new" else not any(out.iterdir())
