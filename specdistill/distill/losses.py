"""Distillation losses between a target (teacher) and a draft (student): per predicted position, then
averaged over the assistant positions only (`mask`), so a prompt or a system turn never pulls the draft.
The teacher is full logits (online) or a `TopKTeacher`: k log-probs, their ids and the residual mass of
every other token, one extra bucket on both sides.

Why total variation: under speculative sampling a draft token is accepted with probability Σ min(p, q) =
1 − TV(p, q), so TV *is* the objective; forward KL, its smooth upper bound (Pinsker), remains the default.

A reduced draft vocabulary renormalizes the teacher over its N kept tokens (`restrict_teacher_logits`):
the mass outside is acceptance no draft parameter can change, and as a residual bucket it would make
forward KL infinite (the draft puts zero mass there) and add only a constant to TV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DIVERGENCES = ("fkl", "rkl", "jsd", "tv")


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """Softmaxes run in at least fp32 (bf16 autocast logits lose the tail otherwise)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


@dataclass
class TopKTeacher:
    """The teacher's k most likely tokens per position, and the mass of all the others."""

    logprobs: torch.Tensor  # [..., k] log p of the k tokens (at the cache's temperature)
    indices: torch.Tensor  # [..., k] their token ids (in the draft's vocabulary space)
    residual: torch.Tensor  # [...] 1 - Σ p over the k tokens (≥ 0)
    valid: torch.Tensor | None = None  # [..., k] False for entries a reduced draft vocabulary lacks

    def to(self, device: torch.device) -> TopKTeacher:
        return TopKTeacher(self.logprobs.to(device), self.indices.to(device), self.residual.to(device),
                           None if self.valid is None else self.valid.to(device))

    def select(self, mask: torch.Tensor) -> TopKTeacher:
        valid = None if self.valid is None else self.valid[mask]
        return TopKTeacher(self.logprobs[mask], self.indices[mask], self.residual[mask], valid)

    def truncated(self, k: int | None) -> TopKTeacher:
        """At most k entries (a smaller k than cached): the others' mass joins the residual bucket."""
        if not k or k >= self.logprobs.shape[-1]:
            return self
        dropped = self.logprobs[:, k:].exp().sum(-1)
        return TopKTeacher(self.logprobs[:, :k], self.indices[:, :k], self.residual + dropped)


def topk_rows(logits: torch.Tensor, k: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The k largest log-probs per position at `temperature`, their ids (int32) and the mass of the rest."""
    logits = _upcast(logits)
    logp = F.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)  # x / 1 == x: one pass fewer
    top, idx = logp.topk(min(k, logp.shape[-1]), dim=-1)
    # the mass of the other tokens summed directly (1 - Σ top loses it to rounding at ~1e-7)
    residual = torch.logsumexp(logp.scatter(-1, idx, float("-inf")), dim=-1).exp()
    return top, idx.to(torch.int32), residual


def topk_teacher_from_logits(logits: torch.Tensor, k: int, temperature: float = 1.0) -> TopKTeacher:
    top, idx, residual = topk_rows(logits, k, temperature)
    return TopKTeacher(top, idx.long(), residual)


class _TopKForwardKL(torch.autograd.Function):
    """KL(p ‖ q) over the k + 1 buckets of a top-k teacher, with the gradient written out: one pass
    over the vocabulary each way instead of autograd's chain of log_softmax, gather, scatter and
    logsumexp (and their [rows, vocab] intermediates). The same numbers as `per_token_divergence`."""

    @staticmethod
    def forward(ctx, logits, logp, indices, valid, residual, temperature):
        z = _upcast(logits) / temperature if temperature != 1.0 else _upcast(logits)
        logq = z - torch.logsumexp(z, dim=-1, keepdim=True)
        top = logq.gather(-1, indices)
        logq_rest = torch.logsumexp(logq.scatter(-1, indices, -1e4), dim=-1)  # as per_token_divergence
        p = logp.exp().masked_fill(~valid, 0.0)
        p_rest = residual.clamp_min(0).to(p.dtype)
        kl = (p * torch.where(p > 0, logp - top, 0.0)).sum(-1)
        kl = kl + torch.where(p_rest > 0, p_rest * (p_rest.log() - logq_rest), 0.0)
        ctx.save_for_backward(logq, logq_rest, p, p_rest, indices)
        ctx.temperature, ctx.dtype = temperature, logits.dtype
        return kl

    @staticmethod
    def backward(ctx, grad):
        logq, logq_rest, p, p_rest, indices = ctx.saved_tensors
        # d KL / d z_m = P q_m - p_m [m in top] - p_rest q_m / q_rest [m outside the k indices], in place
        scale = (grad / ctx.temperature)[:, None]
        q = logq.exp()
        g = (logq - logq_rest[:, None]).exp_().mul_(-p_rest[:, None] * scale)  # the rest term, everywhere
        total = (p.sum(-1, keepdim=True) + p_rest[:, None]) * scale
        g.addcmul_(q, total)
        g.scatter_(-1, indices, q.gather(-1, indices) * total)
        g.scatter_add_(-1, indices, -p * scale)  # the top entries: no rest term, minus their p
        return g.to(ctx.dtype), None, None, None, None, None


def topk_forward_kl(student_logits: torch.Tensor, teacher: TopKTeacher, temperature: float = 1.0) -> torch.Tensor:
    """`per_token_divergence(kind="fkl")` against a top-k teacher, for rows [N, V] (N, k-wide teacher), fused."""
    valid = teacher.valid if teacher.valid is not None else torch.ones_like(teacher.indices, dtype=torch.bool)
    logp = _upcast(teacher.logprobs).float()
    return _TopKForwardKL.apply(student_logits, logp, teacher.indices.long(), valid, teacher.residual.float(), temperature)


def _xlogy_diff(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Σ p (log p − log q), with 0·log 0 = 0 and no NaN where both are -inf."""
    p = logp.exp()
    diff = torch.where(p > 0, logp - logq, torch.zeros_like(logp))
    return (p * diff).sum(-1)


def divergence(kind: str, logp: torch.Tensor, logq: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """Between p and q as log-probs over the last dimension. fkl is mode-covering (the draft spreads mass
    over all the target might say), rkl mode-seeking, jsd GKD's generalized JSD(β); tv, 1 − Σ min(p, q),
    is exactly the rejection probability of one speculative draft token."""
    if kind == "fkl":
        return _xlogy_diff(logp, logq)
    if kind == "rkl":
        return _xlogy_diff(logq, logp)
    if kind == "jsd":
        if not 0.0 < beta < 1.0:
            raise ValueError(f"JSD beta must be in (0, 1), got {beta}")
        # Floored copies for the mixture only: an entry empty on both sides must not give -inf - -inf.
        lp, lq = logp.clamp_min(-1e4), logq.clamp_min(-1e4)
        logm = torch.logsumexp(torch.stack([lp + math.log(beta), lq + math.log(1 - beta)]), dim=0)
        return beta * _xlogy_diff(logp, logm) + (1 - beta) * _xlogy_diff(logq, logm)
    if kind == "tv":
        return 1.0 - torch.minimum(logp.exp(), logq.exp()).sum(-1)
    raise ValueError(f"unknown divergence {kind!r}: expected one of {DIVERGENCES}")


def masked_mean(per_token: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over the positions where mask is true (0 when there are none, with a gradient path)."""
    if mask is None:
        return per_token.mean()
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp_min(1.0)


def per_token_divergence(
    student_logits: torch.Tensor,
    teacher: torch.Tensor | TopKTeacher,
    *,
    kind: str = "fkl",
    temperature: float = 1.0,
    beta: float = 0.5,
) -> torch.Tensor:
    """Divergence at every position, against full teacher logits (scaled here by `temperature`) or a
    `TopKTeacher` (already at it: the cache records the temperature it was written at)."""
    if isinstance(teacher, TopKTeacher):
        # k + 1 buckets: the k tokens, then the residual. Invalid entries (padding that repeats a valid
        # index) get -inf on both sides: they add nothing.
        res = teacher.residual.clamp_min(0).unsqueeze(-1).to(teacher.logprobs.dtype)
        logp = torch.cat([teacher.logprobs, torch.log(res)], dim=-1)
        indices = teacher.indices.long()
        logq = F.log_softmax(_upcast(student_logits) / temperature, dim=-1)
        top = logq.gather(-1, indices)
        if teacher.valid is not None:
            top = top.masked_fill(~teacher.valid, float("-inf"))
        # log(1 - Σ q_top) computed stably as log(Σ q_rest) via logsumexp over the non-selected entries.
        # The selected entries are replaced by -1e4 rather than -inf: when k covers the whole
        # vocabulary the bucket is then exactly empty (exp(-1e4) = 0) and its gradient is 0, not NaN.
        rest = torch.logsumexp(logq.scatter(-1, indices, -1e4), dim=-1, keepdim=True)
        logq = torch.cat([top, rest], dim=-1)
    else:
        if teacher.shape[-1] != student_logits.shape[-1]:
            raise ValueError(
                f"teacher has {teacher.shape[-1]} logits per position, draft {student_logits.shape[-1]}: "
                "restrict the teacher to the draft vocabulary first"
            )
        logp = F.log_softmax(_upcast(teacher) / temperature, dim=-1)
        logq = F.log_softmax(_upcast(student_logits) / temperature, dim=-1)
    return divergence(kind, logp, logq, beta)


def distill_loss(
    student_logits: torch.Tensor,
    teacher: torch.Tensor | TopKTeacher,
    mask: torch.Tensor | None = None,
    *,
    kind: str = "fkl",
    temperature: float = 1.0,
    beta: float = 0.5,
) -> torch.Tensor:
    """Masked mean divergence, times T² so gradients keep their scale across temperatures (Hinton)."""
    per_token = per_token_divergence(student_logits, teacher, kind=kind, temperature=temperature, beta=beta)
    scale = temperature**2 if kind != "tv" else 1.0
    return scale * masked_mean(per_token, mask)


def cross_entropy(student_logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Plain next-token CE on hard labels (the 'generic draft' objective), masked like the others."""
    per_token = F.cross_entropy(
        _upcast(student_logits).reshape(-1, student_logits.shape[-1]), labels.reshape(-1), reduction="none"
    ).reshape(labels.shape)
    return masked_mean(per_token, mask)


def mixed_loss(
    student_logits: torch.Tensor,
    teacher: torch.Tensor | TopKTeacher,
    labels: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    alpha: float = 0.5,
    temperature: float = 1.0,
    label_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """(1−a)·CE + a·T²·KL(p_T ‖ q_T): hard labels anchor the draft, soft labels carry the target's shape.
    `label_mask` (default: `mask`) masks the CE term alone: labels a reduced draft vocabulary cannot say."""
    ce = cross_entropy(student_logits, labels, mask if label_mask is None else label_mask)
    kl = distill_loss(student_logits, teacher, mask, kind="fkl", temperature=temperature)
    return (1 - alpha) * ce + alpha * kl


class HiddenProjection(torch.nn.Module):
    """Maps draft hidden states into the target's width (identity when they already match); learned."""

    def __init__(self, draft_width: int, target_width: int):
        super().__init__()
        self.proj = None if draft_width == target_width else torch.nn.Linear(draft_width, target_width, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self.proj is None else self.proj(hidden)


def hidden_cosine_loss(
    draft_hidden: torch.Tensor,
    target_hidden: torch.Tensor,
    mask: torch.Tensor | None = None,
    projection: HiddenProjection | None = None,
) -> torch.Tensor:
    h = projection(draft_hidden) if projection is not None else draft_hidden
    if h.shape[-1] != target_hidden.shape[-1]:
        raise ValueError(
            f"draft hidden width {h.shape[-1]} != target {target_hidden.shape[-1]}: pass a HiddenProjection"
        )
    cos = F.cosine_similarity(_upcast(h), _upcast(target_hidden), dim=-1, eps=1e-8)
    return masked_mean(1.0 - cos, mask)


def selective_mask(
    draft_per_token: torch.Tensor,
    reference_per_token: torch.Tensor,
    mask: torch.Tensor,
    keep_fraction: float,
) -> torch.Tensor:
    """Keep the top `keep_fraction` of assistant tokens by KL(p‖q_draft) − KL(p‖q_ref) (AdaSPEC): tokens
    even a well-trained reference cannot fit are capacity the small draft should not spend."""
    mask = mask.bool()
    n = int(mask.sum())
    keep = max(1, math.ceil(keep_fraction * n)) if n else 0
    out = torch.zeros_like(mask)
    if keep == 0:
        return out
    gap = (draft_per_token - reference_per_token).detach().float()
    gap = gap.masked_fill(~mask, float("-inf"))
    flat = gap.reshape(-1)
    chosen = flat.topk(keep).indices
    out.view(-1)[chosen] = True
    return out


def selective_distill_loss(
    student_logits: torch.Tensor,
    reference_logits: torch.Tensor,
    teacher: torch.Tensor | TopKTeacher,
    mask: torch.Tensor,
    *,
    keep_fraction: float = 0.4,
    kind: str = "fkl",
    temperature: float = 1.0,
    beta: float = 0.5,
) -> torch.Tensor:
    """AdaSPEC: the divergence averaged over the selected tokens only."""
    draft_tok = per_token_divergence(student_logits, teacher, kind="fkl", temperature=temperature)
    with torch.no_grad():
        ref_tok = per_token_divergence(reference_logits, teacher, kind="fkl", temperature=temperature)
    chosen = selective_mask(draft_tok, ref_tok, mask, keep_fraction)
    per_token = draft_tok if kind == "fkl" else per_token_divergence(
        student_logits, teacher, kind=kind, temperature=temperature, beta=beta
    )
    scale = temperature**2 if kind != "tv" else 1.0
    return scale * masked_mean(per_token, chosen)


def restrict_teacher_logits(teacher_logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Teacher logits over the draft's N kept tokens; the softmax then renormalizes over them."""
    return teacher_logits.index_select(-1, token_ids.to(teacher_logits.device))
