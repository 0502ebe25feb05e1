"""distill.autocast: the measured choice between fp32 and bf16 autocast for training, cached per CPU."""

import json

import pytest

from specdistill.distill import autocast


def test_the_probe_times_both_ways_and_chooses_autocast_only_when_it_is_clearly_faster(monkeypatch):
    probe = autocast.measure_autocast(hidden=16, intermediate=32, vocab=64, rows=8, repeats=3)
    assert probe.fp32_ms > 0 and probe.bf16_ms > 0
    assert probe.autocast == (probe.speedup >= autocast.MIN_GAIN)
    assert ("bf16 autocast" if probe.autocast else "fp32") in probe.summary()


@pytest.mark.parametrize("fp32_ms,bf16_ms,want", [(10.0, 5.0, True), (10.0, 9.9, False), (10.0, 20.0, False)])
def test_a_tie_keeps_fp32(monkeypatch, fp32_ms, bf16_ms, want):
    times = iter([0.0] * 2 + [fp32_ms, bf16_ms, bf16_ms, fp32_ms, fp32_ms, bf16_ms])
    monkeypatch.setattr(autocast, "_step_ms", lambda model, opt, x, on: next(times))
    assert autocast.measure_autocast(hidden=4, intermediate=8, vocab=8, rows=2, repeats=3).autocast is want


def test_the_answer_is_measured_once_per_cpu_and_read_back(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(autocast, "measure_autocast",
                        lambda: calls.append(1) or autocast.AutocastProbe(False, 10.0, 12.0, "cpu", "torch", 2))
    monkeypatch.setattr(autocast, "others_busy", lambda *a: 0.0)  # a quiet machine, whatever the test machine runs
    first = autocast.probe_autocast(tmp_path)
    again = autocast.probe_autocast(tmp_path)
    assert first == again and len(calls) == 1
    (stored,) = tmp_path.glob("*.json")
    assert json.loads(stored.read_text())["autocast"] is False
    assert json.loads(stored.read_text())["measured_under"]["uses"] == 1
    autocast.probe_autocast(None)  # no cache: measured every time
    assert len(calls) == 2


def test_a_kept_answer_measured_under_other_load_is_measured_again(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(autocast, "measure_autocast",
                        lambda: calls.append(1) or autocast.AutocastProbe(False, 10.0, 12.0, "cpu", "torch", 2))
    autocast.probe_autocast(tmp_path, busy=0.0)
    autocast.probe_autocast(tmp_path, busy=0.5)  # within load_shift: read back
    assert len(calls) == 1
    autocast.probe_autocast(tmp_path, busy=1.0)  # a core of other work came: measured again
    assert len(calls) == 2
    (stored,) = tmp_path.glob("*.json")
    assert json.loads(stored.read_text())["measured_under"]["others_busy"] == 1.0
    stored.write_text(json.dumps({k: v for k, v in json.loads(stored.read_text()).items() if k != "measured_under"}))
    autocast.probe_autocast(tmp_path, busy=1.0)  # kept by a version that did not record its conditions
    assert len(calls) == 3
    for _ in range(2):
        autocast.probe_autocast(tmp_path, busy=1.0, max_uses=2)
    assert len(calls) == 3
    autocast.probe_autocast(tmp_path, busy=1.0, max_uses=2)  # reused twice: measured again
    assert len(calls) == 4
