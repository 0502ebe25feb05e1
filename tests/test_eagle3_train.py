"""Training EAGLE-3 heads: the feature cache, the unrolled loss, and `distill` with kind eagle3 on a tiny target."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from specdistill.distill import losses
from specdistill.distill.distill_recipe import load_config
from specdistill.distill.eagle3_train import Eagle3Batch, eagle3_loss
from specdistill.distill.examples import Example
from specdistill.distill.features import (
    FeatureCache,
    FeatureCacheTooLargeError,
    StaleFeatureCacheError,
    build_feature_cache,
    bytes_per_token,
    feature_start,
)
from specdistill.distill.train import distill
from tests.conftest import lively, make_tiny_llama, run_distill_ddp, train_bpe


def _examples(n: int = 4, prompt: int = 5, answer: int = 7, vocab: int = 64, seed: int = 0) -> list[Example]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, vocab, (prompt + answer + i,), generator=g).tolist()
        out.append(Example(f"e{i}", ids, [False] * prompt + [True] * (answer + i)))
    return out


@pytest.fixture
def target(one_thread):
    return lively(make_tiny_llama(vocab_size=64, hidden=32, layers=6, seed=2), seed=2).float()


def test_feature_cache_round_trip(target, tmp_path):
    examples = _examples()
    cache = build_feature_cache(target, examples, tmp_path / "f", fingerprint="fp", layers=[1, 3, 4],
                                prompt_context=2, batch_size=3, progress=False)
    rows = FeatureCache.open(tmp_path / "f", fingerprint="fp", layers=[1, 3, 4]).load_all()
    assert cache.meta["dtype"] == "bfloat16" and len(cache.ids()) == len(examples)
    for ex in examples:
        entry = rows[ex.id]
        start = feature_start(ex.assistant_mask, 2)
        assert start == 5 - 1 - 2 and int(entry["start"]) == start
        with torch.no_grad():
            hs = target(input_ids=torch.tensor([ex.input_ids]), output_hidden_states=True).hidden_states
        want = torch.cat([hs[1], hs[3], hs[4]], dim=-1)[0, start : len(ex.input_ids) - 1]
        assert entry["features"].dtype == torch.bfloat16
        torch.testing.assert_close(entry["features"].float(), want, atol=0.05, rtol=0.02)
        assert entry["input_ids"].tolist() == ex.input_ids
    assert cache.disk_bytes() >= sum(len(ex.input_ids) - 1 - 2 for ex in examples) * bytes_per_token(32)
    # whole prompt: every position but the last
    full = build_feature_cache(target, examples, tmp_path / "g", fingerprint="fp", layers=[1, 3, 4], progress=False)
    assert full.load_all()["e0"]["features"].shape == (len(examples[0].input_ids) - 1, 96)


def test_feature_cache_mismatches_fail_naming_them(target, tmp_path):
    examples = _examples()
    build_feature_cache(target, examples, tmp_path / "f", fingerprint="fp", layers=[1, 3, 4], progress=False)
    with pytest.raises(StaleFeatureCacheError, match=r"layers=\[1, 3, 4\].*layers=\[2, 3, 4\]"):
        FeatureCache.open(tmp_path / "f", fingerprint="fp", layers=[2, 3, 4])
    with pytest.raises(StaleFeatureCacheError, match="fingerprint='fp'.*'other'"):
        FeatureCache.open(tmp_path / "f", fingerprint="other", layers=[1, 3, 4])
    with pytest.raises(StaleFeatureCacheError, match="data="):  # resuming a build over other data
        build_feature_cache(target, _examples(seed=5), tmp_path / "f", fingerprint="fp", layers=[1, 3, 4], progress=False)


def test_feature_cache_over_budget_fails_before_any_work(target, tmp_path):
    examples = _examples()
    positions = sum(len(ex.input_ids) - 1 for ex in examples)
    with pytest.raises(FeatureCacheTooLargeError, match=rf"{positions} positions x 192 bytes.*budget of 0\.000 GB"):
        build_feature_cache(target, examples, tmp_path / "f", fingerprint="fp", layers=[1, 3, 4], max_bytes=1000,
                            progress=False)
    assert not (tmp_path / "f").exists()


def _batch(rows: list[torch.Tensor], keep: torch.Tensor, logprobs: torch.Tensor) -> Eagle3Batch:
    n, k = logprobs.shape
    idx = torch.arange(k).expand(n, k)
    teacher = losses.TopKTeacher(logprobs, idx, torch.zeros(n), torch.ones(n, k, dtype=torch.bool))
    b, t = rows[0].shape
    return Eagle3Batch(["x"] * b, torch.zeros(b, t, dtype=torch.long), torch.zeros(b, t, 6), torch.ones(b, t, dtype=torch.bool),
                       rows, [torch.zeros(b, t, dtype=torch.long)] * len(rows), teacher, keep)


def test_eagle3_loss_masks_out_of_vocab_argmax_and_decays_by_step():
    torch.manual_seed(0)
    k = 5
    teacher_lp = torch.log_softmax(torch.randn(4, k), -1)
    rows = [torch.tensor([[0, 1, 2]]), torch.tensor([[1, 3, -1]])]  # step 1 has no row at the last entry
    keep = torch.tensor([True, True, False, True])  # row 2: the target's argmax is not a draft token
    logits = [torch.randn(1, 3, k), torch.randn(1, 3, k)]
    batch = _batch(rows, keep, teacher_lp)

    def kl(lg, r):
        return float(torch.sum(teacher_lp[r].exp() * (teacher_lp[r] - torch.log_softmax(lg, -1))))

    step0 = (kl(logits[0][0, 0], 0) + kl(logits[0][0, 1], 1)) / 2  # row 2 masked
    step1 = (kl(logits[1][0, 0], 1) + kl(logits[1][0, 1], 3)) / 2
    got = eagle3_loss(logits, batch, decay=0.8)
    assert float(got) == pytest.approx((step0 + 0.8 * step1) / 1.8, rel=1e-5)
    # the masked entry does not move the loss
    moved = [logits[0].clone(), logits[1]]
    moved[0][0, 2] += 10
    assert float(eagle3_loss(moved, batch, decay=0.8)) == pytest.approx(float(got), rel=1e-6)
    # decay 1: plain mean over steps; every row masked: zero with a gradient path
    assert float(eagle3_loss(logits, batch, decay=1.0)) == pytest.approx((step0 + step1) / 2, rel=1e-5)
    none = _batch(rows, torch.zeros(4, dtype=torch.bool), teacher_lp)
    lg = torch.randn(1, 3, k, requires_grad=True)
    zero = eagle3_loss([lg, lg], none)
    assert float(zero.detach()) == 0.0 and zero.requires_grad


# --------------------------------------------------------------------------------------------
# distill with kind eagle3 on a tiny random Llama target


@pytest.fixture(scope="module")
def eagle_world(tmp_path_factory):
    """A tiny 6-layer target (BPE tokenizer) and its greedy answers to random prompts, as generated records."""
    root = tmp_path_factory.mktemp("eagle_world")
    tok = train_bpe(300)
    torch.set_num_threads(1)
    model = lively(make_tiny_llama(vocab_size=len(tok), hidden=32, layers=6, seed=4, tie=False), seed=4, std=0.3).float()
    model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    g = torch.Generator().manual_seed(0)
    records = []
    for i in range(16):
        prompt = torch.randint(3, len(tok), (6,), generator=g)
        with torch.no_grad():
            out = model.generate(prompt[None], attention_mask=torch.ones(1, 6, dtype=torch.long), max_new_tokens=14,
                                 do_sample=False, pad_token_id=2, eos_token_id=None)
        records.append({"id": f"r{i}", "prompt_ids": prompt.tolist(), "response_ids": out[0, 6:].tolist()})
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:12]))
    (root / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[12:]))
    return root


def _eagle_config(world: Path, out: Path, *extra: str):
    return load_config(None, [
        f"target={world / 'target'}", "kind=eagle3", "draft_vocab=200", f"data.path={world / 'train.jsonl'}",
        f"data.heldout_path={world / 'train.jsonl'}", f"out_dir={out}", "teacher.mode=cache",
        f"teacher.cache_dir={world / 'teacher'}", f"eagle3.feature_dir={world / 'features'}", "eagle3.steps=3",
        "eagle3.eval_steps=3", "optim.max_steps=8", "optim.batch_size=4", "optim.warmup_steps=2", "optim.lr=1e-2",
        "eval_every=4", "checkpoint_every=2", "progress=false", "threads=1", *extra,
    ])


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def test_eagle3_distill_improves_heldout_agreement_and_saves_the_head(eagle_world, tmp_path):
    from safetensors.torch import load_file

    result = distill(_eagle_config(eagle_world, tmp_path / "run", "optim.max_steps=80", "eval_every=40",
                                   "checkpoint_every=40"))
    curve = result.curve
    assert result.kind == "eagle3" and result.steps == 80 and result.feature_bytes_per_answer_token > 0
    assert len(curve[-1]["acceptance_per_position"]) == 3
    # it fits the answers it trains on well past where it started, at every draft position
    assert curve[-1]["acceptance"] > curve[0]["acceptance"] + 0.2
    assert curve[-1]["acceptance_per_position"][2] > curve[0]["acceptance_per_position"][2]
    assert curve[-1]["accepted_per_position"][1] <= curve[-1]["acceptance_per_position"][1] + 1e-9
    assert 1.0 <= curve[-1]["tau_chain_3"] <= 4.0
    head_dir = Path(result.draft_dir)
    config = json.loads((head_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 200
    tensors = load_file(str(head_dir / "model.safetensors"))
    assert "fc.weight" in tensors and "lm_head.weight" in tensors and not any(k.startswith("embed") for k in tensors)
    # warm start from the saved head begins where the run ended
    again = distill(_eagle_config(eagle_world, tmp_path / "warm", f"draft={head_dir}", "optim.max_steps=1"))
    assert again.curve[0]["acceptance"] == pytest.approx(curve[-1]["acceptance"])


def test_eagle3_resume_after_a_kill_reproduces_the_loss_curve(eagle_world, tmp_path):
    full = tmp_path / "full"
    distill(_eagle_config(eagle_world, full))
    cut = tmp_path / "cut"
    # a kill after step 3: the last checkpoint is step 2, so the resumed run redoes step 3
    distill(_eagle_config(eagle_world, cut, "optim.max_tokens=" + str(_log(full)[2]["tokens"])))
    assert len(_log(cut)) == 3
    distill(_eagle_config(eagle_world, cut))
    want = {r["step"]: r["loss"] for r in _log(full)}
    got = {r["step"]: r["loss"] for r in _log(cut)}
    assert sorted(got) == sorted(want)
    for step in want:
        assert math.isclose(got[step], want[step], rel_tol=1e-6, abs_tol=1e-7), step


def test_eagle3_config_needs_caches_and_a_divergence():
    with pytest.raises(Exception, match="teacher.mode=cache"):
        load_config(None, ["data.path=x", "kind=eagle3"])
    with pytest.raises(Exception, match="divergence loss"):
        load_config(None, ["data.path=x", "kind=eagle3", "teacher.mode=cache", "teacher.cache_dir=c", "loss.kind=ce"])
    cfg = load_config(None, ["data.path=x", "kind=eagle3", "teacher.mode=cache", "teacher.cache_dir=c"])
    assert cfg.frozen_patterns == ["embed_tokens"]
    assert load_config(None, ["data.path=x"]).frozen_patterns == ["embed_tokens", "lm_head"]


def test_feature_cache_for_another_layer_set_fails_the_run(eagle_world, tmp_path):
    distill(_eagle_config(eagle_world, tmp_path / "a", "optim.max_steps=1"))
    with pytest.raises(StaleFeatureCacheError, match=r"layers=\[2, 3, 3\].*layers=\[1, 3, 4\]"):
        distill(_eagle_config(eagle_world, tmp_path / "b", "optim.max_steps=1", "eagle3.layers=[1,3,4]"))
    assert not (tmp_path / "b" / "train_log.jsonl").exists()


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_eagle3_ddp_two_ranks_end_with_identical_weights(eagle_world, tmp_path):
    out = tmp_path / "ddp"
    cfg = tmp_path / "ddp.yaml"
    cfg.write_text(
        f"target: {eagle_world / 'target'}\nkind: eagle3\ndraft_vocab: 200\n"
        f"data: {{path: {eagle_world / 'train.jsonl'}}}\nout_dir: {out}\nprogress: false\nthreads: 1\n"
        f"teacher: {{mode: cache, cache_dir: {tmp_path / 'teacher'}}}\n"  # written by rank 0 in the feature pass
        f"eagle3: {{feature_dir: {tmp_path / 'features'}, steps: 2}}\n"
        "optim: {max_steps: 3, batch_size: 2, warmup_steps: 1}\n"
    )
    result = run_distill_ddp(cfg, out)
    assert result["kind"] == "eagle3" and result["steps"] == 3
    digests = result["rank_weight_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]


def test_answer_only_features_evaluated_with_the_whole_prompt(eagle_world, tmp_path):
    whole = distill(_eagle_config(eagle_world, tmp_path / "whole", "optim.max_steps=1", "eagle3.prompt_context=null",
                                  f"eagle3.feature_dir={tmp_path / 'fall'}"))
    answer_only = distill(_eagle_config(eagle_world, tmp_path / "answer", "optim.max_steps=1",
                                        f"eagle3.feature_dir={tmp_path / 'f0'}"))
    # the default stores answer positions only; held-out goes to its own whole-prompt cache, as served
    assert (tmp_path / "f0-heldout").is_dir() and not (tmp_path / "fall-heldout").exists()
    assert answer_only.feature_bytes_per_answer_token < whole.feature_bytes_per_answer_token
    assert answer_only.curve[0] == {**whole.curve[0], "minutes": answer_only.curve[0]["minutes"]}
    named = distill(_eagle_config(eagle_world, tmp_path / "named", "optim.max_steps=1", f"eagle3.feature_dir={tmp_path / 'f0'}",
                                  f"eagle3.heldout_feature_dir={tmp_path / 'fall'}"))
    assert named.curve[0] == {**whole.curve[0], "minutes": named.curve[0]["minutes"]}
    with pytest.raises(StaleFeatureCacheError, match="prompt_context=0.*prompt_context=2"):
        distill(_eagle_config(eagle_world, tmp_path / "x", "optim.max_steps=1", "eagle3.prompt_context=2",
                              f"eagle3.feature_dir={tmp_path / 'f0'}"))


def test_fused_topk_forward_kl_matches_the_autograd_loss_and_its_gradient():
    """The fused forward KL (values and gradient) is `per_token_divergence(kind='fkl')`: with invalid
    entries, an empty residual, a temperature, and in bf16 against the same loss on the same bf16 logits."""
    torch.manual_seed(0)
    n, v, k = 6, 50, 7
    logp, idx = torch.log_softmax(torch.randn(n, v, dtype=torch.float64), -1).topk(k, -1)
    valid = torch.rand(n, k) > 0.2
    valid[:, 0] = True
    idx = torch.where(valid, idx, idx[:, :1])  # padding repeats a valid index, as to_draft_space writes it
    logp = logp.masked_fill(~valid, float("-inf"))
    residual = 1 - logp.exp().sum(-1)
    residual[0] = 0.0
    teacher = losses.TopKTeacher(logp.float(), idx, residual.float(), valid)
    for temperature, dtype in ((1.0, torch.float32), (2.0, torch.float32), (1.0, torch.bfloat16)):
        logits = (3 * torch.randn(n, v)).to(dtype)
        a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        want = losses.per_token_divergence(a, teacher, kind="fkl", temperature=temperature)
        got = losses.topk_forward_kl(b, teacher, temperature)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        weights = torch.rand(n)
        (want * weights).sum().backward()
        (got * weights).sum().backward()
        assert b.grad.dtype == dtype
        torch.testing.assert_close(b.grad.float(), a.grad.float(), rtol=1e-4, atol=1e-6 if dtype == torch.float32 else 1e-2)


def test_unroll_on_trained_rows_only_gives_the_same_loss_and_gradients(target):
    """lm_head over the trained rows only and the fused loss: the loss and every gradient of the full
    unroll with the autograd loss."""
    from specdistill.distill.eagle3_train import Eagle3Example, collate_eagle3
    from specdistill.modeling.eagle3_init import init_eagle3_from_target
    from specdistill.modeling.vocab import DraftVocab

    torch.manual_seed(1)
    head = init_eagle3_from_target(target, DraftVocab(torch.arange(64), 64), [1, 3, 4]).float()
    examples = []
    for ex in _examples(n=3):
        n = len(ex.input_ids) - 1
        row_of = torch.full((len(ex.input_ids),), -1, dtype=torch.long)
        answer = [t for t in range(1, len(ex.input_ids)) if ex.assistant_mask[t]]
        row_of[torch.tensor(answer)] = torch.arange(len(answer))
        logp, idx = torch.log_softmax(torch.randn(len(answer), 64), -1).topk(5, -1)
        keep = torch.rand(len(answer)) > 0.3
        examples.append(Eagle3Example(ex.id, torch.tensor(ex.input_ids), 0, torch.randn(n, 96), row_of,
                                      losses.TopKTeacher(logp, idx, 1 - logp.exp().sum(-1)), keep))
    batch = collate_eagle3(examples, 3)
    grads = []
    for keep, fused in ((None, False), ([batch.trained(j) for j in range(3)], True)):
        head.zero_grad()
        loss = eagle3_loss(head.unroll(batch.next_ids, batch.features, 3, batch.valid, keep), batch, fused=fused)
        loss.backward()
        grads.append((loss.detach(), {k: p.grad.clone() for k, p in head.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-5, atol=1e-6)
    assert grads[1][1].keys() == grads[0][1].keys() and "lm_head.weight" in grads[0][1]
    for name, g in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_online_features_train_as_the_cache_does(eagle_world, tmp_path):
    """`eagle3.features: online` (the target's feature pass in each batch, nothing on disk) gives the cached
    run's losses and held-out acceptance, fp32; a fresh teacher cache is still written, features are not."""
    common = ("optim.max_steps=3", "eagle3.feature_dtype=float32", f"teacher.cache_dir={tmp_path / 'teacher'}")
    cached = distill(_eagle_config(eagle_world, tmp_path / "cached", *common, f"eagle3.feature_dir={tmp_path / 'f'}")).result_json()
    online = distill(_eagle_config(eagle_world, tmp_path / "online", *common, f"eagle3.feature_dir={tmp_path / 'g'}",
                                   "eagle3.features=online", f"teacher.cache_dir={tmp_path / 'teacher-online'}")).result_json()
    assert cached["features"] == "cache" and cached["feature_disk_bytes"] > 0
    assert online["features"] == "online" and online["feature_disk_bytes"] == 0
    assert not (tmp_path / "g").exists() and not (tmp_path / "g-heldout").exists()
    assert (tmp_path / "teacher-online" / "teacher_cache.json").is_file()
    want = [r["loss"] for r in _log(tmp_path / "cached")]
    got = [r["loss"] for r in _log(tmp_path / "online")]
    assert got == pytest.approx(want, rel=1e-5)
    for a, b in zip(online["curve"], cached["curve"]):
        assert a["acceptance_per_position"] == pytest.approx(b["acceptance_per_position"])


def test_auto_features_go_online_over_the_disk_budget(eagle_world, tmp_path):
    small = distill(_eagle_config(eagle_world, tmp_path / "small", "optim.max_steps=1", "eagle3.features=auto",
                                  f"eagle3.feature_dir={tmp_path / 'f'}", "eagle3.feature_max_gb=1e-6")).result_json()
    assert small["features"] == "online" and not (tmp_path / "f").exists()
    assert "over eagle3.feature_max_gb=1e-06" in small["features_reason"]
    roomy = distill(_eagle_config(eagle_world, tmp_path / "roomy", "optim.max_steps=1", "eagle3.features=auto",
                                  f"eagle3.feature_dir={tmp_path / 'f'}", "eagle3.feature_max_gb=1")).result_json()
    assert roomy["features"] == "cache" and (tmp_path / "f").is_dir() and "within" in roomy["features_reason"]
    assert roomy["feature_disk_bytes"] > 1e-6 * 1e9  # the cache the small budget would have refused


def test_eagle3_warm_start_across_a_target_update_trains_and_records_its_lineage(eagle_world, tmp_path):
    """After a target update (top layer tuned, a token added) the champion's head is what incremental
    distillation starts from: another fingerprint is the reason to retrain, never a reason to refuse."""
    from specdistill.modeling.eagle3_io import META_FILE
    from specdistill.modeling.models import load_model
    from specdistill.ops.demo_update import add_domain_tokens

    first = distill(_eagle_config(eagle_world, tmp_path / "night1", "optim.max_steps=40", "eval_every=20"))
    old = load_model(eagle_world / "target")
    updated = load_model(eagle_world / "target")
    add_domain_tokens(updated.model, updated.tokenizer, ("CalcBlackScholesVega",))
    with torch.no_grad():
        for p in updated.model.model.layers[-1].parameters():
            p.add_(0.01 * torch.randn_like(p))
    new_dir = tmp_path / "target-v2"
    updated.model.save_pretrained(new_dir)
    updated.tokenizer.save_pretrained(new_dir)
    new_fp = load_model(new_dir).fingerprint
    assert new_fp != old.fingerprint

    def night2(name: str, *extra: str):
        return distill(_eagle_config(eagle_world, tmp_path / name, f"target={new_dir}", "optim.max_steps=4",
                                     f"teacher.cache_dir={tmp_path / 'teacher-v2'}",
                                     f"eagle3.feature_dir={tmp_path / 'features-v2'}", *extra))

    warm = night2("warm", f"draft={first.draft_dir}")
    scratch = night2("scratch")
    # it trained on the new target, from where the old head had got to, well above a head started from the target
    assert warm.steps == 4 and warm.curve[0]["acceptance"] > scratch.curve[0]["acceptance"] + 0.1
    meta = json.loads((Path(warm.draft_dir) / META_FILE).read_text())
    assert meta["target_fingerprint"] == new_fp
    assert meta["warm_start"]["target_fingerprint"] == old.fingerprint and meta["warm_start"]["vocab_carried_over"]
