"""The TypedDicts the stages hand each other name exactly the keys the library's dataclasses produce."""

from __future__ import annotations

import dataclasses
import typing

from specdistill.pipeline import outputs


def keys(typed_dict) -> set[str]:
    return set(typing.get_type_hints(typed_dict))


def fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_window_and_warm_start_shapes():
    from specdistill.pipeline.nightly import Window

    assert keys(outputs.WindowDict) == fields(Window)
    assert keys(outputs.WarmStart) == keys(outputs.Champion) | {"transplanted", "vocab_report"}
    assert keys(outputs.MonitorOutcome) >= {"change", "decision", "sample", "fallback", "incremental"}
