"""The one serializer of stage outputs (`data.record`): dataclasses to JSON and back, whole, and the
files written from them keep the keys readers know."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specdistill.data.record import FLAT, Record, from_dict, to_dict
from specdistill.data.results import BenchResult, GammaSearch, SliceResult
from specdistill.ops.policy import Check, GateVerdict
from tests.conftest import bench_result


@dataclass
class Inner(Record):
    name: str
    by_gamma: dict[int, float] = field(default_factory=dict)


@dataclass
class Outer(Record):
    inners: list[Inner]
    named: dict[str, Inner]
    maybe: Inner | None = None

    def extra(self) -> dict:
        return {"count": len(self.inners)}


def test_nested_records_round_trip_through_json_with_integer_keys_and_derived_keys_ignored():
    obj = Outer([Inner("a", {1: 1.5, 4: 0.9})], {"x": Inner("x")}, maybe=Inner("m", {2: 2.0}))
    saved = json.loads(json.dumps(obj.to_dict()))
    assert saved["count"] == 1 and saved["inners"][0]["by_gamma"] == {"1": 1.5, "4": 0.9}  # JSON keys are strings
    assert Outer.from_dict(saved) == obj
    assert to_dict({"k": [obj]}) == {"k": [obj.to_dict()]}  # containers of records too


@dataclass
class Held(Record):
    n: int = 0
    per: list[int] = field(default_factory=list)


@dataclass
class Holder(Record):
    label: str
    held: Held = field(default_factory=Held, metadata=FLAT)


def test_a_flat_held_record_is_written_as_its_keys_beside_the_holders_and_read_back_from_them():
    obj = Holder("x", Held(3, [1, 2]))
    assert obj.to_dict() == {"label": "x", "n": 3, "per": [1, 2]}  # as files written before it was held
    assert Holder.from_dict(json.loads(json.dumps(obj.to_dict()))) == obj
    assert Holder.from_dict({"label": "y"}) == Holder("y")  # its keys absent: its defaults


def test_a_missing_field_is_named_and_an_empty_optional_record_is_absent():
    with pytest.raises(ValueError, match=r"Inner: the record lacks the field 'name'"):
        from_dict(Inner, {"by_gamma": {}})
    with pytest.raises(ValueError, match="Outer: expected a JSON object, got list"):
        from_dict(Outer, [])
    assert Outer.from_dict({"inners": [], "named": {}, "maybe": {}}).maybe is None  # older files wrote {} for none


@given(st.dictionaries(st.integers(1, 16), st.floats(0, 10, allow_nan=False)), st.one_of(st.none(), st.integers(1, 16)))
def test_gamma_search_survives_its_json(curve, best):
    search = GammaSearch(predicted_speedups=curve, predicted_best=best, verify_costs=dict(curve), measured={4: 1.0})
    assert GammaSearch.from_dict(json.loads(json.dumps(search.to_dict()))) == search


def test_benchmark_json_keeps_its_keys():
    """benchmark.json and engine_benchmark.json are read by tests and by users' tooling: the same keys as
    when they were written from a TypedDict mirror (the result's fields, its spec, and first-position acceptance)."""
    r = bench_result("ngram", 1.3, per_position_acceptance=[0.6, 0.4], slices=[SliceResult("chat", 2, 0.5, 2.0, 10.0, 13.0, 1.3)])
    assert set(r.to_dict()) == {
        "drafter", "gamma", "max_new_tokens", "repeats", "greedy", "lossless", "lossless_mismatches", "acceptance_rate",
        "accepted_length", "per_position_acceptance", "request_acceptance_p10", "request_acceptance_p50",
        "request_acceptance_p90", "tokens_per_second_target_only", "tokens_per_second_speculative", "speedup",
        "cost_ratio", "ideal_speedup", "slices", "stats", "threads", "dtype", "lossless_criterion", "lossless_exact",
        "lossless_near_ties", "lossless_max_margin", "lossless_tolerance", "engine", "gamma_search", "tree_width",
        "prompt_speedups", "budget_note", "spec", "first_position_acceptance"}
    assert r.to_dict()["first_position_acceptance"] == 0.6 and r.to_dict()["slices"][0]["name"] == "chat"
    assert BenchResult.from_dict(json.loads(json.dumps(r.to_dict()))) == r


def test_gate_json_keeps_its_keys():
    verdict = GateVerdict(False, [Check("lossless", False, False, True, "lossless: 1 outputs differ")])
    out = json.loads(json.dumps(verdict.to_dict()))
    assert set(out) == {"passed", "reasons", "failures", "checks", "beats_champion", "promote"}
    assert out["failures"] == ["lossless: 1 outputs differ"] and out["checks"][0]["name"] == "lossless"
    assert to_dict({"verdict": verdict}) == {"verdict": verdict.to_dict()}  # nested (a flow's result, --json): its own JSON
