"""Each loss against a brute-force, position-by-position, full-vocabulary reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdistill.distill import losses

V = 11


def _probs(logits, t):
    z = [x / t for x in logits]
    m = max(z)
    e = [math.exp(x - m) for x in z]
    s = sum(e)
    return [x / s for x in e]


def _kl(p, q):
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 1e-15)


def _ref_div(kind, p, q, beta=0.5):
    if kind == "fkl":
        return _kl(p, q)
    if kind == "rkl":
        return _kl(q, p)
    if kind == "tv":
        return 1 - sum(min(a, b) for a, b in zip(p, q))
    m = [beta * a + (1 - beta) * b for a, b in zip(p, q)]
    return beta * _kl(p, m) + (1 - beta) * _kl(q, m)


def _ref_loss(kind, student, teacher, mask, t, beta=0.5):
    total, n = 0.0, 0
    for b in range(student.shape[0]):
        for i in range(student.shape[1]):
            if not mask[b, i]:
                continue
            p = _probs(teacher[b, i].tolist(), t)
            q = _probs(student[b, i].tolist(), t)
            total += _ref_div(kind, p, q, beta)
            n += 1
    scale = 1.0 if kind == "tv" else t * t
    return scale * total / max(n, 1)


def _batch(seed, b=2, s=5, v=V):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(b, s, v, generator=g, dtype=torch.float64) * 2
    teacher = torch.randn(b, s, v, generator=g, dtype=torch.float64) * 2
    mask = torch.rand(b, s, generator=g) > 0.4
    mask[0, 0] = True
    return student, teacher, mask


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), kind=st.sampled_from(losses.DIVERGENCES),
       t=st.sampled_from([0.5, 1.0, 2.0]), beta=st.floats(0.1, 0.9))
def test_divergences_match_brute_force(seed, kind, t, beta):
    student, teacher, mask = _batch(seed)
    got = losses.distill_loss(student, teacher, mask, kind=kind, temperature=t, beta=beta)
    want = _ref_loss(kind, student, teacher, mask, t, beta)
    assert got.item() == pytest.approx(want, rel=1e-4, abs=1e-6)


def test_mask_excludes_positions():
    student, teacher, mask = _batch(1)
    full = losses.distill_loss(student, teacher, mask)
    teacher2 = teacher.clone()
    teacher2[~mask] = torch.randn_like(teacher2[~mask]) * 10  # masked positions must not matter
    assert losses.distill_loss(student, teacher2, mask).item() == pytest.approx(full.item())


def test_tv_is_one_minus_acceptance_probability():
    # Speculative sampling accepts x~q with prob min(1, p/q): total acceptance Σ min(p, q).
    student, teacher, _ = _batch(2, b=1, s=1)
    p = torch.softmax(teacher[0, 0], -1)
    q = torch.softmax(student[0, 0], -1)
    accept = sum(q[i] * min(1.0, p[i] / q[i]) for i in range(V))
    tv = losses.distill_loss(student, teacher, None, kind="tv")
    assert tv.item() == pytest.approx(1 - float(accept))


def test_divergences_vanish_when_equal_and_are_positive_otherwise():
    student, teacher, mask = _batch(3)
    for kind in losses.DIVERGENCES:
        assert losses.distill_loss(teacher, teacher, mask, kind=kind).item() == pytest.approx(0.0, abs=1e-9)
        assert losses.distill_loss(student, teacher, mask, kind=kind).item() > 1e-3


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, V), kind=st.sampled_from(losses.DIVERGENCES))
def test_topk_with_residual_bucket_matches_brute_force(seed, k, kind):
    student, teacher, mask = _batch(seed)
    top = losses.topk_teacher_from_logits(teacher, k)
    got = losses.distill_loss(student, top, mask, kind=kind)
    total, n = 0.0, 0
    for b in range(student.shape[0]):
        for i in range(student.shape[1]):
            if not mask[b, i]:
                continue
            p = _probs(teacher[b, i].tolist(), 1.0)
            q = _probs(student[b, i].tolist(), 1.0)
            order = sorted(range(V), key=lambda j: -p[j])[:k]
            pb = [p[j] for j in order] + [max(0.0, 1 - sum(p[j] for j in order))]
            qb = [q[j] for j in order] + [max(1e-30, 1 - sum(q[j] for j in order))]
            total += _ref_div(kind, pb, qb)
            n += 1
    assert got.item() == pytest.approx(total / n, rel=1e-4, abs=1e-6)


def test_topk_with_full_k_equals_full_teacher():
    student, teacher, mask = _batch(4)
    top = losses.topk_teacher_from_logits(teacher, V)
    assert losses.distill_loss(student, top, mask).item() == pytest.approx(
        losses.distill_loss(student, teacher, mask).item(), rel=1e-6)


def test_mixed_loss_is_ce_plus_scaled_kl():
    student, teacher, mask = _batch(5)
    labels = teacher.argmax(-1)
    t, a = 2.0, 0.3
    got = losses.mixed_loss(student, teacher, labels, mask, alpha=a, temperature=t)
    ce, n = 0.0, 0
    for b in range(2):
        for i in range(5):
            if mask[b, i]:
                ce -= math.log(_probs(student[b, i].tolist(), 1.0)[labels[b, i]])
                n += 1
    want = (1 - a) * ce / n + a * _ref_loss("fkl", student, teacher, mask, t)
    assert got.item() == pytest.approx(want, rel=1e-5)


def test_gradients_flow_and_are_finite_with_extreme_logits():
    student, teacher, mask = _batch(6)
    teacher[0, 0, 0] = 1e4  # one-hot teacher: log p = -inf elsewhere
    student = student.clone().requires_grad_(True)
    for kind in losses.DIVERGENCES:
        loss = losses.distill_loss(student, teacher, mask, kind=kind)
        (g,) = torch.autograd.grad(loss, student)
        assert torch.isfinite(loss) and torch.isfinite(g).all() and g.abs().sum() > 0


def test_hidden_cosine_with_projection():
    torch.manual_seed(0)
    h_draft = torch.randn(2, 4, 6)
    h_target = torch.randn(2, 4, 8)
    mask = torch.ones(2, 4, dtype=torch.bool)
    proj = losses.HiddenProjection(6, 8)
    got = losses.hidden_cosine_loss(h_draft, h_target, mask, proj)
    with torch.no_grad():
        mapped = proj(h_draft)
    want = sum(
        1 - float(torch.dot(mapped[b, i], h_target[b, i]) / (mapped[b, i].norm() * h_target[b, i].norm()))
        for b in range(2) for i in range(4)
    ) / 8
    assert got.item() == pytest.approx(want, rel=1e-5)
    assert losses.hidden_cosine_loss(h_target, h_target, mask, losses.HiddenProjection(8, 8)).item() == pytest.approx(0, abs=1e-6)
    with pytest.raises(ValueError, match="HiddenProjection"):
        losses.hidden_cosine_loss(h_draft, h_target, mask)


def test_selective_mask_keeps_largest_gaps_among_assistant_tokens():
    draft = torch.tensor([[5.0, 1.0, 3.0, 9.0]])
    ref = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, False]])  # position 3 has the biggest gap but is masked
    chosen = losses.selective_mask(draft, ref, mask, 0.5)
    assert chosen.tolist() == [[True, False, True, False]]
    assert losses.selective_mask(draft, ref, mask, 1.0).tolist() == mask.tolist()


def test_selective_loss_matches_reference_over_selected_tokens():
    student, teacher, mask = _batch(7)
    reference = teacher + 0.1 * torch.randn_like(teacher)
    got = losses.selective_distill_loss(student, reference, teacher, mask, keep_fraction=0.5)
    gaps = []
    for b in range(2):
        for i in range(5):
            if mask[b, i]:
                p = _probs(teacher[b, i].tolist(), 1.0)
                d = _kl(p, _probs(student[b, i].tolist(), 1.0))
                r = _kl(p, _probs(reference[b, i].tolist(), 1.0))
                gaps.append((d - r, d))
    gaps.sort(reverse=True)
    keep = math.ceil(0.5 * len(gaps))
    want = sum(d for _, d in gaps[:keep]) / keep
    assert got.item() == pytest.approx(want, rel=1e-5)


def test_reduced_vocab_teacher_is_renormalized_over_kept_tokens():
    student, teacher, mask = _batch(8)
    kept = torch.tensor([0, 2, 3, 7])
    restricted = losses.restrict_teacher_logits(teacher, kept)
    got = losses.distill_loss(student[..., kept], restricted, mask)
    total, n = 0.0, 0
    for b in range(2):
        for i in range(5):
            if mask[b, i]:
                p = _probs(teacher[b, i].tolist(), 1.0)
                pk = [p[j] for j in kept.tolist()]
                pk = [x / sum(pk) for x in pk]
                total += _kl(pk, _probs(student[b, i, kept].tolist(), 1.0))
                n += 1
    assert got.item() == pytest.approx(total / n, rel=1e-5)


def test_bad_arguments_are_named():
    student, teacher, mask = _batch(9)
    with pytest.raises(ValueError, match="unknown divergence"):
        losses.distill_loss(student, teacher, mask, kind="l2")
    with pytest.raises(ValueError, match="restrict the teacher"):
        losses.distill_loss(student[..., :5], teacher, mask)
    with pytest.raises(ValueError, match="beta"):
        losses.distill_loss(student, teacher, mask, kind="jsd", beta=1.0)
