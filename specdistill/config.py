"""One config loader for every config of the project (distill, nightly, monitor): YAML file plus
dotted `key=value` overrides, validated by a typed pydantic model.

Unknown or mistyped keys fail at load time, naming the file and the key, before a model is loaded.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from specdistill.env import expand_secrets


class Strict(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file and key."""


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
            node[parts[-1]] = yaml.safe_load(value)
        except yaml.YAMLError:
            node[parts[-1]] = value
    return raw


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
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            lines.append(f"{source}: unknown key '{key}'")
        elif err["type"] == "value_error":  # a validator's own message, without pydantic's prefix
            lines.append(f"{source}: {key}: {err['ctx']['error']}")
        else:
            lines.append(f"{source}: {key}: {err['msg']}")
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
        try:
            raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        except FileNotFoundError:
            raise ConfigError(f"{what} file not found: {path}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not a text (UTF-8) YAML file: byte {exc.start} is {exc.object[exc.start]:#04x}") from None
        except OSError as exc:
            raise ConfigError(f"cannot read {what} file {path}: {exc.strerror or exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
    raw = _expand_secrets(apply_overrides(raw, overrides or []), source)
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source)) from None
