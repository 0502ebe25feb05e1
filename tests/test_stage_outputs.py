"""The TypedDicts the stages hand each other name exactly the keys the library's dataclasses produce."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from specdistill.data.ingest import IngestResult
from specdistill.data.results import BenchResult, SliceResult
from specdistill.ops.metrics import LiveSample
from specdistill.ops.monitor import AcceptanceSample, FallbackCandidate, FallbackDecision
from specdistill.ops.policy import GateVerdict, evaluate
from specdistill.ops.registry import RegisteredDraft
from specdistill.ops.targets import TargetVersion
from specdistill.pipeline import outputs
from specdistill.pipeline.outputs import VerdictDict


def keys(typed_dict) -> set[str]:
    return set(typing.get_type_hints(typed_dict))


def fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("typed_dict, cls, extra", [
    (outputs.IngestSummary, IngestResult, set()),
    (outputs.SliceDict, SliceResult, set()),
    (outputs.BenchEntry, BenchResult, {"spec", "first_position_acceptance"}),
    (outputs.Registered, RegisteredDraft, set()),
    (outputs.TargetVersionDict, TargetVersion, set()),
    (outputs.ReplaySample, AcceptanceSample, set()),
    (outputs.LiveSampleDict, LiveSample, {"source", "proposed", "rounds"}),
    (outputs.FallbackCandidateDict, FallbackCandidate, set()),
    (outputs.FallbackChoice, FallbackDecision, set()),
])
def test_typed_dicts_mirror_the_dataclasses_they_carry(typed_dict, cls, extra):
    assert keys(typed_dict) == fields(cls) | extra


def test_the_verdict_dict_is_what_the_gate_returns():
    assert set(evaluate({"lossless": True, "acceptance_rate": 0.6, "accepted_length": 2.0, "speedup": 1.1}).to_dict()) == keys(VerdictDict)
    assert set(GateVerdict(True).to_dict()) == keys(VerdictDict)


def test_window_and_warm_start_shapes():
    from specdistill.pipeline.nightly import Window

    assert keys(outputs.WindowDict) == fields(Window)
    assert keys(outputs.WarmStart) == keys(outputs.Champion) | {"transplanted", "vocab_report"}
    assert keys(outputs.MonitorOutcome) >= {"change", "decision", "sample", "fallback", "incremental"}
