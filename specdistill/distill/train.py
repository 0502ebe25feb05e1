"""Distillation training loop, nanoGPT style: the math in plain sight, no framework in between.

AdamW, linear warmup then cosine decay, gradient accumulation, clipping, optional bf16 autocast,
frozen parameters by name (the draft shares the target's embeddings and head, which stay frozen by
default). The draft kind (`layer_task.LayerTask`: target layers + head; `eagle3_train.Eagle3Task`:
an EAGLE-3 head over the target's features) supplies the module, the micro-batch loss, the held-out
acceptance and how the result is saved; the loop, schedule, budget and checkpoints are shared.

Every `checkpoint_every` steps the draft, optimizer, RNG state and data position are
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

from specdistill import paths
from specdistill.distill.checkpoints import checkpoint_dirs, load_checkpoint, save_checkpoint
from specdistill.distill.config import DistillConfig, save_config
from specdistill.distill.eagle3_train import Eagle3Task
from specdistill.distill.examples import DataOrder, read_examples
from specdistill.distill.layer_task import DraftWithHead, LayerTask, batch_loss, heldout_acceptance
from specdistill.modeling.models import check_device

__all__ = ["DraftWithHead", "NonFiniteLossError", "batch_loss", "distill", "heldout_acceptance", "lr_at"]


class NonFiniteLossError(RuntimeError):
    """Training hit a NaN/inf loss; the message names the step and batch. The last good checkpoint stays."""


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

DISTILL_OUTPUT = "distill"  # the output kind of a training run's directory (paths.claim_output_dir)
DISTILL_FILES = ["config.yaml", "metrics.jsonl", "train_log.jsonl", "checkpoints", "draft", "result.json",
                 "features", "features-heldout"]  # what a run writes into its out_dir


def claim_out_dir(out_dir: str | os.PathLike) -> bool:
    """Check `out_dir` before any work and mark it this run's (True: a previous run's, which resumes).
    Refused: a directory holding anything but a previous training run, the state directory, the
    registry's stores, a file (`paths.check_output_dir`). A run an older version started (checkpoints
    with their state, no marker) is taken as ours, so it still resumes."""
    out = paths.check_output_location(out_dir)
    if paths.output_marker(out) is None and checkpoint_dirs(out) \
            and all((c / "state.json").is_file() for c in checkpoint_dirs(out)):
        paths.write_marker(out, DISTILL_OUTPUT, DISTILL_FILES)
    return paths.claim_output_dir(out, DISTILL_OUTPUT, DISTILL_FILES)



def pick_device(wanted: str) -> torch.device:
    """`auto`: this rank's GPU (LOCAL_RANK) when CUDA is there, else the CPU; `cuda:N`: that GPU; `cuda`
    without a GPU is an error (`modeling.models.check_device`)."""
    check_device(wanted)
    if wanted == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    index = wanted.partition(":")[2]
    device = torch.device("cuda", int(index) if index else int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def _dist_info(device: torch.device) -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def distill(config: DistillConfig) -> dict:
    """Train a draft as the config says; returns the final metrics and where the draft was written."""
    from specdistill.modeling.models import load_model

    device = pick_device(config.device)
    rank, world = _dist_info(device)
    if config.threads:
        torch.set_num_threads(config.threads)
    out_dir = Path(config.out_dir)
    if rank == 0:
        claim_out_dir(out_dir)  # before the target loads: a refused out_dir costs nothing
    torch.manual_seed(config.seed)
    random.seed(config.seed)

    # fp32: the draft is made of the target's weights (or trained against them) with fp32 master weights,
    # bf16 is autocast (`optim.bf16`); the EAGLE-3 feature pass runs a copy in `eagle3.feature_dtype`
    target = load_model(config.target, dtype="float32", device=device)
    tok = target.tokenizer
    data = config.data
    examples = read_examples(data.path, data.kind, tok, data.max_len, data.limit)
    replay = read_examples(data.replay_path, data.replay_kind, tok, data.max_len) if data.replay_path else []
    heldout = (read_examples(data.heldout_path, "generated", tok, data.max_len, data.heldout_limit)
               if data.heldout_path else [])
    kind = Eagle3Task if config.kind == "eagle3" else LayerTask
    task = kind(config, target, examples, replay, heldout, device)
    trainable, frozen = apply_freeze(task.draft, config.frozen_patterns)
    module = task.module
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        model = module
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = config.optim
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": opt.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=opt.lr, betas=opt.betas,
                                  fused=device.type in ("cpu", "cuda"))  # one kernel over all parameters, not ~10 passes

    order = DataOrder(len(task.examples), config.seed)  # the task drops examples with stale teacher rows
    step, trained_tokens, train_seconds, curve = 0, 0, 0.0, []
    ckpts = checkpoint_dirs(out_dir)
    if ckpts:  # resume
        state = load_checkpoint(ckpts[-1], module, optimizer)
        step, trained_tokens, train_seconds = state["step"], state["tokens"], state["train_seconds"]
        curve = state.get("curve", [])
        order = DataOrder(len(task.examples), config.seed, **state["data"])
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, out_dir / "config.yaml")

    def evaluate() -> dict:
        point = {"step": step, "tokens": trained_tokens, "minutes": train_seconds / 60, **task.evaluate()}
        curve.append(point)
        if rank == 0:
            with open(out_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(point) + "\n")
        return point

    if step == 0 and heldout:
        evaluate()
    per_rank = opt.batch_size
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if opt.bf16 else nullcontext()
    clock = time.process_time if opt.clock == "cpu" else time.perf_counter
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
        t0 = clock()
        for g in optimizer.param_groups:
            g["lr"] = lr_at(step, opt, train_seconds)
        step_tokens = 0
        step_loss = 0.0
        for micro in range(opt.grad_accum):
            global_idx = order.take(per_rank * world)
            sync = nullcontext() if (world == 1 or micro == opt.grad_accum - 1) else model.no_sync()
            with sync:
                loss, tokens, ids = task.micro_loss(model, global_idx[rank::world], step, micro, autocast)
                if not torch.isfinite(loss):
                    raise NonFiniteLossError(
                        f"loss is {loss.item()} at step {step} (micro-batch {micro}, examples {ids}); "
                        f"stopped, the last good checkpoint is kept in {out_dir / 'checkpoints'}")
                (loss / opt.grad_accum).backward()
            step_tokens += tokens
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
        elapsed = clock() - t0
        train_seconds += elapsed
        last_loss = step_loss
        if rank == 0:
            with open(out_dir / "train_log.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": step_loss, "lr": optimizer.param_groups[0]["lr"],
                                    "tokens": trained_tokens, "seconds": train_seconds}) + "\n")
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

    result = {"steps": step, "tokens": trained_tokens, "train_minutes": train_seconds / 60, "clock": opt.clock,
              "loss": last_loss, "stop": stop_reason, "trainable_parameters": trainable, "frozen_parameters": frozen,
              "curve": curve, **task.describe()}
    if world > 1:  # every rank must end with the same weights; say so in the result, fail loudly if not
        from specdistill.modeling.fingerprints import weights_digest

        digests = [None] * world
        dist.all_gather_object(digests, weights_digest(module))
        result["rank_weight_digests"] = digests
        if len(set(digests)) != 1:
            raise RuntimeError(f"DDP ranks ended with different weights: {digests}")
    if rank == 0:
        meta = {"config": config.model_dump(mode="json"), **{k: v for k, v in result.items() if k != "curve"}}
        result["draft_dir"] = str(task.save(out_dir / "draft", target, meta))
        (out_dir / "result.json").write_text(json.dumps(result, indent=2, default=str))
    if world > 1:
        dist.barrier()
    return result
