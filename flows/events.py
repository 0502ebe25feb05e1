"""The Prefect event that triggers the monitor deployment (deploy/prefect.yaml) when a new target
version is registered. Emitted from `specdistill target register`; Prefect is imported only here and
in the flows, never in the library."""

from __future__ import annotations

from prefect.events import emit_event

TARGET_UPDATED = "specdistill.target.updated"


def emit_target_updated(version: dict) -> bool:
    """True when the event went out (a Prefect server or Cloud workspace was there to take it)."""
    event = emit_event(
        event=TARGET_UPDATED,
        resource={"prefect.resource.id": f"specdistill.target.{version['fingerprint']}",
                  "prefect.resource.name": version["ref"]},
        payload={"fingerprint": version["fingerprint"], "path": version["path"], "ref": version["ref"]},
    )
    return event is not None
