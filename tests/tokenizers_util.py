"""Moved to tests/conftest.py (`from tests.conftest import train_bpe`). Kept only until test_monitor.py and
test_pipeline.py, edited in other branches, import it from there; delete this file then."""

from tests.conftest import train_bpe  # noqa: F401
