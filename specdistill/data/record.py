"""One serializer for the library's dataclasses: a stage output is defined once (its dataclass), read by
attribute, and turned into JSON (benchmark.json, gate.json, reports, MLflow artifacts) and back by
these two functions, not by a hand-written mirror of its fields.

`to_dict` is `dataclasses.asdict` plus what a class adds to its JSON (`Record.extra`: derived numbers a
reader of the file wants, such as a bench result's first-position acceptance), or a class's own `to_dict`
(a drafter spec's is its text, which its `parse` reads back). `from_dict` rebuilds a
dataclass from that JSON by its type hints: nested dataclasses, lists and dicts of them, and dict keys
that JSON turned into strings (`dict[int, float]`); keys that are not fields (the derived ones) are
ignored, and a missing required field is an error that names the class and the field.

A field declared with `FLAT` (a record that holds another, such as a sample its draft counts) is written
as the held record's keys beside its own, as files written before it was held have them, and read back
from those keys.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")

FLAT = {"flat": True}  # `field(metadata=FLAT)`: the held record's keys are written beside the holder's own


def to_dict(obj: Any) -> Any:
    """A dataclass (and whatever it nests) as JSON-friendly values; anything else as it is."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        own = getattr(type(obj), "to_dict", None)
        if callable(own) and own is not Record.to_dict:
            return own(obj)
        out = {}
        for f in dataclasses.fields(obj):
            value = to_dict(getattr(obj, f.name))
            if f.metadata.get("flat"):
                out.update(value)
            else:
                out[f.name] = value
        extra = getattr(obj, "extra", None)
        return {**out, **extra()} if callable(extra) else out
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def from_dict(cls: type[T], data: Any) -> T:
    """`cls` (a dataclass) back from `to_dict(obj)` or its JSON."""
    if isinstance(data, cls):
        return data
    if isinstance(data, str) and callable(getattr(cls, "parse", None)):
        return cls.parse(data)  # a dataclass whose JSON is its text (`speculative.specs.DrafterSpec`)
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _convert(hints[f.name], data[f.name], f"{cls.__name__}.{f.name}")
        elif f.metadata.get("flat"):
            kwargs[f.name] = from_dict(hints[f.name], data)  # the held record's keys sit beside the holder's
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"{cls.__name__}: the record lacks the field {f.name!r} (it has {sorted(data)})")
    return cls(**kwargs)


def _convert(hint: Any, value: Any, where: str) -> Any:
    if value is None:
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) != 1:
            return value
        if value == {} and dataclasses.is_dataclass(options[0]) and type(None) in args:
            return None  # an optional record written as an empty object (older files) is absent
        return _convert(options[0], value, where)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    if origin is list and args:
        return [_convert(args[0], v, where) for v in value]
    if origin is dict and len(args) == 2:
        key = args[0] if args[0] in (int, float) else (lambda k: k)
        return {key(k): _convert(args[1], v, where) for k, v in value.items()}
    return value


class Record:
    """A dataclass's `to_dict()` / `from_dict()` by the functions above; `extra()` adds derived keys."""

    def extra(self) -> dict:
        return {}

    def to_dict(self) -> dict:
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict) -> typing.Self:
        return from_dict(cls, data)
