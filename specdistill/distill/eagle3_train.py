"""Training an EAGLE-3 head: batches from the feature and teacher caches, the unrolled loss, held-out acceptance.

Entry t pairs the target's features at t with token t+1; unroll step j at entry t predicts token
u = t+2+j, by forward KL to the cached top-k row of u in draft space (`teacher.to_draft_space`:
renormalized over the kept tokens, the residual one bucket), weighted 0.8^j; rows whose target argmax
is outside the draft vocabulary are masked (no draft parameter can agree there).

Held-out acceptance: per draft position j+1, greedy agreement with the target's continuation, and the
chained share (positions 1..i all agree) a drafting round accepts; τ(γ) from the chain, and from
position 1 under the i.i.d. model (the number the layer drafts report).
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdistill.acceptance import DEFAULT_GAMMA, expected_tokens_per_round
from specdistill.distill import features as feature_cache
from specdistill.distill import losses
from specdistill.distill.features import (
    FeatureCache,
    OnlineFeatures,
    StaleFeatureCacheError,
    choose_features,
    entry_features,
    feature_start,
)
from specdistill.distill.layer_task import _build_draft_vocab
from specdistill.distill.teacher import TeacherCache, drop_stale, teacher_positions, to_draft_space
from specdistill.distill.trained import HeldoutAcceptance
from specdistill.modeling import eagle3_io
from specdistill.modeling.eagle3 import Eagle3Draft, check_head_fits, default_aux_layers
from specdistill.modeling.eagle3_init import init_eagle3_from_target
from specdistill.modeling.eagle3_io import load_eagle3
from specdistill.modeling.models import resolve_dtype
from specdistill.modeling.vocab import DraftVocab


@dataclass
class Eagle3Example:
    """One sequence ready for the unroll: ids, its stored features and its teacher rows in draft space."""

    id: str
    ids: torch.Tensor  # [L] token ids
    start: int  # first stored feature position
    features: torch.Tensor | None  # [L-1-start, 3·H] bf16; None: computed in the batch (`features: online`)
    row_of: torch.Tensor  # [L] teacher row predicting token u, -1 where u is not an answer token
    teacher: losses.TopKTeacher  # [rows, k] in draft space
    keep: torch.Tensor  # [rows] the target's argmax is a draft-vocabulary token

    @property
    def entries(self) -> int:
        return self.ids.numel() - 1 - self.start


def eagle3_examples(examples: list, feature_rows: dict | None, teacher_rows: dict | None, draft_vocab: DraftVocab,
                    prompt_context: int | None, remap: bool, top_k: int | None = None) -> list[Eagle3Example]:
    """Join examples with their cache entries (a stale feature entry fails naming the example); without
    feature rows (`features: online`) the examples carry none."""
    out = []
    for ex in examples:
        start = feature_start(ex.assistant_mask, prompt_context)
        features = None if feature_rows is None else \
            entry_features(feature_rows.get(str(ex.id)), str(ex.id), ex.input_ids, start)
        answer_rows = teacher_positions(ex.assistant_mask)
        row_of = torch.full((len(ex.input_ids),), -1, dtype=torch.long)
        row_of[torch.tensor(answer_rows, dtype=torch.long) + 1] = torch.arange(len(answer_rows))
        if teacher_rows is not None:  # drop_stale kept only the examples whose entry describes them
            t, n = teacher_rows[str(ex.id)], len(answer_rows)
            top = losses.TopKTeacher(t["logprobs"][:n].float(), t["indices"][:n].long(), t["residual"][:n].float())
            top = top.truncated(top_k)
            if remap:
                top = to_draft_space(top, draft_vocab)
                keep = top.valid[:, 0]  # the cache's rows are sorted: column 0 is the target's argmax
            else:
                keep = torch.ones(n, dtype=torch.bool)
        else:  # held-out sequences need labels only
            top, keep = losses.TopKTeacher(torch.zeros(0, 1), torch.zeros(0, 1, dtype=torch.long), torch.zeros(0)), None
        out.append(Eagle3Example(str(ex.id), torch.tensor(ex.input_ids, dtype=torch.long), start, features,
                                 row_of, top, keep))
    return out


@dataclass
class Eagle3Batch:
    ids: list[str]
    next_ids: torch.Tensor  # [B, T] token t+1 of entry t
    features: torch.Tensor | None  # [B, T, 3·H]; None until the online feature pass fills it
    valid: torch.Tensor  # [B, T]
    rows: list[torch.Tensor]  # per step: [B, T] index into the batch's teacher rows, -1 for none
    labels: list[torch.Tensor]  # per step: [B, T] the token the step predicts (target ids), -1 past the end
    teacher: losses.TopKTeacher | None  # every example's rows, concatenated
    keep: torch.Tensor | None

    @property
    def tokens(self) -> int:
        return int((self.rows[0] >= 0).sum())

    def trained(self, j: int) -> torch.Tensor:
        """[B, T]: the entries step j learns at (an answer token whose target argmax is a draft token)."""
        sel = self.rows[j] >= 0
        return sel & self.keep[self.rows[j].clamp_min(0)] if bool(sel.any()) else sel

    def to(self, device) -> Eagle3Batch:
        return Eagle3Batch(self.ids, self.next_ids.to(device), None if self.features is None else self.features.to(device),
                           self.valid.to(device),
                           [r.to(device) for r in self.rows], [x.to(device) for x in self.labels],
                           None if self.teacher is None else self.teacher.to(device),
                           None if self.keep is None else self.keep.to(device))


def collate_eagle3(examples: list[Eagle3Example], steps: int) -> Eagle3Batch:
    b, t = len(examples), max(ex.entries for ex in examples)
    cached = examples[0].features is not None
    next_ids = torch.zeros(b, t, dtype=torch.long)
    features = torch.zeros(b, t, examples[0].features.shape[-1], dtype=examples[0].features.dtype) if cached else None
    valid = torch.zeros(b, t, dtype=torch.bool)
    rows = [torch.full((b, t), -1, dtype=torch.long) for _ in range(steps)]
    labels = [torch.full((b, t), -1, dtype=torch.long) for _ in range(steps)]
    offset = 0
    for i, ex in enumerate(examples):
        n, s = ex.entries, ex.start
        next_ids[i, :n] = ex.ids[s + 1 : s + 1 + n]
        if cached:
            features[i, :n] = ex.features
        valid[i, :n] = True
        row_ext = torch.cat([ex.row_of, torch.full((steps + 2,), -1, dtype=torch.long)])
        ids_ext = torch.cat([ex.ids, torch.full((steps + 2,), -1, dtype=torch.long)])
        for j in range(steps):
            r = row_ext[s + 2 + j : s + 2 + j + n]
            rows[j][i, :n] = torch.where(r >= 0, r + offset, r)
            labels[j][i, :n] = torch.where(r >= 0, ids_ext[s + 2 + j : s + 2 + j + n], -1)
        offset += ex.teacher.logprobs.shape[0]
    teacher = keep = None
    if examples[0].keep is not None:
        parts = [ex.teacher for ex in examples]
        valid_parts = [p.valid if p.valid is not None else torch.ones_like(p.indices, dtype=torch.bool) for p in parts]
        teacher = losses.TopKTeacher(torch.cat([p.logprobs for p in parts]), torch.cat([p.indices for p in parts]),
                                     torch.cat([p.residual for p in parts]), torch.cat(valid_parts))
        keep = torch.cat([ex.keep for ex in examples])
    return Eagle3Batch([ex.id for ex in examples], next_ids, features, valid, rows, labels, teacher, keep)


def eagle3_loss(step_logits: list[torch.Tensor], batch: Eagle3Batch, *, decay: float = 0.8, kind: str = "fkl",
                temperature: float = 1.0, fused: bool = True) -> torch.Tensor:
    """Σ_j decay^j · mean divergence of step j over its trained rows (`Eagle3Batch.trained`), over Σ_j decay^j
    of the steps with rows. Step logits are [B, T, V], or [rows, V] for the trained rows only
    (`Eagle3Draft.unroll(keep=...)` skips the lm_head elsewhere). Forward KL runs fused unless `fused=False`."""
    total = weight = 0.0
    for j, logits in enumerate(step_logits):
        sel = batch.trained(j)
        if not bool(sel.any()):
            continue
        teacher = batch.teacher.select(batch.rows[j][sel])
        rows = logits[sel] if logits.dim() == 3 else logits
        if fused and kind == "fkl":
            per_row = losses.topk_forward_kl(rows, teacher, temperature)
        else:
            per_row = losses.per_token_divergence(rows, teacher, kind=kind, temperature=temperature)
        scale = temperature**2 if kind != "tv" else 1.0
        total = total + decay**j * scale * per_row.mean()
        weight += decay**j
    if weight == 0.0:
        return step_logits[0].sum() * 0.0  # nothing to learn in this batch; keeps the graph for DDP
    return total / weight


class Eagle3Trainee(nn.Module):
    """The head behind one `forward` (what DDP wraps): the unroll of `steps` draft steps."""

    def __init__(self, head: Eagle3Draft, steps: int):
        super().__init__()
        self.head, self.steps = head, steps

    def forward(self, next_ids: torch.Tensor, features: torch.Tensor, valid: torch.Tensor,
                keep: list[torch.Tensor] | None = None, deep: torch.Tensor | None = None,
                alignment: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        return self.head.unroll(next_ids, features, self.steps, valid, keep, deep, alignment)


@torch.no_grad()
def eagle3_heldout_acceptance(head: Eagle3Draft, examples: list[Eagle3Example], steps: int, gamma: int = DEFAULT_GAMMA,
                              batch_size: int = 8, device: torch.device | str = "cpu") -> HeldoutAcceptance:
    """Per draft position: top-1 agreement with the target's continuation, and the chained share accepted."""
    was_training = head.training
    head.eval()
    vocab = head.draft_vocab
    agree = torch.zeros(steps)
    total = torch.zeros(steps)
    chain = torch.zeros(steps)
    for begin in range(0, len(examples), batch_size):
        batch = collate_eagle3(examples[begin : begin + batch_size], steps).to(device)
        outs = head.unroll(batch.next_ids, batch.features, steps, batch.valid)
        alive = torch.ones_like(batch.valid)
        for j, logits in enumerate(outs):
            has = batch.labels[j] >= 0
            ok = (vocab.to_target_ids(logits.argmax(-1)) == batch.labels[j]) & has
            alive = alive & ok
            agree[j] += int(ok.sum())
            chain[j] += int((alive & has).sum())
            total[j] += int(has.sum())
    head.train(was_training)
    per_position = (agree / total.clamp_min(1)).tolist()
    accepted = (chain / total.clamp_min(1)).tolist()
    g = min(gamma, steps)
    return HeldoutAcceptance(per_position[0], expected_tokens_per_round(per_position[0], gamma), int(total[0]),
                             per_position, accepted, g, 1.0 + sum(accepted[:g]))


def _warm_start(config, target) -> tuple[Eagle3Draft, DraftVocab, dict]:
    """The head of an earlier target version (`config.draft`), its draft vocabulary and its lineage: warm
    starting is the point of incremental distillation. Its shapes decide (`check_fits`), and a tokenizer the
    update changed carries its draft vocabulary over."""
    loaded = load_eagle3(config.draft, target.model, target_tokenizer=target.tokenizer, feature_layers=config.eagle3.layers)
    head = loaded.head
    lineage = {"dir": str(config.draft), "target_fingerprint": loaded.meta.get("target_fingerprint"),
               "vocab_carried_over": loaded.transplanted or bool(loaded.meta.get("transplanted_from"))}
    draft_vocab = head.draft_vocab
    # a vocabulary carried over to a new tokenizer keeps the tokens the update added: its size is its own
    if (isinstance(config.draft_vocab, int) and draft_vocab.size != config.draft_vocab
            and not lineage["vocab_carried_over"]):
        raise ValueError(f"warm-start head {config.draft} has a {draft_vocab.size}-token vocabulary, "
                         f"config asks for {config.draft_vocab}")
    return head, draft_vocab, lineage


def _new_head(config, target, examples: list) -> tuple[Eagle3Draft, DraftVocab, None]:
    """A head initialized from the target (no warm start), over the draft vocabulary `config.draft_vocab`
    asks for (the target's whole vocabulary when it asks for none), reading `eagle3.layers` or the default ones."""
    draft_vocab = _build_draft_vocab(config, examples, target.tokenizer, target.config.vocab_size)
    if draft_vocab is None:
        draft_vocab = DraftVocab(torch.arange(target.config.vocab_size), target.config.vocab_size)
    layers = config.eagle3.layers or default_aux_layers(target.config.num_hidden_layers)
    return init_eagle3_from_target(target.model, draft_vocab, layers), draft_vocab, None


def _heldout_feature_dir(e, feature_dir: Path, heldout: list) -> tuple[Path, int | str | None]:
    """Where the held-out sequences' features are cached, and with how much prompt. They are evaluated as the
    drafter serves them, with the whole prompt: when training stores less prompt they get a cache of their
    own (or the one named by `heldout_feature_dir`)."""
    if e.heldout_feature_dir:
        return Path(e.heldout_feature_dir), "any"
    if e.prompt_context is not None and heldout:
        return feature_dir.with_name(feature_dir.name + "-heldout"), None
    return feature_dir, e.prompt_context


def _build_caches(config, target, layers: list[int], builds: list[tuple]) -> None:
    """The target's teacher-forced pass over the sequences a cache lacks, for each (feature directory,
    sequences, prompt context, teacher directory) in `builds`; under torch.distributed one rank writes and
    the others wait."""
    e = config.eagle3
    multi = torch.distributed.is_available() and torch.distributed.is_initialized()
    for directory, seqs, context, teacher_dir in builds:
        needed = teacher_dir is not None or (directory is not None
                                             and {str(ex.id) for ex in seqs} - FeatureCache(directory, {}).ids())
        if needed and (not multi or torch.distributed.get_rank() == 0):  # one rank writes, the others wait
            dtype = resolve_dtype(e.feature_dtype)  # features as the target serves, on the training device
            runner = target.model if target.model.dtype == dtype else copy.deepcopy(target.model).to(dtype)
            feature_cache.build_feature_cache(runner, seqs, directory, fingerprint=target.fingerprint, layers=layers,
                                prompt_context=context,
                                max_bytes=None if e.feature_max_gb is None else e.feature_max_gb * 1e9,
                                teacher_dir=teacher_dir, k=e.teacher_top_k,
                                temperature=config.loss.temperature, progress=config.progress,
                                extend=teacher_dir is None)  # e.g. the answer pass's cache lacks a few
            del runner
        if multi:
            torch.distributed.barrier()


def _drop_other_answers(examples: list, rows: dict | None, feature_dir: Path) -> tuple[list, int]:
    """The examples whose cached features were written for their own token ids, and how many were not: the
    same rule as the teacher's rows (dropped and counted, never trained on); none left is an error."""
    other_answer = [ex for ex in examples if rows is not None and str(ex.id) in rows
                    and rows[str(ex.id)]["input_ids"].tolist()[: len(ex.input_ids)] != ex.input_ids]
    if other_answer:
        print(f"feature cache {feature_dir}: {len(other_answer)} examples dropped, their entries were written "
              "for other token ids", file=sys.stderr)
        examples = [ex for ex in examples if ex not in other_answer]
        if not examples:
            raise StaleFeatureCacheError(f"feature cache {feature_dir}: every entry was written for other token ids")
    return examples, len(other_answer)


class Eagle3Task:
    """The EAGLE-3 kind: a head over the target's features, trained from the feature and teacher
    caches (built in one teacher-forced target pass when absent); what `train.distill` needs of a kind."""

    def __init__(self, config, target, examples: list, replay: list, heldout: list, device: torch.device):
        e = config.eagle3
        self.config, self.device = config, device
        # lineage: the warm start's own record (which head, trained for which target); None for a new head
        head, draft_vocab, self.lineage = _warm_start(config, target) if config.draft else _new_head(config, target, examples)
        check_head_fits(head, target.model)
        if e.layers and list(e.layers) != head.aux_layers:
            raise ValueError(f"eagle3.layers={e.layers} but the warm-start head reads target layers {head.aux_layers}")
        self.head, self.draft, self.draft_vocab, self.layers = head, head, draft_vocab, head.aux_layers

        cache_dir = Path(config.teacher.cache_dir)
        feature_dir = Path(e.feature_dir) if e.feature_dir else Path(config.out_dir) / "features"
        fresh_teacher = not (cache_dir / "teacher_cache.json").is_file()
        held_dir, held_context = _heldout_feature_dir(e, feature_dir, heldout)
        every = list({str(ex.id): ex for ex in examples + (heldout if held_dir == feature_dir else [])}.values())
        self.features, self.features_reason = choose_features(e.features, every, target.config.hidden_size,
                                                              e.prompt_context, e.feature_max_gb, len(self.layers))
        online = self.features == "online"  # no feature cache: the target's pass runs in each batch (micro_loss)
        builds = [(None if online else feature_dir, every, e.prompt_context, cache_dir if fresh_teacher else None)]
        if held_dir != feature_dir and not e.heldout_feature_dir and not online:
            builds.append((held_dir, heldout, None, None))
        _build_caches(config, target, self.layers, builds)
        features = None if online else FeatureCache.open(feature_dir, fingerprint=target.fingerprint,
                                                         layers=self.layers, prompt_context=e.prompt_context)
        teacher = TeacherCache.for_training(cache_dir, fingerprint=target.fingerprint,
                                            temperature=config.loss.temperature, draft_vocab=draft_vocab)
        rows, teacher_rows = (None if online else features.load_all()), teacher.load_all()
        remap = teacher.meta["vocab"] == "full"
        examples, stale = drop_stale(examples, teacher_rows, cache_dir)
        examples, other_answer = _drop_other_answers(examples, rows, feature_dir)
        self.stale_dropped = len(stale) + other_answer
        self.examples = eagle3_examples(examples, rows, teacher_rows, draft_vocab, e.prompt_context, remap, config.loss.top_k)
        self.online = OnlineFeatures(target.model, self.layers, resolve_dtype(e.feature_dtype)) if online else None
        self.heldout = self._heldout_examples(target, heldout, rows, feature_dir, held_dir, held_context, remap)
        answer_tokens = sum(sum(ex.assistant_mask[1:]) for ex in every)
        disk = 0 if online else features.disk_bytes()
        self.feature_bytes = (disk, disk / max(1, answer_tokens))  # on disk, per answer token
        self.module = Eagle3Trainee(head, e.steps).to(device)

    def _heldout_examples(self, target, heldout: list, rows: dict | None, feature_dir: Path, held_dir: Path,
                          held_context: int | str | None, remap: bool) -> list[Eagle3Example]:
        """The held-out sequences as the drafter serves them, with the whole prompt: their features from the
        training cache, from a cache of their own, or (features online) computed once here and kept in memory."""
        held_rows = rows
        if self.online is not None:
            held_context = None
        elif held_dir != feature_dir:
            other = FeatureCache.open(held_dir, fingerprint=target.fingerprint, layers=self.layers, prompt_context=held_context)
            held_rows, held_context = other.load_all(), other.meta["prompt_context"]
        examples = eagle3_examples(heldout, held_rows, None, self.draft_vocab, held_context, remap)
        for begin in range(0, len(examples) if self.online is not None else 0, 8):
            chunk = examples[begin : begin + 8]
            for ex, f in zip(chunk, self.online(chunk)):
                ex.features = f[: ex.entries].clone()
        return examples

    def micro_loss(self, model, indices: list[int], step: int, micro: int, autocast):
        chosen = [self.examples[i] for i in indices]
        batch = collate_eagle3(chosen, self.module.steps)
        if batch.features is None:
            batch.features = self.online(chosen)
        batch = batch.to(self.device)
        deep = self.deep_entries(batch, step, micro)
        keep = [batch.trained(j) for j in range(self.module.steps)]  # logits of the trained rows only
        align = self.config.eagle3.align_weight
        alignment: list[torch.Tensor] | None = [] if align > 0 else None
        with autocast:
            outs = model(batch.next_ids, batch.features, batch.valid, keep, deep, alignment)
        loss = eagle3_loss(outs, batch, decay=self.config.eagle3.decay, kind=self.config.loss.kind,
                           temperature=self.config.loss.temperature)
        if alignment:
            loss = loss + align * alignment[0]
        return loss, batch.tokens, batch.ids

    def deep_entries(self, batch: Eagle3Batch, step: int, micro: int) -> torch.Tensor | None:
        """The entries the draft steps after the first train at this micro-batch: a random `eagle3.deep_share` of
        those with a second-step label (all of them at share 1), drawn from the step and micro-batch alone so a
        resumed run draws the same; the later steps' rows elsewhere are dropped from the batch (`Eagle3Batch.rows`)."""
        share = self.config.eagle3.deep_share
        if self.module.steps < 2 or share >= 1.0:
            return None
        g = torch.Generator().manual_seed(1_000_003 * step + micro)
        deep = (torch.rand(batch.valid.shape, generator=g) < share).to(batch.valid.device) & (batch.rows[1] >= 0)
        for j in range(1, self.module.steps):
            batch.rows[j] = torch.where(deep, batch.rows[j], -1)
        return deep

    def evaluate(self) -> HeldoutAcceptance | None:
        if not self.heldout:
            return None
        return eagle3_heldout_acceptance(self.head, self.heldout, steps=self.config.eagle3.eval_steps, device=self.device)

    def describe(self) -> dict:
        disk, per_token = self.feature_bytes
        return {"kind": "eagle3", "draft_vocab": self.draft_vocab.size, "layers": self.layers,
                "stale_dropped": self.stale_dropped, "unroll_steps": self.module.steps, "feature_disk_bytes": disk,
                "feature_bytes_per_answer_token": per_token, "features": self.features,
                "features_reason": self.features_reason}

    def save(self, out_dir, target, meta: dict):
        """In the layout vLLM and SGLang load (modeling.eagle3_io)."""
        lineage = {"warm_start": self.lineage} if self.lineage else {}
        return eagle3_io.save_eagle3(self.head.eval(), target.tokenizer, out_dir,
                           {"target_fingerprint": target.fingerprint, "layers": self.layers, **lineage, **meta})
