"""The one place where offline mode and telemetry opt-outs are set.

Imported first by the package, before transformers, huggingface_hub, prefect or mlflow read
their environment, so no code path ever tries the network for a model hub or telemetry.
"""

from __future__ import annotations

import os

OFFLINE_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # Prefect's temporary server can take a minute to start on a busy 2-core machine.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def apply_offline_env() -> None:
    """Set every offline/telemetry variable unless the user already chose a value."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
