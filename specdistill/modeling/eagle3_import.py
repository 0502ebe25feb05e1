"""`draft import` and `draft export`: a head trained elsewhere becomes the project's own head kind (checked
against the target it will draft for, with its lineage), and the project's head is written in either
of the field's formats (`eagle3_formats`).

An imported head is an ordinary `eagle3:DIR` head afterwards: benched, gated, registered, monitored,
warm-started from. Its meta says where it came from (`imported_from`, `source_sha256`, `source_format`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, LlamaConfig

from specdistill import paths
from specdistill.modeling.eagle3 import (
    Eagle3Draft,
    check_eagle3_target,
    check_fits,
    target_architecture,
)
from specdistill.modeling.eagle3_files import META_FILE, WEIGHTS_FILE, read_config
from specdistill.modeling.eagle3_formats import (
    EAGLE3_LAYOUT,
    FORMATS,
    ForeignHead,
    HeadFormatError,
    read_head,
    source_sha256,
    speculators_config,
    speculators_tensors,
    write_json,
)
from specdistill.modeling.eagle3_io import DTYPE_NAMES, head_tensors, load_eagle3, save_eagle3
from specdistill.modeling.models import LoadedModel
from specdistill.modeling.vocab import check_vocab

# a head's own copy of the target's embeddings, saved in its dtype, still counts as the target's
EMBED_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-7, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@dataclass
class ImportedHead:
    out: Path
    source_format: str
    source_sha256: str
    meta: dict


def check_against_target(head: ForeignHead, target: LoadedModel, where: str) -> None:
    """Architecture, widths, feature layers, vocabulary and the d2t/t2d maps against the target, before any
    weight is copied; each failure is one sentence naming what differs."""
    architecture = target_architecture(target.config) or type(target.model).__name__
    check_eagle3_target(architecture, where=target.path)
    trained_for = head.verifier.get("architectures") or []
    if trained_for and architecture not in trained_for:
        raise HeadFormatError(f"{where}: the head was trained for a {', '.join(trained_for)} verifier, the target "
                              f"{target.path} is a {architecture}")
    n = target.config.num_hidden_layers
    aux = head.config.eagle_config["eagle_aux_hidden_state_layer_ids"]
    if any(i == n for i in aux):
        raise HeadFormatError(f"{where}: the head reads target layer {n}, the target's final hidden state, which "
                              f"specdistill's head does not capture (it reads the inputs of layers 0..{n - 1})")
    check_fits(head.config.to_dict(), target.config, where=where)
    d2t, t2d = head.tensors["d2t"], head.tensors["t2d"]
    size, full = head.config.draft_vocab_size, target.config.vocab_size
    if d2t.shape != (size,) or t2d.shape != (full,):
        raise HeadFormatError(f"{where}: d2t of shape {tuple(d2t.shape)} and t2d of shape {tuple(t2d.shape)} do not "
                              f"fit a draft vocabulary of {size} over the target's {full}")
    ids = d2t + torch.arange(size)
    tokens = len(target.tokenizer)
    outside = ids[(ids < 0) | (ids >= tokens)]
    if outside.numel():
        raise HeadFormatError(f"{where}: d2t maps draft token {int((ids == outside[0]).nonzero()[0])} to target id "
                              f"{int(outside[0])}, outside the target tokenizer's {tokens} tokens")
    if ids.unique().numel() != size:
        raise HeadFormatError(f"{where}: d2t maps two draft tokens to one target token, so it is not a draft vocabulary")
    mapped = torch.zeros(full, dtype=torch.bool)
    mapped[ids] = True
    if not torch.equal(mapped, t2d):
        raise HeadFormatError(f"{where}: t2d marks {int(t2d.sum())} target tokens and disagrees with d2t's {size} "
                              "(they must name the same draft vocabulary)")
    if head.embed_tokens is not None:
        own = target.model.get_input_embeddings().weight.detach()
        embed = head.embed_tokens
        tol = EMBED_TOLERANCE.get(embed.dtype, 1e-2)
        if embed.shape != own.shape or not torch.allclose(embed.float(), own.float(), rtol=tol, atol=tol * float(own.abs().max())):
            raise HeadFormatError(f"{where}: the head's own token embeddings (embed_tokens.weight) differ from the "
                                  "target's, and specdistill's head drafts with the target's embeddings")


def _check_tokenizer(source: Path, target: LoadedModel) -> None:
    """A tokenizer saved beside the head must be the target's: its d2t ids mean target tokens."""
    if not any((source / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return
    report = check_vocab(target.tokenizer, AutoTokenizer.from_pretrained(source))
    if not report.identical:
        raise HeadFormatError(f"{source}: the tokenizer saved with the head differs from the target's "
                              f"({report.id_mismatches} ids differ, {report.only_in_target} tokens only in the "
                              f"target, {report.only_in_draft} only in the head's)")


def import_head(source: str | os.PathLike, target: LoadedModel, out: str | os.PathLike, *,
                force: bool = False) -> ImportedHead:
    """The head in `source` (speculators or EAGLE-3/SpecForge) checked against `target` and written as the
    project's head in `out`, with lineage; loaded back before it is returned, so what is written drafts."""
    source = Path(source)
    where = str(source)
    head = read_head(source, target.config.num_hidden_layers)
    check_against_target(head, target, where)
    _check_tokenizer(source, target)
    # a copy of the target's embeddings: the head is cast below, and the target must stay in its own dtype
    embed = torch.nn.Embedding.from_pretrained(target.model.get_input_embeddings().weight.detach().clone())
    draft = Eagle3Draft(head.config, embed)
    expected = {k: tuple(v.shape) for k, v in head_tensors(draft).items()}
    found = {k: tuple(v.shape) for k, v in head.tensors.items()}
    if expected != found:
        diff = sorted(set(expected.items()) ^ set(found.items()))[:4]
        raise HeadFormatError(f"{where}: the weights do not hold the tensors of a head with this config (name, shape): {diff}")
    dtype = next(iter(t for t in head.tensors.values() if t.is_floating_point())).dtype
    draft = draft.to(torch.float32)
    draft.load_state_dict({**{k: v.float() if v.is_floating_point() else v for k, v in head.tensors.items()},
                           "embed_tokens.weight": draft.embed_tokens.weight}, strict=True)
    draft.to(dtype)
    digest = source_sha256(source)
    # the draft positions it was trained for: specdistill's own meta when it came from here, else the
    # speculators proposal's `speculative_tokens` (its trainer writes its TTT steps there)
    steps = head.meta.get("unroll_steps") if head.meta else head.speculative_tokens
    meta = {**{k: v for k, v in head.meta.items() if k in ("unroll_steps", "trained_tokens", "imported_from",
                                                           "source_sha256", "source_format")},
            "imported_from": str(source.resolve()), "source_sha256": digest, "source_format": head.source_format,
            "target_fingerprint": target.fingerprint, "target": str(target.path)}
    if head.meta.get("imported_from"):  # a head exported by specdistill, then imported: the first source stays
        meta["imported_via"] = meta["imported_from"]
        meta["imported_from"] = head.meta["imported_from"]
    if steps:
        meta["unroll_steps"] = int(steps)
    paths.check_output_dir(Path(out), "draft", force=force)
    written = save_eagle3(draft, target.tokenizer, out, meta, force=force)
    load_eagle3(written, target.model)  # what was written loads on this target
    return ImportedHead(written, head.source_format, digest, meta)


def export_head(head_dir: str | os.PathLike, out: str | os.PathLike, *, format: str = EAGLE3_LAYOUT,
                target: str | None = None, force: bool = False) -> Path:
    """The project's head in `head_dir` written in `format` (speculators or the EAGLE-3 layout, today's).
    No target is loaded: the files are renamed and the config rewritten. `target` names the verifier in a
    speculators config (default: the target named in the head's meta)."""
    head_dir, out = Path(head_dir), Path(out)
    if format not in FORMATS:
        raise HeadFormatError(f"--format {format!r}: one of {', '.join(FORMATS)}")
    config = read_config(head_dir)
    if config is None or not (head_dir / WEIGHTS_FILE).is_file():
        raise HeadFormatError(f"{head_dir}: not a specdistill EAGLE-3 head (config.json and {WEIGHTS_FILE} expected)")
    tensors = load_file(str(head_dir / WEIGHTS_FILE))
    meta_path = head_dir / META_FILE
    meta = paths.read_json(meta_path, "draft meta") if meta_path.is_file() else {}
    tokenizer = AutoTokenizer.from_pretrained(head_dir)
    with paths.atomic_dir(out, "draft", force=force) as tmp:
        if format == EAGLE3_LAYOUT:
            write_json(tmp / "config.json", config)
            save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        else:
            llama = LlamaConfig.from_dict({k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")})
            verifier = target or meta.get("target")
            architectures = _verifier_architectures(verifier)
            dtype = DTYPE_NAMES.get(tensors["fc.weight"].dtype, "float32")
            steps = meta.get("unroll_steps") or 3  # speculators' own default (its converter writes 3)
            write_json(tmp / "config.json", speculators_config(llama, verifier=str(verifier) if verifier else None,
                                                               verifier_architectures=architectures,
                                                               speculative_tokens=steps, dtype=dtype))
            save_file(speculators_tensors(tensors, llama.vocab_size, llama.draft_vocab_size),
                      str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        write_json(tmp / META_FILE, {**meta, "exported_from": str(head_dir.resolve()), "export_format": format})
    return out


def _verifier_architectures(verifier: str | None) -> list[str]:
    config = read_config(verifier) if verifier and Path(verifier).is_dir() else None
    return list((config or {}).get("architectures") or [])
