"""Training checkpoints: everything an exact resume needs, written atomically.

A checkpoint directory holds the draft (safetensors), the AdamW state and the RNG state (loaded
with weights_only=True), the data position and counters (state.json) and the resolved config. It
is written under a temporary name and renamed, so a kill never leaves half a checkpoint.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdistill import paths
from specdistill.distill.config import DistillConfig, save_config

CKPT_PREFIX = "step-"


def checkpoint_dirs(out_dir: Path) -> list[Path]:
    return sorted(p for p in (out_dir / "checkpoints").glob(f"{CKPT_PREFIX}*") if p.is_dir())


def save_checkpoint(out_dir: Path, step: int, module: torch.nn.Module, optimizer, order, extra: dict,
                    config: DistillConfig) -> Path:
    """Everything a resume needs, written into a temp dir and renamed: a kill never leaves half a checkpoint."""
    final = out_dir / "checkpoints" / f"{CKPT_PREFIX}{step:07d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.detach().contiguous().clone() for k, v in module.state_dict().items()}
    save_file(state, str(tmp / "model.safetensors"))  # cloned: tied weights no longer share storage
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save({"torch": torch.get_rng_state()}, tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, "data": order.state(), "python_rng": random.getstate(),
                                                **extra}, default=str))
    save_config(config, tmp / "config.yaml")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in checkpoint_dirs(out_dir)[: -config.keep_checkpoints]:
        shutil.rmtree(old, ignore_errors=True)
    return final


class CheckpointError(ValueError):
    """A checkpoint file that cannot be loaded safely; the message names the file."""


def load_tensors(path: Path) -> dict:
    """`torch.load(path, weights_only=True)`, with a refusal (a pickle holding more than tensors and
    plain containers) or a damaged file as one line naming the file, never a traceback."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        boilerplate = ("Weights only load failed", "Please file an issue", "Check the documentation")
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        detail = next((line for line in lines if not line.startswith(boilerplate)), "not a plain tensor file")
        raise CheckpointError(f"{path}: refused by torch.load(weights_only=True), which loads only tensors and "
                              f"plain containers ({detail}); remove its checkpoint directory {path.parent} to "
                              "resume from an earlier one") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: not a readable torch file ({first}); remove its checkpoint directory "
                              f"{path.parent} to resume from an earlier one") from None


def load_checkpoint(ckpt: Path, module: torch.nn.Module, optimizer) -> dict:
    module.load_state_dict(load_file(str(ckpt / "model.safetensors")), strict=True)
    optimizer.load_state_dict(load_tensors(ckpt / "optimizer.pt"))
    rng = load_tensors(ckpt / "rng.pt")
    torch.set_rng_state(rng["torch"])
    state = paths.read_json(ckpt / "state.json", "checkpoint state")
    version, internal, gauss = state["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    return state
