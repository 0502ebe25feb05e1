"""Where state lives: `$SPECDISTILL_HOME` (default `.specdistill/` in the working directory).

Each location can be overridden on its own, so two state directories never interfere and tests
can share one model cache while keeping everything else in a temporary directory.
"""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("SPECDISTILL_HOME") or ".specdistill").resolve()


def model_cache_dir() -> Path:
    """Dequantized GGUF targets, cached as safetensors (shared across runs)."""
    override = os.environ.get("SPECDISTILL_MODEL_CACHE")
    return Path(override).resolve() if override else home() / "models"


def ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
