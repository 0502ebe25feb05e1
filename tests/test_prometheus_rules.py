"""The Prometheus config and rules in deploy/prometheus, checked and unit-tested with promtool."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from specdistill.acceptance import DraftCounts
from specdistill.ops.metrics import SpecDecodeMetrics

PROM_DIR = Path(__file__).resolve().parents[1] / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")
# In CI the Makefile installs Debian's prometheus package: a missing promtool there is a failure.
needs_promtool = pytest.mark.skipif(PROMTOOL is None and not os.environ.get("CI"), reason="promtool not installed")


@needs_promtool
def test_promtool_checks_config_and_rules():
    assert PROMTOOL, "promtool missing (Debian package 'prometheus')"
    subprocess.run([PROMTOOL, "check", "config", "prometheus.yml"], cwd=PROM_DIR, check=True, capture_output=True)


@needs_promtool
def test_promtool_rule_unit_tests():
    assert PROMTOOL, "promtool missing (Debian package 'prometheus')"
    result = subprocess.run([PROMTOOL, "test", "rules", "rules_test.yml"], cwd=PROM_DIR, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_only_reference_metrics_we_export():
    m = SpecDecodeMetrics()
    m.record(DraftCounts(1, 1, 1, [1]))
    m.mark_pipeline_success()
    exported = set(re.findall(r"^(specdistill_\w+?)(?:\{| )", generate_latest(m.registry).decode(), re.M))
    referenced = set(re.findall(r"\b(specdistill_\w+)", (PROM_DIR / "rules.yml").read_text()))
    assert referenced and referenced <= exported, referenced - exported
