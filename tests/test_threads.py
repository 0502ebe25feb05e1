"""The benchmark's thread probe: measured on the model, kept fastest, restored never silently."""

from __future__ import annotations

import pytest
import torch

from specdistill import hardware
from specdistill.speculative import threads as th


def test_the_probe_times_each_thread_count_and_keeps_the_fastest(tiny_llama, monkeypatch):
    before = torch.get_num_threads()
    try:
        seen = []
        real_set = torch.set_num_threads
        monkeypatch.setattr(torch, "set_num_threads", lambda k: (seen.append(k), real_set(k)))
        choice = th.fastest_threads(tiny_llama, [1, 2, 3, 4], candidates=[1, 2], new_tokens=3, rounds=2)
        assert set(choice.tokens_per_second) == {1, 2} and all(v > 0 for v in choice.tokens_per_second.values())
        assert choice.threads == max(choice.tokens_per_second, key=choice.tokens_per_second.get)
        assert seen[:4] == [1, 2, 2, 1]  # the order rotates from round to round
        assert seen[-1] == choice.threads and torch.get_num_threads() == choice.threads
        assert "the fastest of a probe (tokens/s by threads: 1: " in choice.describe()
        assert th.ThreadChoice.from_dict({"threads": 2, "tokens_per_second": {"1": 20.0, "2": 6.0}}).tokens_per_second == {1: 20.0, 2: 6.0}
    finally:
        torch.set_num_threads(before)


def test_one_candidate_is_set_without_probing_and_the_candidates_span_the_cores(tiny_llama):
    before = torch.get_num_threads()
    try:
        assert th.fastest_threads(tiny_llama, [1, 2], candidates=[1]) == th.ThreadChoice(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert th.thread_candidates(1) == [1] and th.thread_candidates(2) == [1, 2] and th.thread_candidates(16) == [1, 8, 16]
    assert th.usable_cores() >= 1


def _stat(path, busy: int, idle: int) -> None:
    """/proc/stat with cpu0 and cpu1 each `busy` jiffies busy (user) and `idle` idle; cpu2 always busy."""
    path.write_text("cpu  0 0 0 0 0 0 0 0 0 0\n" + "".join(f"cpu{c} {busy} 0 0 {idle} 0 0 0 0 0 0\n" for c in (0, 1))
                    + "cpu2 99999 0 0 0 0 0 0 0 0 0\nintr 1 2 3\n")


def test_other_load_is_the_busy_time_on_our_cores_less_our_own(tmp_path, monkeypatch):
    import os

    stat, hz = tmp_path / "stat", os.sysconf("SC_CLK_TCK")
    clock, own = [100.0], [5.0]
    monkeypatch.setattr(hardware.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(hardware.os, "times", lambda: os.times_result((own[0], 0.0, 0.0, 0.0, 0.0)))
    _stat(stat, 0, 0)
    load = hardware.OtherLoad([0, 1], stat)
    clock[0], own[0] = 110.0, 15.0  # 10 s: both cores busy (20 core-seconds), 10 of them ours
    _stat(stat, 10 * hz, 0)
    assert abs(load.read() - 1.0) < 1e-9
    clock[0] = 120.0  # the next 10 s: quiet
    _stat(stat, 10 * hz, 10 * hz)
    assert load.read() == 0.0
    assert hardware.OtherLoad([0], tmp_path / "missing").read() is None  # no /proc/stat: nothing read, nothing guessed


class _FakeLoad:
    def __init__(self, values):
        self.values = list(values)

    def read(self):
        return self.values.pop(0)


def test_the_watch_probes_again_only_when_other_work_came_or_went(tiny_llama, monkeypatch):
    before = torch.get_num_threads()
    probes = []
    monkeypatch.setattr(th, "fastest_threads", lambda model, ids, candidates=None: probes.append(1) or th.ThreadChoice(len(probes)))
    clock = [0.0]
    monkeypatch.setattr(th.time, "monotonic", lambda: clock[0])
    # reads: around the first probe (0.1 cores busy), then one per check, and around each probe
    load = _FakeLoad([None, 0.1, 0.3, 1.8, None, 1.9, 1.7])
    with th.ThreadWatch(tiny_llama, [1, 2, 3], every_s=20.0, load=load) as watch:
        assert watch.choices == [th.ThreadChoice(1, others_busy=0.1, seconds=watch.choices[0].seconds)]
        clock[0] = 5.0
        assert watch.check() is None and len(load.values) == 5  # too soon: the load is not even read
        clock[0] = 25.0
        assert watch.check() is None  # 0.3 cores: the load barely moved
        clock[0] = 50.0
        again = watch.check()  # 1.8 cores: other work came, probed again
        assert again.threads == 2 and again.others_busy == 1.9 and len(probes) == 2
        clock[0] = 75.0
        assert watch.check() is None  # 1.7 against 1.9: steady
        assert "probed again: 2 threads; other work busy on 1.9 cores" in watch.describe()
        torch.set_num_threads(1)
    assert torch.get_num_threads() == before  # put back


@pytest.mark.e2e
def test_the_thread_choice_beside_a_busy_neighbour_is_measured_beside_it(tiny_llama):
    """A real busy loop at nice 10 (bounded: killed on the way out, and by its own timeout) on every core we run on:
    the probe times each thread count beside it and records the neighbour (issue 60, item 3)."""
    import subprocess
    import sys
    import time

    cores = len(hardware.usable_cpus())
    loops = [subprocess.Popen(["nice", "-n", "10", sys.executable, "-c",
                               "import time\nend = time.time() + 60\nwhile time.time() < end: pass"]) for _ in range(cores)]
    try:
        time.sleep(0.5)
        with th.chosen_threads("auto", tiny_llama, [1, 2, 3, 4]) as watch:
            busy = watch.choices[0].others_busy
            # the neighbour, seen by the probe (nice 10 yields to the probe's own threads: read 0.49-0.68 of
            # 2 cores beside it; a quiet machine reads near 0)
            assert busy is not None and busy >= 0.1 * cores
            choice = watch.choices[0]
            assert set(choice.tokens_per_second) == set(th.thread_candidates(cores)) or cores == 1
            assert torch.get_num_threads() == choice.threads and "other work busy on" in watch.describe()
    finally:
        for p in loops:
            p.kill()
