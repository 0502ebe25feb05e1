"""The layer-extracted draft kind in the trainer: the draft with its reduced head, its batches, its loss,
its held-out acceptance and how a trained one is saved. `train.distill` drives it as one task."""

from __future__ import annotations

import random
from collections import Counter

import torch

from specdistill.acceptance import DEFAULT_GAMMA, expected_tokens_per_round
from specdistill.distill import losses
from specdistill.distill.distill_recipe import DistillConfig
from specdistill.distill.examples import Batch, Example, collate
from specdistill.distill.teacher import OnlineTeacher, TeacherCache, drop_stale, to_draft_space
from specdistill.distill.trained import HeldoutAcceptance
from specdistill.modeling import models
from specdistill.modeling.drafts import init_draft_from_target, parse_layers, save_draft
from specdistill.modeling.eagle3_files import DRAFT_MODEL
from specdistill.modeling.vocab import DraftVocab, build_draft_vocab


class DraftWithHead(torch.nn.Module):
    """Draft body + LM head over the draft vocabulary, applied only at the positions that are trained."""

    def __init__(self, draft, draft_vocab: DraftVocab | None, target_width: int | None = None):
        super().__init__()
        self.draft = draft
        self.register_buffer("kept", draft_vocab.token_ids.clone() if draft_vocab is not None else torch.zeros(0, dtype=torch.long),
                             persistent=False)
        width = draft.config.hidden_size
        self.projection = losses.HiddenProjection(width, target_width or width)

    def forward(self, input_ids, attention, positions):
        hidden = self.draft.model(input_ids=input_ids, attention_mask=attention).last_hidden_state[positions]
        weight = self.draft.get_output_embeddings().weight
        if self.kept.numel():
            weight = weight.index_select(0, self.kept)
        return hidden @ weight.T, hidden


@torch.no_grad()
def heldout_acceptance(module: DraftWithHead, examples: list[Example], draft_vocab: DraftVocab | None,
                       batch_size: int = 8, gamma: int = DEFAULT_GAMMA, device: torch.device | str = "cpu") -> HeldoutAcceptance:
    """Greedy top-1 agreement with the target's own continuation, and τ(γ) under the i.i.d. model."""
    was_training = module.training
    module.eval()
    agree = total = 0
    for start in range(0, len(examples), batch_size):
        batch = collate(examples[start : start + batch_size]).to(device)
        logits, _ = module(batch.input_ids, batch.attention, batch.positions)
        guess = logits.argmax(-1)
        if draft_vocab is not None:
            guess = draft_vocab.to_target_ids(guess)
        agree += int((guess == batch.labels).sum())
        total += batch.labels.numel()
    module.train(was_training)
    alpha = agree / max(total, 1)
    return HeldoutAcceptance(alpha, expected_tokens_per_round(alpha, gamma), total)


def _build_draft_vocab(config: DistillConfig, examples: list[Example], tokenizer, target_vocab: int) -> DraftVocab | None:
    spec = config.draft_vocab
    if spec is None:
        return None
    if isinstance(spec, str):
        vocab = DraftVocab.load(spec)
        if vocab is None:
            raise ValueError(f"draft_vocab={spec!r}: no draft vocabulary file in that directory")
        return vocab
    counts: Counter = Counter()
    for ex in examples:  # the tokens the draft has to say: the assistant's
        counts.update(t for t, m in zip(ex.input_ids, ex.assistant_mask) if m)
    return build_draft_vocab(counts, spec, target_vocab, [tokenizer.eos_token_id])


def batch_loss(config: DistillConfig, logits, hidden, batch: Batch, *, teacher=None, cache_rows: dict | None = None,
               remap: bool = False, draft_vocab: DraftVocab | None = None, module: DraftWithHead | None = None,
               reference: DraftWithHead | None = None) -> torch.Tensor:
    """The training loss of one batch from the draft's `logits, hidden = module(...)`, against `teacher` (an
    OnlineTeacher) or `cache_rows` (`remap`: full-vocabulary rows for a reduced `draft_vocab`); `module`
    projects hidden states (loss.hidden_weight), `reference` is selective (AdaSpec) distillation's."""
    lc = config.loss
    labels = batch.labels
    label_mask = None
    if draft_vocab is not None:  # labels in draft ids; a label outside the kept tokens cannot be learned
        labels = draft_vocab.to_draft_ids(labels)
        label_mask = labels >= 0
        labels = labels.clamp_min(0)
    if lc.kind == "ce":
        return losses.cross_entropy(logits, labels, label_mask)

    target_hidden = None
    if cache_rows is not None:
        parts = [(cache_rows[ex_id], n) for ex_id, n in zip(batch.ids, batch.rows_per_example)]
        logprobs, indices, residual = (torch.cat([p[key][:n] for p, n in parts])
                                       for key in ("logprobs", "indices", "residual"))
        top = losses.TopKTeacher(logprobs, indices.long(), residual).truncated(lc.top_k)
        teacher_signal = (to_draft_space(top, draft_vocab) if remap else top).to(logits.device)
    else:
        teacher_logits, target_hidden = teacher(batch.input_ids, batch.attention, batch.positions)
        teacher_signal = (losses.topk_teacher_from_logits(teacher_logits, lc.top_k, lc.temperature)
                          if lc.top_k else teacher_logits)

    if lc.selective_keep is not None:
        with torch.no_grad():
            ref_logits, _ = reference(batch.input_ids, batch.attention, batch.positions)
        loss = losses.selective_distill_loss(logits, ref_logits, teacher_signal, torch.ones_like(labels, dtype=torch.bool),
                                             keep_fraction=lc.selective_keep, kind="fkl" if lc.kind == "mix" else lc.kind,
                                             temperature=lc.temperature, beta=lc.beta)
    elif lc.kind == "mix":
        loss = losses.mixed_loss(logits, teacher_signal, labels, None, alpha=lc.alpha, temperature=lc.temperature,
                                 label_mask=label_mask)
    else:
        loss = losses.distill_loss(logits, teacher_signal, None, kind=lc.kind, temperature=lc.temperature, beta=lc.beta)
    if lc.hidden_weight > 0:
        loss = loss + lc.hidden_weight * losses.hidden_cosine_loss(hidden, target_hidden, None, module.projection)
    return loss


class LayerTask:
    """The layer-extracted kind: a draft built from target layers (or warm-started), trained on its
    examples against the online or cached teacher; what `train.distill` needs of a draft kind."""

    def __init__(self, config: DistillConfig, target, examples: list[Example], replay: list[Example],
                 heldout: list[Example], device: torch.device):
        self.config, self.examples, self.replay, self.heldout, self.device = config, examples, replay, heldout, device
        self.stale_dropped = 0  # examples whose cached teacher rows were written for other token ids
        if config.draft:
            loaded = models.load_model(config.draft, dtype="float32")  # trained: fp32 master weights
            draft = loaded.model
            draft_vocab = DraftVocab.load(config.draft)
            if isinstance(config.draft_vocab, int) and draft_vocab is not None and draft_vocab.size != config.draft_vocab:
                raise ValueError(f"warm-start draft {config.draft} has a {draft_vocab.size}-token vocabulary, "
                                 f"config asks for {config.draft_vocab}")
            layers = loaded.config.to_dict().get("specdistill_layers")
        else:
            layers = parse_layers(config.layers, target.config.num_hidden_layers)
            draft = init_draft_from_target(target.model, layers)
            draft_vocab = _build_draft_vocab(config, examples, target.tokenizer, target.config.vocab_size)
        draft.train()
        self.draft, self.draft_vocab, self.layers = draft, draft_vocab, layers

        self.teacher = self.cache_rows = None
        self.remap = False
        if config.teacher.mode == "online":
            target.model.to(device)
            self.teacher = OnlineTeacher(target.model, draft_vocab, with_hidden=config.loss.hidden_weight > 0)
        elif config.teacher.mode == "cache":
            cache = TeacherCache.for_training(config.teacher.cache_dir, fingerprint=target.fingerprint,
                                              temperature=config.loss.temperature, draft_vocab=draft_vocab)
            self.cache_rows = cache.load_all()
            self.examples, stale = drop_stale(examples, self.cache_rows, config.teacher.cache_dir)
            self.replay, stale_replay = drop_stale(replay, self.cache_rows, config.teacher.cache_dir)
            self.stale_dropped = len(stale) + len(stale_replay)
            self.remap = cache.meta["vocab"] == "full" and draft_vocab is not None
        target_width = target.config.hidden_size  # read before a teacher-less run frees the target's model
        if config.teacher.mode == "none":
            target.model = None  # hard labels only: free the target, it is not needed during training

        self.reference = None
        if config.loss.selective_keep is not None:
            ref = models.load_model(config.loss.selective_reference, dtype="float32")  # scored beside the fp32 draft
            self.reference = DraftWithHead(ref.model, DraftVocab.load(config.loss.selective_reference) or draft_vocab).eval()
            self.reference.to(device)
        self.module = DraftWithHead(draft, draft_vocab, target_width).to(device)

    def micro_loss(self, model, indices: list[int], step: int, micro: int, autocast):
        """(loss, trained tokens, example ids) of one micro-batch; `model` is the module or its DDP wrapper."""
        config = self.config
        mine = [self.examples[i] for i in indices]
        if self.replay and config.data.replay_share > 0:  # seeded per step: a resumed run replays the same records
            g = random.Random(config.seed * 7919 + step * 131 + micro)
            mine = [self.replay[g.randrange(len(self.replay))] if g.random() < config.data.replay_share else ex
                    for ex in mine]
        batch = collate(mine).to(self.device)
        with autocast:
            logits, hidden = model(batch.input_ids, batch.attention, batch.positions)
        loss = batch_loss(config, logits, hidden, batch, teacher=self.teacher, cache_rows=self.cache_rows,
                          remap=self.remap, draft_vocab=self.draft_vocab,
                          module=self.module, reference=self.reference)
        return loss, int(batch.positions.sum()), batch.ids

    def evaluate(self) -> HeldoutAcceptance | None:
        return heldout_acceptance(self.module, self.heldout, self.draft_vocab, device=self.device) if self.heldout else None

    def describe(self) -> dict:
        return {"kind": DRAFT_MODEL, "draft_vocab": self.draft_vocab.size if self.draft_vocab is not None else None,
                "layers": self.layers, "stale_dropped": self.stale_dropped}

    def save(self, out_dir, target, meta: dict):
        self.draft.config.specdistill_layers = self.layers
        return save_draft(self.draft.eval(), target.tokenizer, out_dir, draft_vocab=self.draft_vocab,
                          meta={"target_fingerprint": target.fingerprint, "layers": self.layers, **meta})
