"""scripts/gpu_check.sh: fails clearly without a GPU; its steps run on the CPU with `--device cpu`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the check would run for real")
def test_without_a_gpu_the_check_says_so_and_exits_2():
    run = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                         env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}, timeout=300)
    assert run.returncode == 2 and "no CUDA device" in run.stderr
    direct = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--device", "cuda"],
                            capture_output=True, text=True, timeout=300)
    assert direct.returncode == 2 and "sees no CUDA device" in direct.stderr and "--device cpu" in direct.stderr


def test_the_lossless_step_runs_on_the_cpu_and_prints_its_table():
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--device", "cpu", "--only", "lossless",
                          "--prompts", "8", "--json"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    assert report["passed"] and report["lossless"]["device"] == "cpu"
    assert set(report["lossless"]["identical"]) == {"draft", "draft-tree", "self-spec", "ngram", "eagle3-tree"}
    assert all(v == report["lossless"]["prompts"] for v in report["lossless"]["identical"].values())
