"""Teacher signal: cache keying and refusal, resumable cache build, reduced-vocabulary mapping."""

from __future__ import annotations

import pytest
import torch

from specdistill.distill import losses
from specdistill.distill.examples import Example
from specdistill.distill.features import build_cache
from specdistill.distill.teacher import (
    OnlineTeacher,
    StaleTeacherCacheError,
    TeacherCache,
    check_entry,
    data_hash,
    drop_stale,
    pad_batch,
    teacher_positions,
    to_draft_space,
)
from specdistill.modeling.vocab import DraftVocab
from tests.conftest import make_tiny_llama


def _examples(n=5, vocab=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 6 + i
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        mask = [False] * 3 + [True] * (length - 3)
        out.append(Example(f"e{i}", ids, mask))
    return out


def test_build_cache_stores_the_targets_topk_and_resumes(tmp_path):
    target = make_tiny_llama()
    examples = _examples()
    cache = build_cache(target, examples, tmp_path / "c", fingerprint="a" * 16, k=5, batch_size=2, progress=False)
    shards = sorted(p.name for p in (tmp_path / "c").glob("shard-*"))
    assert len(shards) == 3 and len(cache) == 5
    rows = cache.load_all()
    for ex in examples:
        with torch.no_grad():
            logits = target(input_ids=torch.tensor([ex.input_ids])).logits[0, teacher_positions(ex.assistant_mask)]
        top = torch.log_softmax(logits, -1).topk(5, -1)
        assert torch.allclose(rows[ex.id]["logprobs"], top.values, atol=1e-5)
        assert rows[ex.id]["indices"].tolist() == top.indices.tolist()
        check_entry(rows[ex.id], ex.id, ex.input_ids, len(teacher_positions(ex.assistant_mask)))
    # resume: a deleted shard is rebuilt, the others are not touched
    first = tmp_path / "c" / shards[0]
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "c").glob("shard-*")}
    first.unlink()
    build_cache(target, examples, tmp_path / "c", fingerprint="a" * 16, k=5, batch_size=2, progress=False)
    assert first.is_file()
    for p, t in mtimes.items():
        if p != first:
            assert p.stat().st_mtime_ns == t


def test_cache_for_other_target_data_or_k_is_refused(tmp_path):
    target = make_tiny_llama()
    examples = _examples()
    build_cache(target, examples, tmp_path / "c", fingerprint="a" * 16, k=5, progress=False)
    with pytest.raises(StaleTeacherCacheError, match="fingerprint"):
        TeacherCache.open(tmp_path / "c", fingerprint="b" * 16)
    with pytest.raises(StaleTeacherCacheError, match="k="):
        TeacherCache.open(tmp_path / "c", fingerprint="a" * 16, k=8)
    with pytest.raises(StaleTeacherCacheError, match="data="):
        build_cache(target, _examples(seed=1), tmp_path / "c", fingerprint="a" * 16, k=5, progress=False)
    assert data_hash(examples) != data_hash(_examples(seed=1))
    rows = TeacherCache.open(tmp_path / "c", fingerprint="a" * 16).load_all()
    other = _examples(seed=2)[0]
    with pytest.raises(StaleTeacherCacheError, match="other token ids"):
        check_entry(rows["e0"], "e0", other.input_ids, 1)


def test_full_topk_mapped_to_draft_vocab_equals_renormalized_teacher():
    g = torch.Generator().manual_seed(0)
    teacher_logits = torch.randn(7, 40, generator=g, dtype=torch.float64)
    student = torch.randn(7, 6, generator=g, dtype=torch.float64)
    vocab = DraftVocab(torch.tensor([1, 4, 9, 20, 33, 39]), 40)
    full_top = losses.topk_teacher_from_logits(teacher_logits, 40)
    mapped = to_draft_space(full_top, vocab)
    restricted = losses.restrict_teacher_logits(teacher_logits, vocab.token_ids)
    for kind in losses.DIVERGENCES:
        got = losses.distill_loss(student, mapped, None, kind=kind)
        want = losses.distill_loss(student, restricted, None, kind=kind)
        assert got.item() == pytest.approx(want.item(), rel=1e-6, abs=1e-9), kind
    # with k < V the residual bucket absorbs the rest and the loss stays finite with gradients
    s = student.clone().requires_grad_(True)
    loss = losses.distill_loss(s, to_draft_space(losses.topk_teacher_from_logits(teacher_logits, 8), vocab), None)
    (grad,) = torch.autograd.grad(loss, s)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


def test_online_teacher_restricts_to_draft_vocab():
    target = make_tiny_llama()
    vocab = DraftVocab(torch.arange(0, 96, 3), 96)
    ex = _examples(2)
    ids, att = pad_batch([e.input_ids for e in ex])
    pos = torch.zeros_like(ids, dtype=torch.bool)
    pos[:, 3:5] = True
    logits, _ = OnlineTeacher(target, vocab)(ids, att, pos)
    with torch.no_grad():
        full = target(input_ids=ids, attention_mask=att).logits[pos]
    assert torch.allclose(logits, full[:, vocab.token_ids], atol=1e-5)


def test_stale_entries_are_dropped_and_counted_never_fatal(tmp_path, capsys):
    """An answer re-made on another night (other token ids) whose cached rows are the first answer's:
    it is not trained on, it is counted, and the others still train. A missing entry is an error."""
    target = make_tiny_llama()
    examples = _examples()
    rows = build_cache(target, examples, tmp_path / "c", fingerprint="a" * 16, k=5, progress=False).load_all()
    reanswered = Example("e1", examples[1].input_ids[:3] + [4] * (len(examples[1].input_ids) - 3),
                         examples[1].assistant_mask)
    kept, stale = drop_stale([examples[0], reanswered, *examples[2:]], rows, tmp_path / "c")
    assert stale == ["e1"] and [ex.id for ex in kept] == ["e0", "e2", "e3", "e4"]
    assert "1 of 5 examples dropped" in capsys.readouterr().err
    with pytest.raises(StaleTeacherCacheError, match="every entry"):
        drop_stale([reanswered], rows, tmp_path / "c")
    with pytest.raises(ValueError, match="no entry for example 'x'"):
        drop_stale([Example("x", [3, 4], [False, True])], rows, tmp_path / "c")
