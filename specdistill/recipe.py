"""What every recipe is read through. A recipe (deploy/: nightly, monitor, distill) is a YAML file plus dotted
`key=value` overrides, mapped onto its typed config (a pydantic model made of the bounded types below) and validated.

Unknown or mistyped keys fail at load time, naming the file and the key, before a model is loaded; so
do numbers that are not finite and counts out of their range (the bounded types below, `specdistill.bounds`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from specdistill import bounds, paths
from specdistill.env import expand_secrets


class Strict(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated, a number is finite
    (`lr: inf` or `nan` never reaches a run)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def count(high: int, low: int = 1) -> Any:
    """An integer config value in [low, high]: a count that sizes memory or work."""
    return Annotated[int, Field(ge=low, le=high)]


# the counts every config shares, each within its range in `specdistill.bounds`
Gamma = count(bounds.MAX_GAMMA)  # draft tokens per round
TreeWidth = count(bounds.MAX_TREE_WIDTH)
NewTokens = count(bounds.MAX_NEW_TOKENS)  # tokens generated per request
Steps = count(bounds.MAX_STEPS)
BatchSize = count(bounds.MAX_BATCH)
Prompts = count(bounds.MAX_PROMPTS)
Tokens = count(bounds.MAX_TOKENS)
Repeats = count(bounds.MAX_REPEATS)
TopK = count(bounds.MAX_TOP_K)
Layer = count(bounds.MAX_LAYERS, low=0)  # a layer index
LayerCount = count(bounds.MAX_LAYERS)  # a number of layers (an early exit after layer K)
Kept = count(bounds.MAX_CHECKPOINTS)  # checkpoints or versions kept
Seed = count(2**32 - 1, low=0)  # what every generator (torch, numpy, random) takes
Threads = Annotated[int, AfterValidator(bounds.check_threads)]  # 1 to 4 per CPU of this machine
Days = Annotated[float, Field(ge=0.0, le=bounds.MAX_DAYS)]  # a time span: a window of traffic
Minutes = Annotated[float, Field(ge=0.0, le=bounds.MAX_DAYS * 24 * 60)]  # a time budget
Seconds = Annotated[float, Field(gt=0.0, le=bounds.MAX_DAYS * 24 * 3600)]  # an interval


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file and key."""


MAX_YAML_VALUES = 100_000  # what a YAML document may expand to, each use of an alias counted in full


class YAMLTooLarge(yaml.YAMLError):
    """A YAML document whose aliases expand past `MAX_YAML_VALUES` values, recursive or nested too deeply."""


class _BoundedLoader(yaml.SafeLoader):
    """yaml's safe loader, refusing a document before it is constructed when its aliases would expand it past
    `MAX_YAML_VALUES` values: 9 levels of 9 aliases are a few hundred bytes, and 387 million values to the
    first walk over them (validation, `${...}` expansion), which ran for minutes and gigabytes."""

    def compose_document(self):
        node = super().compose_document()
        _expanded_size(node, {}, set())
        return node


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """How many values `node` stands for once every alias is copied out; each distinct node is visited once."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise YAMLTooLarge(f"line {node.start_mark.line + 1}: an anchor used inside itself (a recursive alias)")
    open_nodes.add(key)
    children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else (
        node.value if isinstance(node, yaml.SequenceNode) else [])
    size = 1 + sum(_expanded_size(child, sizes, open_nodes) for child in children)
    open_nodes.discard(key)
    if size > MAX_YAML_VALUES:
        raise YAMLTooLarge(f"line {node.start_mark.line + 1}: its aliases expand to more than {MAX_YAML_VALUES:,} "
                           "values (an alias bomb?)")
    sizes[key] = size
    return size


def load_yaml(text: str) -> Any:
    """The project's one YAML reader (configs, a checkpoint's saved config, an MLmodel file): yaml's safe
    loader with bounded alias expansion; raises `yaml.YAMLError` (`YAMLTooLarge` for what it refuses)."""
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 (a SafeLoader)
    except RecursionError:
        raise YAMLTooLarge("nested too deeply") from None


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply dotted `a.b=value` overrides to a nested dict (unknown keys are caught by validation)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value")
        key, value = item.split("=", 1)
        node = raw
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {key!r}: {part!r} is not a section")
            node = child
        try:  # a YAML scalar or list (3e-4, true, [0,1], null), else a plain string
            node[parts[-1]] = load_yaml(value)
        except yaml.YAMLError:
            node[parts[-1]] = value
    return raw


def _is_union_member(part: object) -> bool:
    """A `loc` part naming which member of a union an error is about (`constrained-int`, `str`,
    `function-after[...]`, `literal['auto']`), not a key."""
    return isinstance(part, str) and (any(c in part for c in "[]()-'") or part in _TYPE_TAGS)


_TYPE_TAGS = {"int", "str", "float", "bool", "none", "list", "dict", "tuple", "set", "bytes"}


def _expand_secrets(node, source: str, key: str = ""):
    """Every `${SPECDISTILL_SECRET_n}` (a credential the command line kept out of a flow's parameters,
    `env.stash_secrets`) replaced by its value from the environment."""
    if isinstance(node, dict):
        return {k: _expand_secrets(v, source, f"{key}.{k}" if key else str(k)) for k, v in node.items()}
    if isinstance(node, list):
        return [_expand_secrets(v, source, f"{key}[{i}]") for i, v in enumerate(node)]
    if isinstance(node, str):
        try:
            return expand_secrets(node)
        except KeyError as exc:
            raise ConfigError(f"{source}: {key}: ${{{exc.args[0]}}} is not set in the environment (a credential "
                              "the command line that started this run kept out of its parameters: run it from "
                              "the command line again)") from None
    return node


def _describe(exc: ValidationError, source: str) -> str:
    """One line per bad key. A union's members each refuse a value (`threads: 99999` is neither a count
    nor 'auto'): the key is named once, by the validator's own message or by the range it missed."""
    by_key: dict[str, list[dict]] = {}
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"] if not _is_union_member(p)) or "(top level)"
        by_key.setdefault(key, []).append(err)
    lines = []
    for key, errs in by_key.items():
        if any(e["type"] == "extra_forbidden" for e in errs):
            lines.append(f"{source}: unknown key '{key}'")
            continue
        own = [e for e in errs if e["type"] == "value_error"]  # a validator's own message, without pydantic's prefix
        bounded = [e for e in errs if e["type"] in ("less_than_equal", "greater_than_equal", "less_than", "greater_than",
                                                     "finite_number")]
        chosen = own or bounded or errs
        messages = [e["ctx"]["error"] if e["type"] == "value_error" else e["msg"] for e in chosen]
        got = errs[0].get("input")
        shown = f" (got {got!r})" if not own and isinstance(got, (int, float, str)) and len(repr(got)) < 40 else ""
        lines.append(f"{source}: {key}: {'; or '.join(dict.fromkeys(str(m) for m in messages))}{shown}")
    return "\n".join(lines)


def load_model_config(model: type[BaseModel], path: str | os.PathLike | None = None,
                      overrides: list[str] | None = None, what: str = "config"):
    """Read a YAML file into a typed config, apply `key=value` overrides, validate."""
    raw: dict = {}
    source = "<overrides>"
    if path is not None:
        source = str(path)
        if Path(path).is_dir():
            raise ConfigError(f"{what} {path} is a directory: give a YAML file")
        try:  # a regular file only (a FIFO is refused, never waited on), read whole up to a cap
            raw = load_yaml(paths.read_whole(path, f"{what} file").decode("utf-8")) or {}
        except paths.UnsafeFileError as exc:
            raise ConfigError(f"{exc}: give a YAML file") from None
        except FileNotFoundError:
            raise ConfigError(f"{what} file not found: {path}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not a text (UTF-8) YAML file: byte {exc.start} is {exc.object[exc.start]:#04x}") from None
        except OSError as exc:
            raise ConfigError(f"cannot read {what} file {path}: {exc.strerror or exc}") from None
        except YAMLTooLarge as exc:
            raise ConfigError(f"{path}: refused: {exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
    raw = _expand_secrets(apply_overrides(raw, overrides or []), source)
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source)) from None
