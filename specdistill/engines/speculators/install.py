"""speculators (the vLLM team's EAGLE-3 / P-EAGLE / DFlash models, trainer and converters, on PyPI) in a
virtual environment of its own, cached outside the repository and reused, as vLLM's CPU build is
(`engines/vllm/install.py`). Its pins (`transformers<=5.19`) and the project's (`transformers>=5.0,<6`,
5.25 here) do not meet, so it never enters `.venv`; the project talks to it through subprocesses.

What the install does, each step for a reason found by hand:
- torch first (`torch==2.13.0`, the CPU build on this machine's disk), as for vLLM;
- speculators with `--no-deps`, then its declared runtime dependencies by name, with its own ranges, but
  not torchvision / torchaudio: speculators declares both, yet its models, configs and trainer import
  neither (checked: `import speculators.models.eagle3, speculators.train.trainer` without them), and
  PyPI's torchaudio pins another torch, so a plain install replaces the local CPU torch with a CUDA
  build (torch 2.14.1 and 2 GB of nvidia-* wheels);
- `torch==2.13.0` as a constraint on that second step, so nothing moves it.

Nothing is fetched at run time: the install is `make speculators` (and `make test`, before the tests
that need it).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from specdistill.engines.llamacpp.build import EngineBuildError, cache_root
from specdistill.engines.llamacpp.server import log_tail

SPECULATORS_VERSION = "0.9.0"
TORCH_REQUIREMENT = "torch==2.13.0"
# speculators 0.9.0's Requires-Dist, less torch (installed first) and torchvision / torchaudio (above)
RUNTIME_DEPENDENCIES = (
    "aiohttp", "click", "datasets>=4.0.0,<=5.1.0", "httpx", "huggingface-hub", "loguru>=0.7.2,<=0.7.3",
    "numpy>=2.0.0,<=2.5.4", "openai>=2.0.0", "protobuf", "psutil", "pydantic>=2.0.0", "pydantic-settings>=2.0.0",
    "rich", "safetensors", "tqdm>=4.66.3,<=4.70.1", "transformers>=5.0.0,<=5.19.0", "typer>=0.12.0",
    "hs-connectors==0.9.0",
)
STAMP = "INSTALLED"
CHECK = ("import importlib.metadata, speculators.models.eagle3, speculators.train.trainer; "
         "print(importlib.metadata.version(\"speculators\"))")


@dataclass(frozen=True)
class SpeculatorsEnv:
    """An installed speculators: the Python that has it."""

    python: Path
    version: str

    def run(self, *args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
        """A Python command in this environment, offline (nothing is downloaded at run time)."""
        offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                   "PYTHONPATH": "", "TORCH_COMPILE_DISABLE": "1"}
        return subprocess.run([str(self.python), *args], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **offline, **(env or {})})


def env_dir(version: str = SPECULATORS_VERSION) -> Path:
    """One environment per speculators version and Python (a venv is tied to its interpreter)."""
    return cache_root() / "speculators" / f"{version}-py{sys.version_info.major}{sys.version_info.minor}"


def cached(version: str = SPECULATORS_VERSION) -> SpeculatorsEnv | None:
    """The installed environment when the cache holds a complete one (the stamp is written last), else None."""
    root = env_dir(version)
    python = root / "bin" / "python"
    if (root / STAMP).is_file() and os.access(python, os.X_OK):
        return SpeculatorsEnv(python, version)
    return None


def _pip(python: Path, args: list[str], step: str, log: Path) -> None:
    cmd = [str(python), "-m", "pip", *args]
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise EngineBuildError(f"speculators install: {step} failed (exit {done.returncode}); full log: {log}\n"
                               f"{log_tail(log, 25)}")


def install_speculators(version: str = SPECULATORS_VERSION) -> SpeculatorsEnv:
    """The cached environment when present; else create it and install (a minute or two). Built in place
    under a lock and stamped last: a killed install leaves no stamp and is redone by the next call."""
    hit = cached(version)
    if hit:
        return hit
    root = env_dir(version)
    root.parent.mkdir(parents=True, exist_ok=True)
    log = root.parent / f"{root.name}.install.log"
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second `make speculators` waits for the first, then finds its stamp
        hit = cached(version)
        if hit:
            return hit
        shutil.rmtree(root, ignore_errors=True)
        log.unlink(missing_ok=True)
        t0 = time.monotonic()
        try:
            print(f"speculators: installing speculators=={version} into {root} (log {log})", file=sys.stderr, flush=True)
            done = subprocess.run([sys.executable, "-m", "venv", str(root)], capture_output=True, text=True)
            if done.returncode != 0:
                raise EngineBuildError(f"speculators install: cannot create a venv at {root}: {done.stderr.strip()[-500:]}")
            python = root / "bin" / "python"
            _pip(python, ["install", "-q", "--upgrade", "pip"], "pip upgrade", log)
            _pip(python, ["install", "-q", TORCH_REQUIREMENT], TORCH_REQUIREMENT, log)
            _pip(python, ["install", "-q", "--no-deps", f"speculators=={version}"], f"speculators=={version}", log)
            with tempfile.NamedTemporaryFile("w", suffix=".txt", dir=root.parent, delete=False) as pin:
                pin.write(TORCH_REQUIREMENT + "\n")
            try:
                _pip(python, ["install", "-q", "-c", pin.name, *RUNTIME_DEPENDENCIES], "speculators' dependencies", log)
            finally:
                os.unlink(pin.name)
            check = subprocess.run([str(python), "-c", CHECK], capture_output=True, text=True, timeout=300,
                                   env={**os.environ, "PYTHONPATH": ""})
            if check.returncode != 0:
                raise EngineBuildError(f"speculators install: its models do not import ({check.returncode}): "
                                       f"{(check.stdout + check.stderr).strip()[-800:]}")
            seconds = time.monotonic() - t0
            (root / STAMP).write_text(f"speculators=={version}\n{TORCH_REQUIREMENT}\nseconds={seconds:.0f}\n")
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)  # the log stays beside it for the user to read
            raise
    print(f"speculators: installed speculators=={version} in {seconds:.0f} s -> {root}", file=sys.stderr, flush=True)
    return cached(version)


def main() -> None:
    """`python -m specdistill.engines.speculators.install`: install (or find) speculators and print its Python."""
    try:
        env = install_speculators()
    except EngineBuildError as e:
        sys.exit(f"error: {e}")
    print(env.python)


if __name__ == "__main__":
    main()
