"""Prefect's cache keys (`tasks.common.content_key`) from the stage outputs' content: dataclasses hash by
their `to_dict()`, and a task whose declared output type changed never gets a result of the old type back."""

from __future__ import annotations

from types import SimpleNamespace

from specdistill.pipeline.outputs import GeneratedData
from tasks.common import content_key


def _context(name: str, returns: str):
    def fn():
        pass

    fn.__annotations__ = {"return": returns}
    return SimpleNamespace(task=SimpleNamespace(name=name, fn=fn))


def test_a_dataclass_input_keys_by_its_content():
    ctx = _context("distill", "Trained")
    a = content_key(ctx, {"train_data": GeneratedData("/a.jsonl", "/tc", 3, 30), "deadline_at": 1.0})
    assert a == content_key(ctx, {"train_data": GeneratedData("/a.jsonl", "/tc", 3, 30), "deadline_at": 2.0})  # not content
    assert a != content_key(ctx, {"train_data": GeneratedData("/b.jsonl", "/tc", 3, 30), "deadline_at": 1.0})
    as_json = {"path": "/a.jsonl", "teacher_cache": "/tc", "answers": 3, "tokens": 30, "answered_by": "",
               "engine_choice": None, "logged": None}
    assert a == content_key(ctx, {"train_data": as_json, "deadline_at": 1.0})  # the record and its JSON are the same content


def test_a_changed_output_type_changes_the_key():
    inputs = {"window": GeneratedData("/a.jsonl", None, 1, 1)}
    assert content_key(_context("benchmark", "dict[str, BenchEntry]"), inputs) != \
        content_key(_context("benchmark", "dict[str, BenchResult]"), inputs)
