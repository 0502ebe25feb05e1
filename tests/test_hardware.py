"""The CPU predicate every CPU-dependent decision and test asks (`specdistill.hardware`)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from specdistill import hardware
from specdistill.modeling.models import resolve_dtype
from specdistill.modeling.packed import packing_available
from tests.conftest import REPO


@pytest.mark.parametrize("flags, native", [("avx2 fma", False), ("avx2,avx512f,avx512bw,avx512vl,avx512dq", False),
                                           ("avx2 avx512f avx512_bf16", True), ("avx2 amx_bf16 amx_tile", True)])
def test_the_flags_decide_bf16_and_packing(monkeypatch, flags, native):
    monkeypatch.setenv(hardware.FLAGS_ENV, flags)
    cpu = hardware.cpu_info()
    assert cpu.emulated and cpu.native_bf16 is native and hardware.cpu_has_native_bf16() is native
    assert packing_available() == (native and torch.backends.mkldnn.is_available())
    assert resolve_dtype("auto") == (torch.bfloat16 if native or torch.cuda.is_available() else torch.float32)
    described = cpu.describe()
    assert f"{cpu.cores} cores" in described and ("native bf16" in described) and hardware.FLAGS_ENV in described
    assert cpu.to_dict()["native_bf16"] is native and set(cpu.to_dict()["flags"]) <= set(flags.replace(",", " ").split())


def test_the_real_cpu_ignores_the_override(monkeypatch):
    monkeypatch.setenv(hardware.FLAGS_ENV, "avx2")
    assert not hardware.real_cpu().emulated
    assert hardware.real_cpu().model == hardware.cpu_info().model


def test_make_test_names_the_cpu_first():
    out = subprocess.run([sys.executable, "-m", "specdistill.hardware"], capture_output=True, text=True, check=True).stdout
    assert out.startswith("CPU: ") and "cores" in out and "bf16" in out
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile.split("\ntest: ", 1)[1].split("\n\n", 1)[0].splitlines()
    assert "specdistill.hardware" in recipe[1], "the first line of `make test` names the CPU kind"


def test_the_feature_gated_tests_pass_as_an_avx2_machine_would_run_them():
    """The test of the tests: with the predicate answering "no native bf16", the packing tests skip for
    that reason and the unpacked fallback still passes, whatever CPU this really is."""
    # scripts/as_avx2.sh also caps PyTorch's and oneDNN's kernels at AVX2: a test that packed without
    # asking would fail in oneDNN's bf16 reorder, as on a real AVX2 machine
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_packed.py"]
    if platform.machine() in ("x86_64", "AMD64"):
        command = [str(REPO / "scripts" / "as_avx2.sh"), *command]
    run = subprocess.run(command, cwd=REPO, env={**os.environ, hardware.FLAGS_ENV: "avx2 fma"}, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "no bf16 packing on this machine" in run.stdout and "no native bf16, flags from" in run.stdout
    assert " passed" in run.stdout and " skipped" in run.stdout and " failed" not in run.stdout
