"""Distillation training loop, nanoGPT style: the math in plain sight, no framework in between.

AdamW, linear warmup then cosine decay, gradient accumulation, clipping, optional bf16 autocast,
frozen parameters by name (the draft shares the target's embeddings and head, which stay frozen by
default). Every `checkpoint_every` steps the draft, optimizer, RNG state and data position are
saved, so a killed run resumes on the same loss curve. Every `eval_every` steps the held-out
acceptance estimate is logged: greedy top-1 agreement with the target's own continuation, and the
expected accepted length τ at γ=4 that it implies.

Runs unchanged under `torchrun --nproc_per_node N` (DDP: NCCL with each rank on its own GPU,
`LOCAL_RANK`; gloo on CPU): each rank takes its slice of every global batch and gradients are
averaged, so all ranks hold identical weights.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from specdistill.acceptance import expected_tokens_per_round
from specdistill.distill import losses
from specdistill.distill.checkpoints import checkpoint_dirs, load_checkpoint, save_checkpoint
from specdistill.distill.config import DistillConfig, save_config
from specdistill.distill.datagen import Batch, DataOrder, Example, collate, read_examples
from specdistill.distill.teacher import OnlineTeacher, TeacherCache, check_entry, teacher_positions, to_draft_space, vocab_key
from specdistill.modeling.vocab import DraftVocab, build_draft_vocab


class NonFiniteLossError(RuntimeError):
    """Training hit a NaN/inf loss; the message names the step and batch. The last good checkpoint stays."""


# --------------------------------------------------------------------------------------------
# The draft with its (possibly reduced) head


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
                       batch_size: int = 8, gamma: int = 4, device: torch.device | str = "cpu") -> dict:
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
    return {"acceptance": alpha, "tau": expected_tokens_per_round(alpha, gamma), "eval_tokens": total}


def lr_at(step: int, cfg, train_seconds: float = 0.0) -> float:
    """Linear warmup, then cosine from lr to lr·min_lr_ratio, clocked by whichever budget runs out
    first: steps (step / max_steps) or time (train_seconds / max_minutes). A time-capped run then
    decays to its floor instead of stopping at peak learning rate."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    if cfg.max_minutes:
        progress = max(progress, train_seconds / (60 * cfg.max_minutes))
    progress = min(1.0, progress)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def apply_freeze(model: torch.nn.Module, patterns: list[str]) -> tuple[int, int]:
    """Freeze parameters whose name contains any pattern; returns (trainable, frozen) counts."""
    trainable = frozen = 0
    for name, p in model.named_parameters():
        keep_frozen = any(pat in name for pat in patterns)
        p.requires_grad_(not keep_frozen)
        if keep_frozen:
            frozen += p.numel()
        else:
            trainable += p.numel()
    if trainable == 0:
        raise ValueError(f"freeze patterns {patterns} freeze every parameter")
    return trainable, frozen


# --------------------------------------------------------------------------------------------
# The run


def pick_device(wanted: str) -> torch.device:
    """`auto`: this rank's GPU (LOCAL_RANK) when CUDA is there, else the CPU; `cuda` without a GPU is an error."""
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but torch sees no CUDA device (a CPU build, or no GPU on this node)")
    if wanted == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def _dist_info(device: torch.device) -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def _build_draft_vocab(config: DistillConfig, examples: list[Example], tokenizer, target_vocab: int) -> DraftVocab | None:
    spec = config.draft_vocab
    if spec is None:
        return None
    if isinstance(spec, str):
        vocab = DraftVocab.load(spec)
        if vocab is None:
            raise ValueError(f"draft_vocab={spec!r}: no draft vocabulary file in that directory")
        return vocab
    from collections import Counter

    counts: Counter = Counter()
    for ex in examples:  # the tokens the draft has to say: the assistant's
        counts.update(t for t, m in zip(ex.input_ids, ex.assistant_mask) if m)
    return build_draft_vocab(counts, spec, target_vocab, [tokenizer.eos_token_id])


def distill(config: DistillConfig) -> dict:
    """Train a draft as the config says; returns the final metrics and where the draft was written."""
    from specdistill.modeling.drafts import init_draft_from_target, parse_layers, save_draft
    from specdistill.modeling.models import load_model

    device = pick_device(config.device)
    rank, world = _dist_info(device)
    if config.threads:
        torch.set_num_threads(config.threads)
    out_dir = Path(config.out_dir)
    torch.manual_seed(config.seed)
    random.seed(config.seed)

    target = load_model(config.target)
    tok = target.tokenizer
    data = config.data
    examples = read_examples(data.path, data.kind, tok, data.max_len, data.limit)
    replay = read_examples(data.replay_path, data.replay_kind, tok, data.max_len) if data.replay_path else []
    heldout = (read_examples(data.heldout_path, "generated", tok, data.max_len, data.heldout_limit)
               if data.heldout_path else [])

    if config.draft:
        loaded = load_model(config.draft)
        draft = loaded.model
        draft_vocab = DraftVocab.load(config.draft)
        if isinstance(config.draft_vocab, int) and draft_vocab is not None and draft_vocab.size != config.draft_vocab:
            raise ValueError(f"warm-start draft {config.draft} has a {draft_vocab.size}-token vocabulary, "
                             f"config asks for {config.draft_vocab}")
        layers = loaded.config.to_dict().get("specdistill_layers")
    else:
        layers = parse_layers(config.layers, target.config.num_hidden_layers)
        draft = init_draft_from_target(target.model, layers)
        draft_vocab = _build_draft_vocab(config, examples, tok, target.config.vocab_size)
    draft.train()
    trainable, frozen = apply_freeze(draft, config.freeze)

    teacher = cache_rows = None
    if config.teacher.mode == "online":
        target.model.to(device)
        teacher = OnlineTeacher(target.model, draft_vocab, with_hidden=config.loss.hidden_weight > 0)
    elif config.teacher.mode == "cache":
        cache = TeacherCache.open(config.teacher.cache_dir, fingerprint=target.fingerprint)
        if cache.meta["temperature"] != config.loss.temperature:
            raise ValueError(f"teacher cache {config.teacher.cache_dir} holds temperature {cache.meta['temperature']}, "
                             f"loss.temperature is {config.loss.temperature}")
        if cache.meta["vocab"] not in ("full", vocab_key(draft_vocab)):
            raise ValueError(f"teacher cache {config.teacher.cache_dir} was written for vocabulary {cache.meta['vocab']}")
        cache_rows = cache.load_all()
        for ex in examples + replay:
            entry = cache_rows.get(ex.id)
            if entry is None:
                raise ValueError(f"teacher cache {config.teacher.cache_dir} has no entry for example {ex.id!r}")
            check_entry(entry, ex.id, ex.input_ids, len(teacher_positions(ex.assistant_mask)))
        remap = cache.meta["vocab"] == "full" and draft_vocab is not None
    target_width = target.config.hidden_size
    if config.teacher.mode == "none":
        target.model = None  # hard labels only: free the target, it is not needed during training

    reference = None
    if config.loss.selective_keep is not None:
        ref = load_model(config.loss.selective_reference)
        reference = DraftWithHead(ref.model, DraftVocab.load(config.loss.selective_reference) or draft_vocab).eval()
        reference.to(device)

    module = DraftWithHead(draft, draft_vocab, target_width).to(device)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        model = module
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = config.optim
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": opt.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=opt.lr, betas=opt.betas)

    order = DataOrder(len(examples), config.seed)
    step, trained_tokens, train_seconds, curve = 0, 0, 0.0, []
    ckpts = checkpoint_dirs(out_dir)
    if ckpts:  # resume
        state = load_checkpoint(ckpts[-1], module, optimizer)
        step, trained_tokens, train_seconds = state["step"], state["tokens"], state["train_seconds"]
        curve = state.get("curve", [])
        order = DataOrder(len(examples), config.seed, **state["data"])
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, out_dir / "config.yaml")

    def evaluate() -> dict:
        m = heldout_acceptance(module, heldout, draft_vocab, device=device) if heldout else {}
        point = {"step": step, "tokens": trained_tokens, "minutes": train_seconds / 60, **m}
        curve.append(point)
        if rank == 0:
            with open(out_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(point) + "\n")
        return point

    if step == 0 and heldout:
        evaluate()
    per_rank = opt.batch_size
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if opt.bf16 else nullcontext()
    bar = tqdm(total=opt.max_steps, initial=step, desc="distill", unit="step", file=sys.stderr,
               disable=not config.progress or rank != 0)
    last_loss = float("nan")
    stop_reason = "max_steps"
    while step < opt.max_steps:
        if opt.max_tokens is not None and trained_tokens >= opt.max_tokens:
            stop_reason = "max_tokens"
            break
        if opt.max_minutes is not None and train_seconds >= 60 * opt.max_minutes:
            stop_reason = "max_minutes"
            break
        t0 = time.perf_counter()
        for g in optimizer.param_groups:
            g["lr"] = lr_at(step, opt, train_seconds)
        step_tokens = 0
        step_loss = 0.0
        for micro in range(opt.grad_accum):
            global_idx = order.take(per_rank * world)
            mine = [examples[i] for i in global_idx[rank::world]]
            if replay and data.replay_share > 0:  # seeded per step: a resumed run replays the same records
                g = random.Random(config.seed * 7919 + step * 131 + micro)
                mine = [replay[g.randrange(len(replay))] if g.random() < data.replay_share else ex for ex in mine]
            batch = collate(mine).to(device)
            sync = nullcontext() if (world == 1 or micro == opt.grad_accum - 1) else model.no_sync()
            with sync:
                with autocast:
                    logits, hidden = model(batch.input_ids, batch.attention, batch.positions)
                loss = batch_loss(config, logits, hidden, batch, teacher=teacher, cache_rows=cache_rows,
                                  remap=remap if cache_rows else False, draft_vocab=draft_vocab, module=module, reference=reference)
                if not torch.isfinite(loss):
                    raise NonFiniteLossError(
                        f"loss is {loss.item()} at step {step} (micro-batch {micro}, examples {batch.ids}); "
                        f"stopped, the last good checkpoint is kept in {out_dir / 'checkpoints'}")
                (loss / opt.grad_accum).backward()
            step_tokens += int(batch.positions.sum())
            step_loss += loss.item() / opt.grad_accum
        if opt.clip:
            torch.nn.utils.clip_grad_norm_(params, opt.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if world > 1:
            counted = torch.tensor([step_tokens], dtype=torch.long, device=device)
            dist.all_reduce(counted)
            step_tokens = int(counted)
        trained_tokens += step_tokens
        elapsed = time.perf_counter() - t0
        train_seconds += elapsed
        last_loss = step_loss
        if rank == 0:
            with open(out_dir / "train_log.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": step_loss, "lr": optimizer.param_groups[0]["lr"],
                                    "tokens": trained_tokens}) + "\n")
        bar.update(1)
        bar.set_postfix(loss=f"{step_loss:.4f}", tok_s=f"{step_tokens / max(elapsed, 1e-9):.0f}")
        if heldout and step % config.eval_every == 0:
            point = evaluate()
            bar.write(f"step {step}: tokens {trained_tokens} acceptance {point['acceptance']:.3f} tau {point['tau']:.2f}")
        if step % config.checkpoint_every == 0 and rank == 0:
            save_checkpoint(out_dir, step, module, optimizer, order,
                            {"tokens": trained_tokens, "train_seconds": train_seconds, "curve": curve, "loss": step_loss},
                            config)
        if world > 1 and step % config.checkpoint_every == 0:
            dist.barrier()
    bar.close()
    if heldout and (not curve or curve[-1]["step"] != step):
        evaluate()

    result = {"steps": step, "tokens": trained_tokens, "train_minutes": train_seconds / 60, "loss": last_loss,
              "stop": stop_reason, "trainable_parameters": trainable, "frozen_parameters": frozen,
              "curve": curve, "draft_vocab": draft_vocab.size if draft_vocab is not None else None, "layers": layers}
    if world > 1:  # every rank must end with the same weights; say so in the result, fail loudly if not
        from specdistill.modeling.models import weights_digest

        digests = [None] * world
        dist.all_gather_object(digests, weights_digest(module))
        result["rank_weight_digests"] = digests
        if len(set(digests)) != 1:
            raise RuntimeError(f"DDP ranks ended with different weights: {digests}")
    if rank == 0:
        draft.config.specdistill_layers = layers
        result["draft_dir"] = str(save_draft(draft.eval(), tok, out_dir / "draft", draft_vocab=draft_vocab,
                                             meta={"target_fingerprint": target.fingerprint, "layers": layers,
                                                   "config": config.model_dump(mode="json"),
                                                   **{k: v for k, v in result.items() if k != "curve"}}))
        (out_dir / "result.json").write_text(json.dumps(result, indent=2, default=str))
    if world > 1:
        dist.barrier()
    return result


def batch_loss(config: DistillConfig, logits, hidden, batch: Batch, *, teacher=None, cache_rows: dict | None = None,
               remap: bool = False, draft_vocab: DraftVocab | None = None, module: DraftWithHead | None = None,
               reference: DraftWithHead | None = None) -> torch.Tensor:
    """The training loss of one batch, as `distill` computes it, from the draft's `logits, hidden = module(...)`.

    The teacher is either `teacher` (an OnlineTeacher) or `cache_rows` (TeacherCache.load_all(); `remap` when
    the cache holds full-vocabulary rows for a reduced `draft_vocab`); `module` supplies the hidden-state
    projection when loss.hidden_weight > 0, `reference` the reference model of selective (AdaSpec) distillation."""
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
        parts = [cache_rows[ex_id] for ex_id in batch.ids]
        top = losses.TopKTeacher(
            torch.cat([p["logprobs"][:n] for p, n in zip(parts, batch.rows_per_example)]),
            torch.cat([p["indices"][:n] for p, n in zip(parts, batch.rows_per_example)]).long(),
            torch.cat([p["residual"][:n] for p, n in zip(parts, batch.rows_per_example)]),
        )
        if lc.top_k and lc.top_k < top.logprobs.shape[-1]:  # a smaller k than cached: the rest joins the bucket
            dropped = top.logprobs[:, lc.top_k:].exp().sum(-1)
            top = losses.TopKTeacher(top.logprobs[:, : lc.top_k], top.indices[:, : lc.top_k], top.residual + dropped)
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
        ce = losses.cross_entropy(logits, labels, label_mask)
        kl = losses.distill_loss(logits, teacher_signal, None, kind="fkl", temperature=lc.temperature)
        loss = (1 - lc.alpha) * ce + lc.alpha * kl
    else:
        loss = losses.distill_loss(logits, teacher_signal, None, kind=lc.kind, temperature=lc.temperature, beta=lc.beta)
    if lc.hidden_weight > 0:
        loss = loss + lc.hidden_weight * losses.hidden_cosine_loss(hidden, target_hidden, None, module.projection)
    return loss
