"""The benchmark's thread probe: measured on the model, kept fastest, restored never silently."""

from __future__ import annotations

import torch

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
