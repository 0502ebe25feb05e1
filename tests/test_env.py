"""The process environment: offline defaults, and credentials masked wherever a URL or message is shown."""

from __future__ import annotations

import json

import pytest

from specdistill.data.logschema import display_url
from specdistill.env import MASK, mask_secrets, mask_url


@pytest.mark.parametrize("url, kept", [
    ("postgresql+psycopg://alice:hunter22@db:5432/logs", "postgresql+psycopg://alice:***@db:5432/logs"),
    ("postgresql+psycopg://db/logs?password=hunter22", "postgresql+psycopg://db/logs?password=***"),
    ("postgresql+psycopg://db/logs?user=a&password=hunter22&sslmode=require", "user=a&password=***&sslmode=require"),
    ("postgresql://db/logs?PWD=hunter22", "PWD=***"),
    ("http://mlflow:5000/api?token=hunter22&x=1", "token=***&x=1"),
    ("https://bob:p%40ss%2Fword@mlflow.example/", "https://bob:***@mlflow.example/"),
    ("host=db port=5432 password=hunter22 dbname=logs", "password=*** dbname=logs"),
    ("postgresql://u:hunter22@127.0.0.1:notaport/x", "postgresql://u:***@127.0.0.1:notaport/x"),
])
def test_every_credential_form_is_masked(url, kept):
    for shown in (mask_url(url), display_url(url)):
        assert "hunter22" not in shown and "p%40ss" not in shown and "word@" not in shown
    assert kept in mask_url(url)


def test_plain_urls_and_words_are_left_alone():
    for text in ("sqlite:////var/lib/specdistill/logs.db", "http://127.0.0.1:8000/metrics",
                 "loss.temperature=2 cache_key=abc max_tokens=16", "a passage about keys"):
        assert mask_secrets(text) == text


def test_environment_secrets_are_masked_wherever_they_appear(monkeypatch):
    monkeypatch.setenv("PGPASSWORD", "s3cr3t-from-env")
    monkeypatch.setenv("SPECDISTILL_LOG_DB", "postgresql+psycopg://app:pw-in-the-url@db/logs")
    monkeypatch.setenv("MY_SERVICE_API_KEY", "k-123456")
    message = ("connection to db failed for 'app' with s3cr3t-from-env; the server echoed pw-in-the-url; "
               "header k-123456")
    shown = mask_secrets(message)
    assert "s3cr3t-from-env" not in shown and "pw-in-the-url" not in shown and "k-123456" not in shown
    assert shown.count(MASK) == 3 and "connection to db failed for 'app'" in shown


def test_engine_and_metrics_errors_show_the_url_masked():
    from specdistill.engines.client import EngineRequestError, get_json
    from specdistill.ops.metrics import sample_live_acceptance

    with pytest.raises(EngineRequestError) as caught:
        get_json("http://user:hunter22@127.0.0.1:1/v1/models?api_key=hunter23", timeout_s=2)
    assert "127.0.0.1:1" in str(caught.value) and "hunter2" not in str(caught.value)
    from specdistill.pipeline.stages.answers.engine_client import connect

    with pytest.raises(EngineRequestError) as caught:
        connect("http://bob:hunter25@127.0.0.1:1/v1", [1, 2, 3], 8, timeout_s=2)
    assert "no OpenAI-compatible server at http://bob:***@127.0.0.1:1" in str(caught.value)
    assert "hunter25" not in str(caught.value)
    sample = sample_live_acceptance("http://127.0.0.1:1/metrics?token=hunter24", interval_s=0)
    assert not sample.ok and "127.0.0.1:1/metrics?token=***" in sample.reason and "hunter24" not in sample.reason


def test_the_words_key_value_in_a_message_are_not_a_credential():
    """`override 'window' is not key=***`: the placeholder "value" was masked as if it were a key's secret."""
    from specdistill.recipe import ConfigError, apply_overrides

    with pytest.raises(ConfigError) as caught:
        apply_overrides({}, ["window"])
    assert mask_secrets(str(caught.value)) == "override 'window' is not key=value"
    assert mask_secrets("http://h/v1?key=hunter22") == "http://h/v1?key=***"  # a query string's key is one
    assert mask_secrets("host=db password=hunter22") == "host=db password=***"


def test_a_credential_in_an_override_is_stashed_in_the_environment_and_restored_at_config_load(monkeypatch):
    """A `log_db=postgresql://u:PASS@...` override went into Prefect's flow-run parameters in clear."""
    import os

    from specdistill.env import stash_secrets
    from specdistill.pipeline.nightly_recipe import load_nightly_config
    from specdistill.recipe import ConfigError

    url = "postgresql+psycopg://u:hunter22@db:5432/logs?sslpassword=hunter33&sslmode=require"
    stashed = stash_secrets(["window.days=2", f"log_db={url}"])
    assert stashed[0] == "window.days=2" and "hunter22" not in str(stashed) and "hunter33" not in str(stashed)
    assert stash_secrets([f"log_db={url}"]) == stashed[1:]  # the same names for the same values: a rerun's keys match
    assert load_nightly_config(None, stashed).log_db == url
    for name in [k for k in os.environ if k.startswith("SPECDISTILL_SECRET_")]:
        monkeypatch.delenv(name)
    with pytest.raises(ConfigError, match=r"log_db: \$\{SPECDISTILL_SECRET_\d+\} is not set"):
        load_nightly_config(None, stashed)


def test_run_flow_hands_the_flow_its_overrides_without_credentials():
    from flows.runner import run_flow
    from specdistill.pipeline.nightly_recipe import load_nightly_config

    seen = {}

    def flow(config_path=None, overrides=None):
        seen["overrides"] = overrides
        return load_nightly_config(config_path, overrides).log_db

    url = "postgresql+psycopg://u:hunter22@db/logs"
    assert run_flow(flow, config_path=None, overrides=[f"log_db={url}"]) == url
    assert "hunter22" not in str(seen["overrides"])


# ----------------------------------------------------------------------------------------------
# a password holding an @, a URL without a scheme: masked as the drivers read them (issue 61)

AT_URLS = ["postgresql://bob:p@ssSECRET@127.0.0.1:1/logs", "postgresql+psycopg://bob:pa:ss@w0rdSECRET@127.0.0.1:1/logs",
           "postgresql+psycopg://bob@corp:SECRETpw@127.0.0.1:1/logs", "bob:SECRETxy@127.0.0.1/logs",
           "postgresql://bob:p%40ssSECRET@127.0.0.1:1/logs"]


@pytest.mark.parametrize("url", AT_URLS)
def test_a_password_with_an_at_or_no_scheme_is_masked_as_the_drivers_read_it(url, capsys):
    from specdistill.cli import main
    from specdistill.data.logschema import LogStoreError
    from specdistill.data.logstore import LogStore

    for shown in (mask_secrets(url), display_url(url), mask_secrets(f"not a database URL: {url!r}")):
        assert "SECRET" not in shown and "ssS" not in shown, shown
    if "://" in url:  # the log store reads the host after the last @, so no error quotes a piece of the password
        with pytest.raises(LogStoreError) as caught:
            LogStore(url)
        assert "127.0.0.1" in str(caught.value) and "SECRET" not in str(caught.value)
    assert main(["logs", "stats", "--db", url, "--json"]) == 2
    out, err = capsys.readouterr()
    assert "SECRET" not in out + err and json.loads(out)["exit_code"] == 2


def test_a_drivers_error_that_quotes_a_piece_of_the_password_is_masked(monkeypatch):
    """SQLAlchemy ends the userinfo at the first @: the driver then said `failed to resolve host 'ssSECRET@...'`."""
    import sqlalchemy as sa

    from specdistill.data.logschema import database_error

    url = "postgresql://bob:p@ssSECRET@db.internal/logs"
    error = sa.exc.OperationalError("SELECT 1", {}, Exception("failed to resolve host 'ssSECRET@db.internal'"))
    assert "SECRET" not in str(database_error(url, error))
    monkeypatch.setenv("SPECDISTILL_LOG_DB", url)  # a message that names no URL: the environment's password, in pieces
    assert mask_secrets("failed to resolve host 'ssSECRET@db.internal'") == "failed to resolve host '***@db.internal'"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    from specdistill.modeling.mlflow_refs import tracking_uri

    assert sa.make_url(tracking_uri()).host == "db.internal" and sa.make_url(tracking_uri()).password == "p@ssSECRET"


def test_a_flows_log_records_are_masked_before_any_handler_writes_them(tmp_path):
    """Prefect's flow-run log (and its database) received the driver's unmasked text and traceback."""
    import io
    import logging

    from flows.runner import run_flow

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("prefect.flow_runs.h61")
    logger.addHandler(handler)
    url = "postgresql://bob:p@ssSECRET@db/logs"

    def flow():
        try:
            raise RuntimeError(f"failed to resolve host 'ssSECRET@db' for {url}")
        except RuntimeError:
            logger.exception("stage failed: %s", "bob:SECRETxy@db/logs")
        return "done"

    try:
        assert run_flow(flow) == "done"
    finally:
        logger.removeHandler(handler)
    written = stream.getvalue()
    assert "stage failed" in written and "Traceback" in written and "RuntimeError" in written
    assert "SECRET" not in written and "ssS" not in written


def test_a_password_with_an_at_opens_the_log_store_as_the_drivers_read_it(store_url):
    """`user:p@ss@host`: the password runs to the last @ (SQLAlchemy alone would connect to host `ss@host`)."""
    import uuid

    import sqlalchemy as sa

    from specdistill.data.logstore import LogStore

    base = sa.make_url(store_url)
    if base.get_backend_name() != "postgresql":
        pytest.skip("a role with a password needs the PostgreSQL server")
    role, password = f"r_{uuid.uuid4().hex[:8]}", "p@ss@word-SECRET"
    admin = sa.create_engine(base)
    schema = base.query["options"].rpartition("=")[2]
    with admin.begin() as conn:
        conn.execute(sa.text(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'"))
        conn.execute(sa.text(f"GRANT ALL ON SCHEMA {schema} TO {role}"))
    try:
        url = base.render_as_string(hide_password=False).replace(
            f"{base.username}:{base.password}@", f"{role}:{password}@")  # typed as a user would, unquoted
        store = LogStore(url)
        assert store.stats()["conversations"] == 0 and "SECRET" not in store.display_url
        store.close()
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f"DROP OWNED BY {role}"))
            conn.execute(sa.text(f"DROP ROLE {role}"))
        admin.dispose()
