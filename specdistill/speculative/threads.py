"""How many CPU threads decode fastest here, now: measured, not assumed.

A decode step of a small target is a chain of small matmuls, each ending at an OpenMP barrier. With
a thread per core and another job on one of the cores, every barrier waits for the thread that has
no core: measured on a 2-core AMD EPYC (bf16, the demo target, 32 new tokens), 2 threads decoded at
6 tokens/s with one busy core beside them and 1 thread at 20; with the machine quiet, 2 threads gave
26 and 1 thread 23. (OMP_WAIT_POLICY=PASSIVE cures the collapse but costs the quiet machine 45%: 14
against 26.) So the benchmark probes the thread counts worth trying, interleaved, and keeps the
fastest: on a quiet machine that is every core, on a shared one it is what the machine has free.

A measurement that runs for minutes beside other work (the monitor, beside a serving engine or a test
suite) sees the load change under it: `ThreadWatch` probes again when the CPU time other processes take
on this process's cores has moved by `LOAD_SHIFT` cores since its last probe (read from /proc/stat).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from specdistill.data.record import Record
from specdistill.hardware import OtherLoad, usable_cpus
from specdistill.speculative.decode import generate


@dataclass
class ThreadChoice(Record):
    threads: int
    tokens_per_second: dict[int, float] = field(default_factory=dict)  # per thread count probed (median)
    others_busy: float | None = None  # cores' worth of other processes' CPU time while it probed (None: not read)
    seconds: float = 0.0  # what the probe took

    def describe(self) -> str:
        others = "" if self.others_busy is None else f"; other work busy on {self.others_busy:.1f} cores"
        if len(self.tokens_per_second) < 2:
            return f"{self.threads} thread{'s' * (self.threads != 1)}{others}"
        probe = ", ".join(f"{k}: {v:.1f}" for k, v in sorted(self.tokens_per_second.items()))
        return f"{self.threads} thread{'s' * (self.threads != 1)}, the fastest of a probe (tokens/s by threads: {probe}{others})"


def usable_cores() -> int:
    return len(usable_cpus())


def thread_candidates(cores: int) -> list[int]:
    """One thread, half the cores, every core: the counts a shared machine's free cores fall near."""
    return sorted({1, max(1, cores // 2), cores})


def fastest_threads(model: torch.nn.Module, prompt_ids: Sequence[int], candidates: Sequence[int] | None = None, *,
                    new_tokens: int = 8, rounds: int = 3, run: Callable[[], int] | None = None) -> ThreadChoice:
    """Decode `new_tokens` greedy tokens after `prompt_ids` at each thread count, `rounds` times in an
    order that rotates, and set torch's thread count to the fastest (median tokens/s). `run` replaces that
    decode with the stage's own shape (it returns the tokens it produced: a batch of answers decodes other
    matmuls than one row). Off the CPU the threads only feed the device, so nothing is probed."""
    if next(model.parameters()).device.type != "cpu":
        return ThreadChoice(torch.get_num_threads())
    candidates = list(dict.fromkeys(candidates or thread_candidates(usable_cores())))
    if len(candidates) == 1:
        torch.set_num_threads(candidates[0])
        return ThreadChoice(candidates[0])
    ids = list(prompt_ids)
    if run is None:
        def run() -> int:
            generate(model, ids, max_new_tokens=new_tokens, stop_token_ids=())  # never cut short by a stop token
            return new_tokens
    run()  # first-call allocations outside the timing
    rates: dict[int, list[float]] = {k: [] for k in candidates}
    for r in range(rounds):
        for k in candidates[r % len(candidates):] + candidates[:r % len(candidates)]:
            torch.set_num_threads(k)
            start = time.perf_counter()
            tokens = run()
            rates[k].append(tokens / (time.perf_counter() - start))
    medians = {k: statistics.median(v) for k, v in rates.items()}
    best = max(medians, key=medians.get)
    torch.set_num_threads(best)
    return ThreadChoice(best, medians)


LOAD_SHIFT = 0.5  # cores of other work come or gone since the last probe: the fastest count may have changed


class ThreadWatch:
    """The thread count for the load found now, over a measurement of minutes: probed at `start`, and
    probed again at a `check` (between prompts) once other work has come or gone by `LOAD_SHIFT`
    cores, read no more often than every `every_s` seconds. `close` puts torch's count back."""

    def __init__(self, model: torch.nn.Module, prompt_ids: Sequence[int], *, candidates: Sequence[int] | None = None,
                 every_s: float = 20.0, load: OtherLoad | None = None, run: Callable[[], int] | None = None) -> None:
        self.model, self.prompt_ids, self.candidates, self.every_s = model, list(prompt_ids), candidates, every_s
        self.load, self.run = load, run
        self.choices: list[ThreadChoice] = []
        self._before: int | None = None
        self._checked = 0.0

    def start(self) -> ThreadChoice:
        self._before = torch.get_num_threads()
        self.load = self.load or OtherLoad()
        return self._probe()

    def _probe(self) -> ThreadChoice:
        self.load.read()
        started = time.perf_counter()
        choice = fastest_threads(self.model, self.prompt_ids, self.candidates, **({"run": self.run} if self.run else {}))
        choice.others_busy, choice.seconds = self.load.read(), time.perf_counter() - started
        self.choices.append(choice)
        self._checked = time.monotonic()
        return choice

    def check(self) -> ThreadChoice | None:
        """A new choice when the load moved since the last probe (None: no probe)."""
        if not self.choices or time.monotonic() - self._checked < self.every_s:
            return None
        self._checked = time.monotonic()
        now, then = self.load.read(), self.choices[-1].others_busy
        if now is None or then is None or abs(now - then) < LOAD_SHIFT:
            return None
        return self._probe()

    def close(self) -> None:
        if self._before is not None:
            torch.set_num_threads(self._before)

    def __enter__(self) -> ThreadWatch:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> str:
        if not self.choices:
            return "threads not probed"
        first, more = self.choices[0], self.choices[1:]
        again = "".join(f"; the load moved, probed again: {c.describe()}" for c in more)
        return first.describe() + again


@contextmanager
def chosen_threads(setting: int | str | None, model: torch.nn.Module, prompt_ids: Sequence[int] | None, *,
                   run: Callable[[], int] | None = None) -> Iterator[ThreadWatch | None]:
    """torch's thread count for a stage, put back after: `auto` probes it for the load found (a `ThreadWatch`,
    whose `check` the stage calls between its batches, prompts or steps), a number sets it, None leaves torch's."""
    before = torch.get_num_threads()
    if setting == "auto" and prompt_ids:
        with ThreadWatch(model, list(prompt_ids), run=run) as watch:
            yield watch
        return
    try:
        if isinstance(setting, int):
            torch.set_num_threads(setting)
        yield None
    finally:
        torch.set_num_threads(before)
