"""Does bf16 autocast pay for training on this CPU? Measured once per CPU, not assumed from its flags.

On a 2-core native-bf16 CPU the nightly's head trained 1.43x the steps per minute under autocast (why it
became the default); on a 2-core Xeon with AVX-512 BF16 and no AMX, 600 steps of the demo's head took 4.69
minutes under autocast and 3.34 in fp32, at the same held-out acceptance (benchmarks/head_recipe.py). So
`optim.bf16: null` asks this probe: one training step of a head-sized network (fc over three feature
layers, an MLP, an 8k-token lm_head, 256 rows; forward, backward, AdamW) in fp32 and under autocast,
interleaved, median of the repeats; autocast when 5% faster. Cached per CPU, torch version and thread count,
with the conditions it was measured under (`hardware.MeasuredUnder`): measured again when other work on the
cores moved by `load_shift` cores, after `max_uses` reuses or `max_days` days (the nightly's `remeasure:`).
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from specdistill import paths
from specdistill.hardware import MeasuredUnder, cpu_info, others_busy

MIN_GAIN = 1.05  # autocast must be this much faster: a tie keeps fp32's exact numerics


@dataclass(frozen=True)
class AutocastProbe:
    autocast: bool
    fp32_ms: float  # median step time
    bf16_ms: float
    cpu: str
    torch: str
    threads: int

    @property
    def speedup(self) -> float:
        """fp32 step time over autocast step time: above 1, autocast is faster."""
        return self.fp32_ms / self.bf16_ms

    def summary(self) -> str:
        choice = "bf16 autocast" if self.autocast else "fp32"
        return (f"training in {choice}: a head-sized step took {self.fp32_ms:.1f} ms in fp32, {self.bf16_ms:.1f} ms "
                f"under bf16 autocast ({self.speedup:.2f}x) on {self.cpu}")


def _step_ms(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, autocast: bool) -> float:
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext():
        logits = model(x)
    logits.float().logsumexp(-1).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) * 1e3


def measure_autocast(hidden: int = 576, intermediate: int = 1536, vocab: int = 8192, rows: int = 256,
                     repeats: int = 3) -> AutocastProbe:
    """fp32 against bf16 autocast on one head-sized training step, interleaved; the faster by `MIN_GAIN` wins."""
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(3 * hidden, hidden, bias=False), nn.Linear(hidden, intermediate, bias=False),
                          nn.SiLU(), nn.Linear(intermediate, hidden, bias=False), nn.Linear(hidden, vocab, bias=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x = torch.randn(rows, 3 * hidden, generator=generator)
    times: dict[bool, list[float]] = {False: [], True: []}
    for on in (False, True):  # warm-up: oneDNN builds its kernels on the first call
        _step_ms(model, optimizer, x, on)
    for r in range(repeats):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            times[on].append(_step_ms(model, optimizer, x, on))
    fp32, bf16 = statistics.median(times[False]), statistics.median(times[True])
    return AutocastProbe(fp32 / bf16 >= MIN_GAIN, round(fp32, 2), round(bf16, 2), cpu_info().describe(),
                         torch.__version__, torch.get_num_threads())


def probe_autocast(cache: Path | None = None, *, load_shift: float = 0.75, max_uses: int = 7,
                   max_days: float = 7.0, busy: float | None = None) -> AutocastProbe:
    """`measure_autocast`, read from `cache/<key>.json` when this CPU, torch and thread count measured it before
    under the load found now (`busy`: other work's cores, None: read here), and not too many runs or days ago."""
    key = hashlib.sha256(f"{cpu_info().describe()}|{torch.__version__}|{torch.get_num_threads()}".encode()).hexdigest()[:16]
    path = None if cache is None else Path(cache) / f"{key}.json"
    busy = others_busy() if busy is None and path is not None else busy
    why = ""
    if path is not None and path.is_file():
        data = paths.read_json(path, "autocast measurement")
        under = MeasuredUnder.from_dict(data.pop("measured_under")) if data.get("measured_under") else None
        why = ("kept without the conditions it was measured under" if under is None else
               under.stale(busy, ["fp32", "bf16"], load_shift=load_shift, max_uses=max_uses, max_days=max_days))
        if not why:
            under.uses += 1
            paths.atomic_write_json(path, {**data, "measured_under": under.to_dict()})
            return AutocastProbe(**data)
    probe = measure_autocast()
    print(probe.summary() + (f" (measured again: {why})" if why else ""), file=sys.stderr)
    if path is not None:
        paths.atomic_write_json(path, {**asdict(probe), "measured_under": MeasuredUnder(busy, time.time(), ["fp32", "bf16"]).to_dict()})
    return probe
