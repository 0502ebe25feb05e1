"""Distillation training loop, nanoGPT style: the math in plain sight, no framework in between.

AdamW, linear warmup then cosine decay, gradient accumulation, clipping, optional bf16 autocast, frozen
parameters by name (the target's embeddings and head, shared by the draft, by default). The draft kind
(`layer_task.LayerTask`, `eagle3_train.Eagle3Task`) supplies the module, the micro-batch loss, the
held-out acceptance and how the result is saved; loop, schedule, budgets and checkpoints are shared.

Checkpoints every `checkpoint_every` steps (draft, optimizer, RNG, data position): a killed run resumes
on the same loss curve. Every `eval_every` steps: held-out greedy agreement with the target's own
continuation and the τ at `acceptance.DEFAULT_GAMMA` it implies.

Runs unchanged under `torchrun --nproc_per_node N` (DDP: NCCL, one GPU per `LOCAL_RANK`; gloo on CPU):
each rank takes its slice of every global batch, so all ranks hold identical weights.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from specdistill import paths
from specdistill.budget import Deadline
from specdistill.distill.checkpoints import (
    check_resumable,
    checkpoint_dirs,
    load_checkpoint,
    remove_unfinished,
    save_checkpoint,
)
from specdistill.distill.distill_recipe import DistillConfig, save_config
from specdistill.distill.eagle3_train import Eagle3Task
from specdistill.distill.examples import DataOrder, read_examples
from specdistill.distill.layer_task import LayerTask
from specdistill.distill.trained import HeldoutAcceptance, Trained
from specdistill.modeling import models
from specdistill.modeling.eagle3_files import DRAFT_MODEL, EAGLE3
from specdistill.modeling.fingerprints import weights_digest
from specdistill.modeling.models import LoadedModel, check_device
from specdistill.state_lock import state_lock_for

TASKS = {DRAFT_MODEL: LayerTask, EAGLE3: Eagle3Task}  # the training task of each kind of draft (`DistillConfig.kind`)


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
    for name, p in model.named_parameters():
        p.requires_grad_(not any(pat in name for pat in patterns))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    if trainable == 0:
        raise ValueError(f"freeze patterns {patterns} freeze every parameter")
    return trainable, frozen


DISTILL_OUTPUT = "distill"  # the output kind of a training run's directory (paths.claim_output_dir)
DISTILL_FILES = ["config.yaml", "metrics.jsonl", "train_log.jsonl", "checkpoints", "draft", "result.json",
                 "features", "features-heldout"]  # what a run writes into its out_dir


def claim_out_dir(out_dir: str | os.PathLike) -> bool:
    """Check `out_dir` before any work and mark it this run's (True: a previous run's, which resumes).
    Refused: a directory holding anything but a previous training run, the state directory, the
    registry's stores, a file (`paths.check_output_dir`). A directory is a previous run only if our
    marker was there before: checkpoints without it (a user's, or a copy) are never taken as ours."""
    return paths.claim_output_dir(paths.check_output_location(out_dir), DISTILL_OUTPUT, DISTILL_FILES)


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


@dataclass
class Run:
    """What the training loop works with: the task (draft kind), its module (and DDP wrapper), the
    optimizer over its trainable parameters, and where this rank stands among the ranks."""

    config: DistillConfig
    task: LayerTask | Eagle3Task
    model: torch.nn.Module  # the task's module, or its DDP wrapper
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    device: torch.device
    rank: int
    world: int
    out_dir: Path
    evaluates: bool  # held-out examples were given (`data.heldout_path`): the curve is measured

    @property
    def module(self) -> torch.nn.Module:
        return self.task.module


@dataclass
class Progress:
    """Where training stands: what a checkpoint saves and a resume restores."""

    order: DataOrder
    step: int = 0
    tokens: int = 0
    seconds: float = 0.0  # training time so far, by `optim.clock`
    curve: list[dict] = field(default_factory=list)  # metrics.jsonl's points
    loss: float = float("nan")  # the last step's
    stop: str = "max_steps"  # why training ended: max_steps, max_tokens, max_minutes or deadline
    eval_seconds: float = 0.0  # the longest held-out evaluation so far (wall): what a deadline keeps for the last


def distill(config: DistillConfig, deadline: Deadline | None = None, between_steps: Callable[[], object] | None = None) -> Trained:
    """Train the draft `config` describes; `deadline` (a nightly stage's share, wall clock) bounds the
    whole run, loading and evaluations included: training stops early enough for the last evaluation.
    `between_steps` runs before each step (a thread count chosen again when the machine's load moved)."""
    device = pick_device(config.device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    if config.threads:
        torch.set_num_threads(config.threads)
    out_dir = Path(config.out_dir)
    existed = out_dir.exists()
    # rank 0 writes: into the state directory only while it holds it (the nightly's own run already does)
    with state_lock_for(out_dir, "distill") if rank == 0 else nullcontext():
        resumed = claim_out_dir(out_dir) if rank == 0 else True  # before the target loads: a refusal costs nothing
        if resumed and (ckpts := checkpoint_dirs(out_dir)):
            check_resumable(ckpts[-1], config)
        try:
            return _train(config, deadline, device, rank, world, out_dir, between_steps)
        except BaseException:
            if not resumed:  # a failed run claims nothing it did not write
                paths.release_output_dir(out_dir, remove=not existed)
            raise


def _train(config: DistillConfig, deadline: Deadline | None, device: torch.device, rank: int, world: int,
           out_dir: Path, between_steps: Callable[[], object] | None = None) -> Trained:
    if rank == 0:
        remove_unfinished(out_dir)  # a checkpoint write that died (a kill, a full disk) is never resumed from
    torch.manual_seed(config.seed)
    random.seed(config.seed)

    target, task, evaluates = load_task(config, device)
    trainable, frozen = apply_freeze(task.draft, config.frozen_patterns)
    run = make_run(config, task, device, rank, world, out_dir, evaluates)
    progress = resume(run)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, out_dir / "config.yaml")
    if progress.step == 0 and evaluates:
        evaluate(run, progress)
    train(run, progress, deadline or Deadline(), between_steps)
    if evaluates and (not progress.curve or progress.curve[-1]["step"] != progress.step):
        evaluate(run, progress)
    return finish(run, progress, target, trainable, frozen)


def load_task(config: DistillConfig, device: torch.device) -> tuple[LoadedModel, LayerTask | Eagle3Task, bool]:
    """The target, the draft kind's task over the training, replay and held-out examples, and whether
    there are held-out examples to evaluate on."""
    # fp32: the draft is made of the target's weights (or trained against them) with fp32 master weights,
    # bf16 is autocast (`optim.bf16`); the EAGLE-3 feature pass runs a copy in `eagle3.feature_dtype`
    target = models.load_model(config.target, dtype="float32", device=device)
    tok = target.tokenizer
    data = config.data
    examples = read_examples(data.path, data.kind, tok, data.max_len, data.limit)
    replay = read_examples(data.replay_path, data.replay_kind, tok, data.max_len) if data.replay_path else []
    heldout = (read_examples(data.heldout_path, "generated", tok, data.max_len, data.heldout_limit)
               if data.heldout_path else [])
    task = TASKS[config.kind]
    return target, task(config, target, examples, replay, heldout, device), bool(heldout)


def make_run(config: DistillConfig, task, device: torch.device, rank: int, world: int, out_dir: Path,
             evaluates: bool) -> Run:
    """The module (DDP-wrapped on several ranks) and AdamW over its trainable parameters, no decay on vectors."""
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
    return Run(config, task, model, params, optimizer, device, rank, world, out_dir, evaluates)


def resume(run: Run) -> Progress:
    """A fresh start, or the last checkpoint's state (weights, optimizer, RNG, data position, curve)."""
    order = DataOrder(len(run.task.examples), run.config.seed)  # the task drops examples with stale teacher rows
    ckpts = checkpoint_dirs(run.out_dir)
    if not ckpts:
        return Progress(order)
    state = load_checkpoint(ckpts[-1], run.module, run.optimizer)
    return Progress(DataOrder(len(run.task.examples), run.config.seed, **state["data"]), state["step"], state["tokens"],
                    state["train_seconds"], state.get("curve", []), loss=float(state.get("loss", math.nan)))


def evaluate(run: Run, progress: Progress) -> HeldoutAcceptance | None:
    """The held-out acceptance now, as a point of the curve (metrics.jsonl); None: the task kept no held-out example."""
    started = time.perf_counter()
    heldout = run.task.evaluate()
    progress.eval_seconds = max(progress.eval_seconds, time.perf_counter() - started)
    point = {"step": progress.step, "tokens": progress.tokens, "minutes": progress.seconds / 60,
             **(heldout.to_dict() if heldout else {})}
    progress.curve.append(point)
    if run.rank == 0:
        with paths.open_append(run.out_dir / "metrics.jsonl") as f:  # never through a link at its name
            f.write(json.dumps(point) + "\n")
    return heldout


def train(run: Run, progress: Progress, deadline: Deadline, between_steps: Callable[[], object] | None = None) -> None:
    """Steps until a budget (steps, tokens, minutes, the deadline) runs out: log each, evaluate and
    checkpoint on schedule."""
    config, opt = run.config, run.config.optim
    autocast = torch.autocast(run.device.type, dtype=torch.bfloat16) if opt.bf16 else nullcontext()
    clock = time.process_time if opt.clock == "cpu" else time.perf_counter
    bar = tqdm(total=opt.max_steps, initial=progress.step, desc="distill", unit="step", file=sys.stderr,
               disable=not config.progress or run.rank != 0)
    step_wall = 0.0  # the last step's wall time
    while progress.step < opt.max_steps:
        if opt.max_tokens is not None and progress.tokens >= opt.max_tokens:
            progress.stop = "max_tokens"
            break
        if opt.max_minutes is not None and progress.seconds >= 60 * opt.max_minutes:
            progress.stop = "max_minutes"
            break
        if out_of_time(run, deadline, step_wall + (progress.eval_seconds if run.evaluates else 0.0)):
            progress.stop = "deadline"
            break
        if between_steps is not None:
            between_steps()
        t0, wall0 = clock(), time.perf_counter()
        step_loss, step_tokens = train_step(run, progress, autocast)
        elapsed, step_wall = clock() - t0, time.perf_counter() - wall0
        progress.seconds += elapsed
        progress.loss = step_loss
        if run.rank == 0:
            with paths.open_append(run.out_dir / "train_log.jsonl") as f:
                f.write(json.dumps({"step": progress.step, "loss": step_loss, "lr": run.optimizer.param_groups[0]["lr"],
                                    "tokens": progress.tokens, "seconds": progress.seconds}) + "\n")
        bar.update(1)
        bar.set_postfix(loss=f"{step_loss:.4f}", tok_s=f"{step_tokens / max(elapsed, 1e-9):.0f}")
        if run.evaluates and progress.step % config.eval_every == 0:
            point = evaluate(run, progress)
            if point:
                bar.write(f"step {progress.step}: tokens {progress.tokens} acceptance {point.acceptance:.3f} tau {point.tau:.2f}")
        if progress.step % config.checkpoint_every == 0 and run.rank == 0:
            save_checkpoint(run.out_dir, progress.step, run.module, run.optimizer, progress.order,
                            {"tokens": progress.tokens, "train_seconds": progress.seconds, "curve": progress.curve,
                             "loss": step_loss}, config)
        if run.world > 1 and progress.step % config.checkpoint_every == 0:
            dist.barrier()
    bar.close()


def out_of_time(run: Run, deadline: Deadline, keep_seconds: float) -> bool:
    """Whether `deadline` leaves no more than `keep_seconds`; every rank takes rank 0's answer, so all stop together."""
    if deadline.at is None:
        return False
    late = deadline.remaining() <= keep_seconds
    if run.world == 1:
        return late
    flag = torch.tensor([int(late)], device=run.device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def train_step(run: Run, progress: Progress, autocast) -> tuple[float, int]:
    """One optimizer step over `grad_accum` micro-batches (this rank's slice of each global batch):
    (its loss, the tokens all ranks trained on). Advances the step and the token count."""
    opt, rank, world = run.config.optim, run.rank, run.world
    for g in run.optimizer.param_groups:
        g["lr"] = lr_at(progress.step, opt, progress.seconds)
    step_tokens = 0
    step_loss = 0.0
    for micro in range(opt.grad_accum):
        global_idx = progress.order.take(opt.batch_size * world)
        sync = nullcontext() if (world == 1 or micro == opt.grad_accum - 1) else run.model.no_sync()
        with sync:
            loss, tokens, ids = run.task.micro_loss(run.model, global_idx[rank::world], progress.step, micro, autocast)
            if not torch.isfinite(loss):
                raise NonFiniteLossError(
                    f"loss is {loss.item()} at step {progress.step} (micro-batch {micro}, examples {ids}); "
                    f"stopped, the last good checkpoint is kept in {run.out_dir / 'checkpoints'}")
            (loss / opt.grad_accum).backward()
        step_tokens += tokens
        step_loss += loss.item() / opt.grad_accum
    if opt.clip:
        torch.nn.utils.clip_grad_norm_(run.params, opt.clip)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    progress.step += 1
    if world > 1:
        counted = torch.tensor([step_tokens], dtype=torch.long, device=run.device)
        dist.all_reduce(counted)
        step_tokens = int(counted)
    progress.tokens += step_tokens
    return step_loss, step_tokens


def finish(run: Run, progress: Progress, target: LoadedModel, trainable: int, frozen: int) -> Trained:
    """The run's result: checked identical across ranks, and on rank 0 the draft saved with it and result.json."""
    result = Trained(progress.step, progress.tokens, progress.seconds / 60, progress.loss, progress.stop, trainable, frozen,
                     progress.curve, clock=run.config.optim.clock, **run.task.describe())
    if run.world > 1:  # every rank must end with the same weights; say so in the result, fail loudly if not
        digests = [None] * run.world
        dist.all_gather_object(digests, weights_digest(run.module))
        result = replace(result, rank_weight_digests=digests)
        if len(set(digests)) != 1:
            raise RuntimeError(f"DDP ranks ended with different weights: {digests}")
    if run.rank == 0:
        meta = {"config": run.config.model_dump(mode="json"), **result.result_json(curve=False)}
        result = replace(result, draft_dir=str(run.task.save(run.out_dir / "draft", target, meta)))
        paths.atomic_write_json(run.out_dir / "result.json", result.result_json(), mode=paths.PUBLIC_FILE_MODE, default=str)
    if run.world > 1:
        dist.barrier()
    return result
