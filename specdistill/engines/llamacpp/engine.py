"""llama.cpp as the measuring engine: model references to GGUF files, one `llama-server` per mode
(target-only, a draft, an EAGLE-3 head, n-gram lookup), the engine bench over them, and the command
line to serve a mode.
"""

from __future__ import annotations

import hashlib
import os
from contextlib import ExitStack
from pathlib import Path

import gguf

from specdistill import paths
from specdistill.acceptance import DEFAULT_GAMMA, NGRAM_WINDOW
from specdistill.budget import Deadline
from specdistill.data.prompts import Prompt
from specdistill.data.results import BenchResult
from specdistill.engines.endpoint_bench import TARGET_ONLY, EngineBenchConfig, run_engine_bench
from specdistill.engines.llamacpp.build import LlamaCpp, build_llama_server
from specdistill.engines.llamacpp.gguf_export import export_gguf, gguf_spec_type
from specdistill.engines.llamacpp.server import LlamaServer, ServerConfig, ServerMode
from specdistill.modeling.models import DEMO_REF, demo_gguf_path

NGRAM_N = NGRAM_WINDOW[1]  # the harness's n-gram drafter's longest n; llama.cpp's ngram-simple defaults to 12


def target_gguf(ref: str | os.PathLike) -> Path:
    """The target as llama.cpp serves it: `demo` (its own Q4_1 GGUF) or a .gguf file."""
    if str(ref) == DEMO_REF:
        return demo_gguf_path()
    path = Path(ref)
    if path.suffix != ".gguf":
        raise ValueError(f"llama.cpp serves a target from a .gguf file (or 'demo'); got {ref}")
    if not path.is_file():
        raise FileNotFoundError(f"target GGUF not found: {path}")
    return path


def gguf_dtype(path: str | os.PathLike) -> str:
    """The GGUF's weight type as llama.cpp names it (Q4_1, F16, ...), for reports."""
    field = gguf.GGUFReader(str(path)).fields.get("general.file_type")
    if field is None:
        return "unknown"
    name = gguf.LlamaFileType(int(field.contents())).name
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def draft_gguf(draft: str | os.PathLike, target: Path) -> Path:
    """A draft as a GGUF: a .gguf as it is; a directory (a layer-extracted draft or an EAGLE-3 head)
    exported once (cached by the draft's weights and the target's metadata) under the state directory."""
    draft = Path(draft)
    if draft.suffix == ".gguf":
        if not draft.is_file():
            raise FileNotFoundError(f"draft GGUF not found: {draft}")
        return draft
    weights = sorted(draft.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(f"{draft}: no safetensors weights to export")
    key = hashlib.sha256()
    for f in [*weights, target]:
        st = f.stat()
        key.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    out = paths.home() / "engines" / "gguf" / f"{draft.name}-{key.hexdigest()[:16]}.gguf"
    if not out.is_file():
        export_gguf(draft, target, out)
    return out


def draft_mode(draft: str | os.PathLike, target: Path, k: int = DEFAULT_GAMMA) -> ServerMode:
    """llama-server speculating with a draft (a directory or a GGUF)."""
    gguf = draft_gguf(draft, target)
    return ServerMode(gguf_spec_type(gguf), gguf, k)


def ngram_mode(max_n: int = NGRAM_N, k: int = DEFAULT_GAMMA) -> ServerMode:
    """llama-server's `ngram-simple` prompt lookup of up to `max_n`-grams (the harness's drafter's longest)."""
    return ServerMode("ngram-simple", None, k, ngram_n=max_n)


def bench_llamacpp(target_ref: str | os.PathLike, modes: dict[str, ServerMode], prompts: list[Prompt],
                   config: EngineBenchConfig | None = None, *, threads: int = 2,
                   deadline: Deadline | None = None) -> dict[str, BenchResult]:
    """Start llama-server once per mode (target-only first, all on loopback; idle servers cost no CPU),
    interleave the modes per prompt, stop them. Results are keyed as `modes` is."""
    if not modes:
        raise ValueError("bench needs a speculative mode: a draft or n-gram lookup")
    engine = build_llama_server()
    target = target_gguf(target_ref)
    config = config or EngineBenchConfig()
    with ExitStack() as stack:
        endpoints = {}
        for name, mode in {TARGET_ONLY: ServerMode(), **modes}.items():
            server = stack.enter_context(LlamaServer(engine.server, ServerConfig(model=target, mode=mode, threads=threads)))
            endpoints[name] = server.url
        return run_engine_bench(endpoints, prompts, config, engine="llamacpp", dtype=gguf_dtype(target),
                                threads=threads, deadline=deadline)


def target_server(target_ref: str | os.PathLike, *, parallel: int, ctx_per_slot: int, threads: int = 2,
                  engine: LlamaCpp | None = None, poll: int | None = None) -> LlamaServer:
    """llama-server (not started yet: use it as a context manager) on the target's GGUF with `parallel`
    slots of `ctx_per_slot` tokens each (a prompt and its answer), decoded together as one batch: the
    engine that answers the nightly's prompts when no server URL is given."""
    engine = engine or build_llama_server()
    config = ServerConfig(model=target_gguf(target_ref), threads=threads, parallel=parallel,
                          ctx_size=parallel * ctx_per_slot, poll=poll)
    return LlamaServer(engine.server, config)
