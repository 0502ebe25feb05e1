"""What this machine's CPU can do, asked in one place.

Every decision and every test that depends on a CPU feature asks these functions, so a test skips
for exactly the reason the library would not use the feature, and a report can name its CPU.
`SPECDISTILL_CPU_FLAGS` (space- or comma-separated) replaces the flags read from `/proc/cpuinfo`:
the library then decides as it would on that kind of CPU (the tests run the feature-gated tests as
an AVX2-only machine would).
"""

from __future__ import annotations

import functools
import math
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
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


class OtherLoad:
    """Cores' worth of CPU time other processes took on this process's cores between two reads: their
    busy time in /proc/stat less this process's own. None where /proc/stat cannot be read."""

    def __init__(self, cpus: Sequence[int] | None = None, stat: str | Path = "/proc/stat") -> None:
        self.cpus, self.stat = {f"cpu{c}" for c in (cpus if cpus is not None else usable_cpus())}, Path(stat)
        self._last = self._read()

    def _read(self) -> tuple[float, float, float] | None:
        try:
            lines = self.stat.read_text().splitlines()
        except OSError:
            return None
        busy = 0
        for line in lines:
            name, *values = line.split()
            if name in self.cpus and len(values) >= 8:
                user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in values[:8])
                busy += user + nice + system + irq + softirq + steal
        own = os.times()
        return time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), own.user + own.system

    def read(self) -> float | None:
        now, last = self._read(), self._last
        self._last = now
        if now is None or last is None or now[0] - last[0] <= 0:
            return None
        return max(0.0, ((now[1] - last[1]) - (now[2] - last[2])) / (now[0] - last[0]))


def others_busy(seconds: float = 1.0) -> float | None:
    """Cores' worth of other work on this process's cores now, read over `seconds` (`OtherLoad`): what a
    measurement taken now is taken beside."""
    load = OtherLoad()
    time.sleep(seconds)
    return load.read()


@dataclass
class MeasuredUnder:
    """The conditions a measured choice (the answer engine, autocast for training) was taken under, so a
    later run measures again when they no longer hold instead of trusting a number from another machine
    state: on a 2-core AVX2 EPYC a probe beside one nice-10 neighbour read the harness at 9.8 answer
    tokens/s against 88.6 quiet, chose llama.cpp, and every later night reused that choice."""

    others_busy: float | None  # cores of other work while it was measured (None: not read)
    at: float  # seconds since the epoch
    candidates: list[str] = field(default_factory=list)  # what was compared
    uses: int = 0  # runs that reused it since

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> MeasuredUnder:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    def stale(self, others_busy: float | None, candidates: Sequence[str], *, load_shift: float, max_uses: int,
              max_days: float, now: float | None = None) -> str | None:
        """Why it must be measured again (None: it still holds): other work came or went by `load_shift`
        cores, the candidates changed, it is older than `max_days` or was reused by `max_uses` runs."""
        now = time.time() if now is None else now
        if list(candidates) != list(self.candidates):
            return f"the candidates changed ({', '.join(self.candidates) or 'none'} then, {', '.join(candidates)} now)"
        if (others_busy is None) != (self.others_busy is None) or (
                others_busy is not None and abs(others_busy - self.others_busy) >= load_shift):
            return f"other work busy on {_cores(self.others_busy)} when measured, {_cores(others_busy)} now"
        days = (now - self.at) / 86400.0
        if days >= max_days or math.isnan(days):
            return f"measured {days:.1f} days ago (measured again after {max_days:g})"
        if self.uses >= max_uses:
            return f"reused by {self.uses} runs (measured again after {max_uses})"
        return None

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.at))
        return f"measured {when} beside {_cores(self.others_busy)} of other work, reused by {self.uses} runs since"


def _cores(busy: float | None) -> str:
    return "unread" if busy is None else f"{busy:.1f} cores"


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (a GPU runs asynchronously): a timed step ends here."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":  # `python -m specdistill.hardware`: the first line of `make test`
    print(f"CPU: {cpu_info().describe()}")
