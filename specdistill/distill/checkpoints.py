"""Training checkpoints: everything an exact resume needs, written atomically.

A checkpoint directory holds the draft (safetensors), the AdamW state and the RNG state (loaded
with weights_only=True), the data position and counters (state.json) and the resolved config. It
is written under a temporary name (`step-N.tmp`) and renamed, so a kill never leaves half a
checkpoint: a temporary directory a write that died left behind is never read, and is removed by
the next run.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
from pathlib import Path

import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specdistill import paths
from specdistill.distill.distill_recipe import DistillConfig, save_config
from specdistill.modeling.eagle3_files import kind_name
from specdistill.recipe import load_yaml

CKPT_PREFIX = "step-"
_COMPLETE = re.compile(rf"{CKPT_PREFIX}(\d+)")  # step-0000042; step-0000042.tmp is a write in progress or one that died
_UNFINISHED = re.compile(rf"{CKPT_PREFIX}\d+\.tmp")


def checkpoint_dirs(out_dir: Path) -> list[Path]:
    """The complete checkpoints, oldest first: directories renamed into place whole, never a temporary one."""
    root = Path(out_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _COMPLETE.fullmatch(p.name)) and p.is_dir() and not p.is_symlink()
             and (p / "state.json").is_file()]
    return [p for _, p in sorted(found)]


class CheckpointWriteError(RuntimeError):
    """A checkpoint that could not be written (a full disk, a file-size limit); the last complete one stays."""


def _remove(path: Path, what: str) -> None:
    """Remove `path` whatever it is (a file, a directory, a link: unlinked, never followed), or say which
    path to delete."""
    try:
        paths.remove_entry(path)
    except OSError as exc:
        raise CheckpointWriteError(f"cannot remove {what} {path}: {paths.os_error_reason(exc)}; delete it yourself "
                                   "and run the same command again") from None


def remove_unfinished(out_dir: Path) -> list[Path]:
    """Remove what checkpoint writes that died (a kill, a full disk) left at their temporary names, whatever
    it is (a directory, a file, a link); what was removed."""
    root = Path(out_dir) / "checkpoints"
    gone = sorted(p for p in root.iterdir() if _UNFINISHED.fullmatch(p.name)) if root.is_dir() else []
    for path in gone:
        _remove(path, "the unfinished checkpoint")
    return gone


def save_checkpoint(out_dir: Path, step: int, module: torch.nn.Module, optimizer, order, extra: dict,
                    config: DistillConfig) -> Path:
    """Everything a resume needs, written into a temp dir and renamed: a kill never leaves half a checkpoint.
    A write that fails (a full disk) removes its temp dir and is a `CheckpointWriteError` that says why."""
    final = Path(out_dir) / "checkpoints" / f"{CKPT_PREFIX}{step:07d}"
    tmp = final.with_name(final.name + ".tmp")
    _remove(tmp, "the unfinished checkpoint")
    try:
        tmp.mkdir(parents=True)  # new, so nothing in it is a link we did not make
        state = {k: v.detach().contiguous().clone() for k, v in module.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"))  # cloned: tied weights no longer share storage
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save({"torch": torch.get_rng_state()}, tmp / "rng.pt")
        paths.atomic_write_json(tmp / "state.json", {"step": step, "data": order.state(), "python_rng": random.getstate(),
                                                     **extra}, mode=paths.PUBLIC_FILE_MODE, indent=None, default=str)
        save_config(config, tmp / "config.yaml")
    except (OSError, SafetensorError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        kept = checkpoint_dirs(out_dir)
        raise CheckpointWriteError(
            f"could not write checkpoint {final}: {paths.os_error_reason(exc)}; "
            + (f"the last complete checkpoint {kept[-1].name} is kept" if kept else "no earlier checkpoint was written")
            + ": free space (or raise the limit) and run the same command again to resume") from None
    _remove(final, "the checkpoint")  # one of the same step (a resume repeats it), or anything at its name
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


# what decides the draft's parameters (and so the optimizer's state): a resume must keep every one
SHAPE_KEYS = ("target", "kind", "layers", "draft", "draft_vocab", "freeze", "eagle3.layers")


def _setting(config: dict, key: str):
    for part in key.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return kind_name(config) if key == "kind" else config  # a checkpoint written before says `kind: layers`


def check_resumable(ckpt: Path, config: DistillConfig) -> None:
    """Refuse, before the target loads, to resume `ckpt` with settings that make another draft (its saved
    config differs in a `SHAPE_KEYS` setting): one sentence naming both values, not a state_dict error."""
    try:
        saved = load_yaml(paths.read_whole(ckpt / "config.yaml", "checkpoint config")) or {}
    except (OSError, ValueError, yaml.YAMLError):
        return  # no saved config to compare: the load below names a mismatch
    now = config.model_dump(mode="json")
    for key in SHAPE_KEYS:
        if _setting(saved, key) != _setting(now, key):
            raise CheckpointError(
                f"{ckpt}: this run's {key}={_setting(now, key)!r} makes another draft than the checkpoint's "
                f"{key}={_setting(saved, key)!r} in {ckpt.parent.parent}: resume with the same settings, or choose a "
                "new out_dir")


def load_checkpoint(ckpt: Path, module: torch.nn.Module, optimizer) -> dict:
    weights = ckpt / "model.safetensors"
    try:
        module.load_state_dict(load_file(str(weights)), strict=True)
    except (RuntimeError, SafetensorError, OSError) as exc:
        detail = " ".join(str(exc).split())  # load_state_dict's list of keys and shapes, on one line
        raise CheckpointError(f"{weights}: does not fit this run's draft ({detail[:400]}); resume with the settings "
                              f"that wrote it, or remove its checkpoint directory {ckpt}") from None
    try:
        optimizer.load_state_dict(load_tensors(ckpt / "optimizer.pt"))
    except ValueError as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{ckpt / 'optimizer.pt'}: does not fit this run's trainable parameters ({exc}); resume "
                              f"with the settings that wrote it, or remove its checkpoint directory {ckpt}") from None
    rng = load_tensors(ckpt / "rng.pt")
    torch.set_rng_state(rng["torch"])
    state = paths.read_json(ckpt / "state.json", "checkpoint state")
    version, internal, gauss = state["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    return state
