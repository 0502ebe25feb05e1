"""The TypedDicts the stages hand each other name exactly the keys the library's dataclasses produce."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from specdistill.data.ingest import IngestResult
from specdistill.ops.metrics import LiveSample
from specdistill.ops.monitor import AcceptanceSample, FallbackCandidate, FallbackDecision
from specdistill.ops.targets import TargetVersion
from specdistill.pipeline import outputs


def keys(typed_dict) -> set[str]:
    return set(typing.get_type_hints(typed_dict))


def fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("typed_dict, cls, extra", [
    (outputs.IngestSummary, IngestResult, set()),
    (outputs.TargetVersionDict, TargetVersion, set()),
    (outputs.ReplaySample, AcceptanceSample, set()),
    (outputs.LiveSampleDict, LiveSample, {"source", "proposed", "rounds"}),
    (outputs.FallbackCandidateDict, FallbackCandidate, set()),
    (outputs.FallbackChoice, FallbackDecision, set()),
])
def test_typed_dicts_mirror_the_dataclasses_they_carry(typed_dict, cls, extra):
    assert keys(typed_dict) == fields(cls) | extra


def test_window_and_warm_start_shapes():
    from specdistill.pipeline.nightly import Window

    assert keys(outputs.WindowDict) == fields(Window)
    assert keys(outputs.WarmStart) == keys(outputs.Champion) | {"transplanted", "vocab_report"}
    assert keys(outputs.MonitorOutcome) >= {"change", "decision", "sample", "fallback", "incremental"}
