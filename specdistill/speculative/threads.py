"""How many CPU threads decode fastest here, now: measured, not assumed.

A decode step of a small target is a chain of small matmuls, each ending at an OpenMP barrier. With
a thread per core and another job on one of the cores, every barrier waits for the thread that has
no core: measured on a 2-core AMD EPYC (bf16, the demo target, 32 new tokens), 2 threads decoded at
6 tokens/s with one busy core beside them and 1 thread at 20; with the machine quiet, 2 threads gave
26 and 1 thread 23. (OMP_WAIT_POLICY=PASSIVE cures the collapse but costs the quiet machine 45%: 14
against 26.) So the benchmark probes the thread counts worth trying, interleaved, and keeps the
fastest: on a quiet machine that is every core, on a shared one it is what the machine has free.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdistill.data.record import Record

if TYPE_CHECKING:
    import torch


@dataclass
class ThreadChoice(Record):
    threads: int
    tokens_per_second: dict[int, float] = field(default_factory=dict)  # per thread count probed (median)

    def describe(self) -> str:
        if len(self.tokens_per_second) < 2:
            return f"{self.threads} thread{'s' * (self.threads != 1)}"
        probe = ", ".join(f"{k}: {v:.1f}" for k, v in sorted(self.tokens_per_second.items()))
        return f"{self.threads} threads, the fastest of a probe (tokens/s by threads: {probe})"


def usable_cores() -> int:
    from specdistill.hardware import usable_cpus  # lazy: keeps torch off import

    return len(usable_cpus())


def thread_candidates(cores: int) -> list[int]:
    """One thread, half the cores, every core: the counts a shared machine's free cores fall near."""
    return sorted({1, max(1, cores // 2), cores})


def fastest_threads(model: torch.nn.Module, prompt_ids: Sequence[int], candidates: Sequence[int] | None = None, *,
                    new_tokens: int = 8, rounds: int = 3) -> ThreadChoice:
    """Decode `new_tokens` greedy tokens after `prompt_ids` at each thread count, `rounds` times in an
    order that rotates, and set torch's thread count to the fastest (median tokens/s). Off the CPU the
    threads only feed the device, so nothing is probed."""
    import torch

    from specdistill.speculative.engine import generate  # lazy: keeps torch off import

    if next(model.parameters()).device.type != "cpu":
        return ThreadChoice(torch.get_num_threads())
    candidates = list(dict.fromkeys(candidates or thread_candidates(usable_cores())))
    if len(candidates) == 1:
        torch.set_num_threads(candidates[0])
        return ThreadChoice(candidates[0])
    ids = list(prompt_ids)
    generate(model, ids, max_new_tokens=2, stop_token_ids=())  # first-call allocations outside the timing
    rates: dict[int, list[float]] = {k: [] for k in candidates}
    for r in range(rounds):
        for k in candidates[r % len(candidates):] + candidates[:r % len(candidates)]:
            torch.set_num_threads(k)
            start = time.perf_counter()
            generate(model, ids, max_new_tokens=new_tokens, stop_token_ids=())  # never cut short by a stop token
            rates[k].append(new_tokens / (time.perf_counter() - start))
    medians = {k: statistics.median(v) for k, v in rates.items()}
    best = max(medians, key=medians.get)
    torch.set_num_threads(best)
    return ThreadChoice(best, medians)
