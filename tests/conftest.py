"""Shared fixtures: tiny random Llama models (milliseconds) and the real demo target (cached once)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import specdistill  # noqa: F401  (offline environment)

REPO = Path(__file__).resolve().parents[1]
# One model cache for every test session: the demo target is dequantized once (~30 s), then reused.
os.environ.setdefault("SPECDISTILL_MODEL_CACHE", str(REPO / ".specdistill" / "models"))


def make_tiny_llama(vocab_size: int = 96, hidden: int = 32, layers: int = 4, seed: int = 0, tie: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def tiny_llama():
    return make_tiny_llama()


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """Each test gets its own state directory; only the model cache is shared."""
    monkeypatch.setenv("SPECDISTILL_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="session")
def demo_target():
    from specdistill.modeling.models import load_model

    return load_model("demo")


# --------------------------------------------------------------------------------------------
# log store backends: every store test runs on SQLite and on PostgreSQL


PG_URL_ENV = "SPECDISTILL_TEST_PG_URL"


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path):
    """A fresh, empty log store database URL. PostgreSQL: a schema of its own on the server named by
    $SPECDISTILL_TEST_PG_URL (`make test` starts one); skipped when that is unset."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'logs.db'}"
        return
    base = os.environ.get(PG_URL_ENV)
    if not base:
        pytest.skip(f"{PG_URL_ENV} is not set (make test starts a PostgreSQL server and sets it)")
    import uuid

    import sqlalchemy as sa

    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(base)
    with admin.begin() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    url = sa.make_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
    yield url.render_as_string(hide_password=False)
    with admin.begin() as conn:
        conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
    admin.dispose()


@pytest.fixture(scope="module")
def prefect_harness():
    """A temporary Prefect server for flow tests (slow to start on a busy machine)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield
