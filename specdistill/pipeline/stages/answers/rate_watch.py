"""The rate the answers stage actually gets, watched while it runs: an engine chosen by a probe is dropped
for the rest of the stage when it falls well below what the other engine was measured at.

A probe is one measurement under the load of its minute. On a 2-core AVX2 EPYC beside one nice-10
neighbour, llama.cpp's probe read 37.9 answer tokens/s and the stage then got 14.5 (57 prompts in 5:45,
against 640 the quiet night before): its threads wait for each other once a core is taken. Nothing
watched that rate; this does, over a sliding window of `remeasure.window_s` seconds of finished answers
(batches in the harness, requests through an engine), and says when it stays under `remeasure.switch_below`
of the other engine's probe rate. The answers written so far stay (the answers file is append-only and
resumable: `answer_file`), the other engine answers the prompts left into the same file and teacher
cache, and `engine-switch.json` beside them says so: for the report, and for a resumed run or the
held-out answers, which start with the engine switched to.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specdistill import paths
from specdistill.data.record import Record

SWITCH_FILE = "engine-switch.json"  # beside the answers it concerns


@dataclass
class EngineSwitch(Record):
    """Which engine the stage dropped for which, after how many answers, and the rates that decided it."""

    switched_from: str  # "harness", "llamacpp"
    to: str
    after_answers: int  # answers in the file when it switched: the next prompt is the other engine's
    live_tokens_per_s: float  # what the dropped engine got over the window
    window_s: float
    other_probe_tokens_per_s: float  # what the engine switched to measured at its probe
    factor: float  # `remeasure.switch_below`
    at: float = 0.0  # seconds since the epoch

    def describe(self) -> str:
        return (f"**answer engine switched:** {self.switched_from} answered at {self.live_tokens_per_s:.1f} answer "
                f"tokens/s over {self.window_s:.0f} s, under {self.factor:g}x of {self.to}'s probe "
                f"({self.other_probe_tokens_per_s:.1f}); {self.to} answered from prompt {self.after_answers + 1} on, "
                f"the {self.after_answers} answers before kept")


def read_switch(directory: Path) -> EngineSwitch | None:
    path = Path(directory) / SWITCH_FILE
    return EngineSwitch.from_dict(paths.read_json(path, "answer engine switch")) if path.is_file() else None


def write_switch(directory: Path, switch: EngineSwitch) -> Path:
    return paths.atomic_write_json(Path(directory) / SWITCH_FILE, switch.to_dict())


class RateWatch:
    """Answer tokens/s over the last `window_s` seconds, from the stage's start, observed as answers finish.

    `observe(tokens)` after each batch or request returns True once a full window has passed and the
    rate over it (from the last observation at or before the window's start, or the stage's start, to
    now) is under `floor`: sustained, not one slow batch among fast ones."""

    def __init__(self, floor: float, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.floor, self.window_s, self.clock = floor, window_s, clock
        self.started = clock()
        self.seen: list[tuple[float, int]] = []  # (when, answer tokens) per finished batch or request
        self.rate: float | None = None  # over the last full window
        self.tripped = False

    def observe(self, tokens: int) -> bool:
        now = self.clock()
        self.seen.append((now, tokens))
        if now - self.started < self.window_s:
            return False
        cutoff = now - self.window_s
        start, total = self.started, 0
        for i in range(len(self.seen) - 1, -1, -1):
            when, n = self.seen[i]
            if when <= cutoff:
                start = when
                del self.seen[:i]  # older observations no window reads again
                break
            total += n
        self.rate = total / max(now - start, 1e-9)
        self.tripped = self.tripped or self.rate < self.floor
        return self.tripped
