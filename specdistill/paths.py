"""Where state lives: `$SPECDISTILL_HOME` (default `.specdistill/` in the working directory).

Each location can be overridden on its own, so two state directories never interfere and tests
can share one model cache while keeping everything else in a temporary directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
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


@contextlib.contextmanager
def atomic_dir(out_dir: Path, *, replace: bool = True) -> Iterator[Path]:
    """Build a directory beside `out_dir`, then rename it into place: after a kill there is either
    the old directory or the complete new one, never half a checkpoint."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    tmp.chmod(0o755)
    try:
        yield tmp
        if out_dir.exists():
            if not replace:  # someone else finished first: theirs is as good as ours
                shutil.rmtree(tmp)
                return
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_json(path: Path, data) -> Path:
    """Replace a small JSON file so that readers see the old content or the new, never a mix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
