"""Cache keys from content: the state directory, the inputs' JSON, never object identity.

A rerun after a failure finds the finished stages' persisted results under the same key and
resumes; a different state directory, window, target or config gets a different key.
"""

from __future__ import annotations

import hashlib
import json

from specdistill import paths

NOT_CONTENT = ("deadline_at",)


def content_key(context, parameters: dict) -> str:
    def plain(value):  # what json cannot write: configs (pydantic) and stage outputs (dataclasses) by their content
        if hasattr(value, "model_dump"):
            return value.model_dump(mode="json")
        if hasattr(value, "to_dict"):
            return value.to_dict()
        return str(value)

    # a deadline decides how much of a stage runs, not what it computes from: a finished stage is reused;
    # the declared output type is part of the key, so a result persisted as another type is never handed back
    payload = {"task": context.task.name, "home": str(paths.home()),
               "returns": str(getattr(context.task.fn, "__annotations__", {}).get("return", "")),
               "inputs": {k: v for k, v in sorted(parameters.items()) if k not in NOT_CONTENT}}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=plain).encode()).hexdigest()
