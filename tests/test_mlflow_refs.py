"""Model references through MLflow: an unreachable tracking server is named in seconds, never retried for minutes."""

from __future__ import annotations

import socket
import time

import pytest

from specdistill.modeling import mlflow_refs
from specdistill.modeling.mlflow_refs import TrackingServerError, download_draft


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_tracking_server_is_one_line_naming_it_within_seconds(monkeypatch, tmp_path, capsys):
    from specdistill.cli import main
    from tests.conftest import save_tiny_target

    uri = f"http://alice:hunter22@127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setattr(mlflow_refs, "REACH_SECONDS", 1.0)
    began = time.monotonic()
    with pytest.raises(TrackingServerError) as caught:
        download_draft("models:/draft@champion")
    assert time.monotonic() - began < 5
    message = str(caught.value)
    assert f"http://alice:***@127.0.0.1:{uri.rsplit(':', 1)[1]}" in message and "unreachable" in message
    assert "hunter22" not in message and "Connection refused" in message
    target = save_tiny_target(tmp_path / "target")
    assert main(["generate", "--target", str(target), "--draft", "models:/draft@champion", "--prompt", "hi",
                 "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("specdistill: error: MLflow tracking server http://alice:***@") and "hunter22" not in err[-1]


def test_a_tracking_uri_with_a_bad_port_is_named(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:notaport")
    with pytest.raises(TrackingServerError, match="MLFLOW_TRACKING_URI http://127.0.0.1:notaport: its port is not a number"):
        mlflow_refs.client()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "postgresql://mlflow:hunter22@127.0.0.1:notaport/mlflow")
    with pytest.raises(TrackingServerError) as caught:
        mlflow_refs.client()
    assert str(caught.value).startswith("MLFLOW_TRACKING_URI postgresql://mlflow:***@127.0.0.1:notaport/mlflow: not a "
                                        "database URL") and "hunter22" not in str(caught.value)


def test_mlflow_retries_are_bounded_by_default():
    import os

    assert int(os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]) <= 3 and int(os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"]) <= 30


@pytest.mark.parametrize("content", [b"\x8f" * 5000, b"SQLite format 3\x00" + b"\x00" * 84 + b"\xff" * 4000])
def test_a_corrupt_mlflow_store_is_one_line_naming_it(tmp_path, capsys, content):
    """A corrupt `mlflow.db` was a raw sqlalchemy DatabaseError (with MLflow's schema query) in `generate --draft
    models:/...`, `monitor run`, and every command that reads the registry."""
    from specdistill import paths
    from specdistill.cli import main
    from tests.conftest import save_tiny_target

    store = paths.ensure(paths.home()) / "mlflow.db"
    store.write_bytes(content)
    with pytest.raises(TrackingServerError) as caught:
        mlflow_refs.client()
    message = str(caught.value)
    assert message.startswith(f"MLflow's store {store} is not a readable SQLite database") and len(message.splitlines()) == 1
    target = save_tiny_target(tmp_path / "target")
    capsys.readouterr()
    argv = ["generate", "--target", str(target), "--draft", "models:/draft@champion", "--prompt", "hi", "--max-new-tokens", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"specdistill: error: MLflow's store {store} is not a readable")
    assert not any("Traceback" in line for line in err)
    assert store.read_bytes() == content  # nothing written over it
