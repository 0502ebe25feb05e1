"""What this machine's CPU can do, asked in one place.

Every decision and every test that depends on a CPU feature asks these functions, so a test skips
for exactly the reason the library would not use the feature, and a report can name its CPU.
`SPECDISTILL_CPU_FLAGS` (space- or comma-separated) replaces the flags read from `/proc/cpuinfo`:
the library then decides as it would on that kind of CPU (the tests run the feature-gated tests as
an AVX2-only machine would).
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

# The flags that change what the library does or how fast it is: bf16 matmuls run at hardware speed
# with avx512_bf16 or amx_bf16; oneDNN's bf16 weight reorder needs avx512bw+vl+dq or avx_ne_convert.
FLAGS_THAT_MATTER = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_bf16",
                     "avx_ne_convert")
FLAGS_ENV = "SPECDISTILL_CPU_FLAGS"


@dataclass(frozen=True)
class CpuInfo:
    model: str
    flags: frozenset[str]
    cores: int
    emulated: bool = False  # flags taken from SPECDISTILL_CPU_FLAGS, not from the hardware

    @property
    def native_bf16(self) -> bool:
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags

    def describe(self) -> str:
        """One line for logs and reports: `AMD EPYC, 2 cores, avx2 avx512f avx512_bf16 (native bf16)`."""
        shown = " ".join(f for f in FLAGS_THAT_MATTER if f in self.flags) or "none of " + "/".join(FLAGS_THAT_MATTER[:3])
        kind = "native bf16" if self.native_bf16 else "no native bf16"
        source = ", flags from " + FLAGS_ENV if self.emulated else ""
        return f"{self.model}, {self.cores} cores, {shown} ({kind}{source})"

    def to_dict(self) -> dict:
        return {"model": self.model, "cores": self.cores, "native_bf16": self.native_bf16,
                "flags": [f for f in FLAGS_THAT_MATTER if f in self.flags], "emulated": self.emulated}


def _read_cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = "", frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model") and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return model or platform.processor() or platform.machine(), flags


def usable_cpus() -> list[int]:
    """The cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


@functools.cache
def _cpu_info(override: str | None) -> CpuInfo:
    model, flags = _read_cpuinfo()
    if override is not None:
        flags = frozenset(override.replace(",", " ").split())
    return CpuInfo(model or "unknown CPU", flags, os.cpu_count() or 1, emulated=override is not None)


def cpu_info() -> CpuInfo:
    return _cpu_info(os.environ.get(FLAGS_ENV))


def real_cpu() -> CpuInfo:
    """The CPU as the hardware reports it, whatever `SPECDISTILL_CPU_FLAGS` says (what a compiler targets)."""
    return _cpu_info(None)


def cpu_has_native_bf16() -> bool:
    return cpu_info().native_bf16


def describe_device(device: str | torch.device = "auto") -> str:
    """The machine the numbers came from, for reports and `serving.json`: the GPU's name for a CUDA
    device (`auto` with a GPU), else the CPU (`CpuInfo.describe`)."""
    name = str(device)
    if name.startswith("cuda") or (name == "auto" and torch.cuda.is_available()):
        index = torch.device(name).index if name.startswith("cuda") else None
        return f"GPU {torch.cuda.get_device_name(index)}, {torch.cuda.device_count()} GPUs, CUDA {torch.version.cuda}"
    return f"CPU {cpu_info().describe()}"


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (a GPU runs asynchronously): a timed step ends here."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":  # `python -m specdistill.hardware`: the first line of `make test`
    print(f"CPU: {cpu_info().describe()}")
