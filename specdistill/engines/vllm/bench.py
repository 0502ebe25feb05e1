"""vLLM as the measuring engine: one `vllm serve` per mode (target-only and each speculative config,
all on loopback), the engine bench interleaved over them, and a target-only server for answers.

A mode is its vLLM `speculative_config` exactly as `serving.json` would carry it (built by the caller
from the serving config, so what was measured is what is deployed). A mode vLLM refuses to start is
not an exception for the whole bench: it is reported with vLLM's own error, and the other modes are
measured; a target-only server that does not start is an error (there is nothing to compare with).
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from specdistill.budget import Deadline
from specdistill.data.prompts import Prompt
from specdistill.data.results import BenchResult
from specdistill.engines.endpoint_bench import TARGET_ONLY, EngineBenchConfig, run_engine_bench
from specdistill.engines.vllm.install import VllmEnv, find_vllm, install_vllm
from specdistill.engines.vllm.server import VllmConfig, VllmServer, start_together


def target_dir(ref: str | os.PathLike) -> Path:
    """The target as vLLM serves it: an HF directory (`demo` and a `.gguf` become the safetensors cache)."""
    from specdistill.modeling.models import resolve_model_dir  # lazy: keeps transformers off import

    return resolve_model_dir(ref)


def served_dtype(dtype: str = "auto") -> str:
    """vLLM's `--dtype` for the project's dtype rule (`auto`: bf16 where the CPU has native bf16, fp32
    elsewhere), so vLLM runs the dtype the harness runs on the same machine."""
    from specdistill.modeling.models import dtype_name, resolve_dtype  # lazy: keeps transformers off import

    return dtype_name(resolve_dtype(dtype))


@dataclass
class VllmBench:
    """The results of the modes vLLM ran, and vLLM's error for each mode it refused."""

    results: dict[str, BenchResult]
    refused: dict[str, str] = field(default_factory=dict)
    startup_s: dict[str, float] = field(default_factory=dict)
    version: str = ""


def bench_vllm(target_ref: str | os.PathLike, modes: dict[str, dict], prompts: list[Prompt],
               config: EngineBenchConfig | None = None, *, threads: int = 2, dtype: str = "auto",
               env: VllmEnv | None = None, progress: bool = True, deadline: Deadline | None = None) -> VllmBench:
    """`modes` maps a name to its speculative config; target-only is started first."""
    if not modes:
        raise ValueError("bench needs a speculative mode: a speculative_config per mode")
    if any(not spec for spec in modes.values()):
        raise ValueError("every mode needs its speculative_config (target-only is started by the bench)")
    env = env or find_vllm() or install_vllm()
    model, vdtype = target_dir(target_ref), served_dtype(dtype)
    config = config or EngineBenchConfig()
    refused, startup = {}, {}
    with ExitStack() as stack:
        named = {name: VllmServer(VllmConfig(model=model, speculative_config=spec, threads=threads, dtype=vdtype,
                                             name=name), env)
                 for name, spec in {TARGET_ONLY: None, **modes}.items()}
        for server in named.values():
            stack.callback(server.stop)
        errors = start_together(list(named.values()))
        endpoints = {}
        for i, (name, server) in enumerate(named.items()):
            if i in errors:
                if name == TARGET_ONLY:
                    raise errors[i]
                refused[name] = errors[i].cause or str(errors[i]).splitlines()[0]
                continue
            endpoints[name] = server.url
            startup[name] = server.startup_s
        results = {}
        if len(endpoints) > 1:
            results = run_engine_bench(endpoints, prompts, config, engine="vllm", dtype=vdtype, threads=threads,
                                       progress=progress, deadline=deadline)
        for name, r in results.items():
            r.stats.update(vllm_speculative_config=modes[name], vllm_version=env.version,
                           startup_seconds=round(startup[name], 1))
    return VllmBench(results, refused, startup, env.version)


def target_server(target_ref: str | os.PathLike, *, parallel: int, ctx_per_slot: int, top_k: int, threads: int = 2,
                  dtype: str = "auto") -> VllmServer:
    """A target-only vLLM (not started yet: use it as a context manager) decoding `parallel` requests
    together, with top-`top_k` logprobs allowed: what answers the nightly's prompts when no URL is given."""
    return VllmServer(VllmConfig(model=target_dir(target_ref), threads=threads, dtype=served_dtype(dtype),
                                 max_num_seqs=parallel, max_model_len=max(ctx_per_slot, 256), max_logprobs=max(top_k, 1),
                                 name="target answers"), find_vllm() or install_vllm())
