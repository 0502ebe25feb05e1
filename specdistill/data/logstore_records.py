"""What the pipeline writes back into the log store beside the traffic: the target's own
responses, the monitor's acceptance samples and its decisions. A base of `LogStore`, which brings
the engine and the dialect-aware insert."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from datetime import datetime, timezone

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from specdistill.acceptance import DraftCounts
from specdistill.data.logschema import acceptance_samples, decisions, responses, writing

PIPELINE_SUCCESS = "pipeline_success"  # the decision kind a flow records when it ran to its end


def _now() -> datetime:
    return datetime.now(timezone.utc)


class PipelineRecords:
    engine: sa.Engine

    def _insert(self, table: sa.Table):
        """The dialect's own INSERT (it has `on_conflict_do_nothing`)."""
        return (postgresql if self.engine.dialect.name == "postgresql" else sqlite).insert(table)

    # -- target responses --------------------------------------------------------------------

    def add_response(
        self,
        conversation_id: int,
        target_fingerprint: str,
        text: str,
        *,
        prompt_messages: int,
        params: dict | None = None,
        token_ids: list[int] | None = None,
    ) -> bool:
        """Record the target's response to the first `prompt_messages` messages; False if already there."""
        params_json = json.dumps(params or {}, sort_keys=True)
        row = dict(conversation_id=conversation_id, prompt_messages=prompt_messages,
                   target_fingerprint=target_fingerprint, params=params_json,
                   params_hash=hashlib.sha256(params_json.encode()).hexdigest()[:16], text=text,
                   token_ids=json.dumps(token_ids) if token_ids is not None else None, created_at=_now())
        stmt = self._insert(responses).on_conflict_do_nothing(
            index_elements=["conversation_id", "prompt_messages", "target_fingerprint", "params_hash"])
        with writing(self.engine) as conn:
            return conn.execute(stmt.returning(responses.c.id), row).first() is not None

    def responses(self, target_fingerprint: str, conversation_ids: Iterable[int] | None = None) -> list[dict]:
        query = sa.select(responses).where(responses.c.target_fingerprint == target_fingerprint)
        if conversation_ids is not None:
            query = query.where(responses.c.conversation_id.in_(list(conversation_ids)))
        with self.engine.connect() as conn:
            rows = conn.execute(query.order_by(responses.c.id)).mappings().all()
        return [{**r, "params": json.loads(r["params"]),
                 "token_ids": json.loads(r["token_ids"]) if r["token_ids"] else None} for r in rows]

    # -- acceptance samples (written by the monitor) -------------------------------------------

    def add_acceptance_sample(
        self,
        target_fingerprint: str,
        draft_version: str,
        gamma: int,
        counts: DraftCounts,
        conversation_id: int | None = None,
        measured_at: datetime | None = None,
    ) -> int:
        if counts.accepted > counts.proposed or len(counts.accepted_per_position) != gamma:
            raise ValueError("accepted tokens exceed drafted tokens, or per-position counts do not have gamma entries")
        with writing(self.engine) as conn:
            return conn.execute(acceptance_samples.insert().returning(acceptance_samples.c.id), dict(
                measured_at=measured_at or _now(), target_fingerprint=target_fingerprint,
                draft_version=draft_version, conversation_id=conversation_id, gamma=gamma, num_drafts=counts.rounds,
                num_draft_tokens=counts.proposed, num_accepted_tokens=counts.accepted,
                accepted_per_position=json.dumps(list(counts.accepted_per_position)))).scalar_one()

    def acceptance(self, target_fingerprint: str, draft_version: str, since: datetime | None = None) -> dict:
        """Acceptance rate and mean accepted length over the samples (the design's definitions)."""
        a = acceptance_samples.c
        query = sa.select(sa.func.count(), sa.func.sum(a.num_drafts), sa.func.sum(a.num_draft_tokens),
                          sa.func.sum(a.num_accepted_tokens)).where(
            a.target_fingerprint == target_fingerprint, a.draft_version == draft_version)
        if since is not None:
            query = query.where(a.measured_at >= since)
        with self.engine.connect() as conn:
            samples, drafts, proposed, accepted = conn.execute(query).one()
        counts = DraftCounts(drafts or 0, proposed or 0, accepted or 0)
        return {"samples": samples, "acceptance_rate": counts.acceptance_rate, "mean_accepted_length": counts.accepted_length}

    def acceptance_samples_after(self, after_id: int = 0, limit: int = 10_000) -> list[tuple[int, DraftCounts]]:
        """(id, counts) of the samples with id > after_id, oldest first (what a metrics exporter has not counted yet)."""
        a = acceptance_samples.c
        query = sa.select(acceptance_samples).where(a.id > after_id).order_by(a.id).limit(limit)
        with self.engine.connect() as conn:
            rows = conn.execute(query).mappings().all()
        return [(r["id"], DraftCounts(r["num_drafts"], r["num_draft_tokens"], r["num_accepted_tokens"],
                                      json.loads(r["accepted_per_position"]))) for r in rows]

    # -- monitor decisions -------------------------------------------------------------------

    def add_decision(self, kind: str, target_fingerprint: str, draft_version: str | None, payload_json: str,
                     decided_at: datetime | None = None) -> int:
        """Record a monitor decision with the JSON of the numbers it was made on."""
        try:
            json.loads(payload_json)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"decision payload is not JSON: {exc}") from exc
        if not kind:
            raise ValueError("a decision needs a kind")
        with writing(self.engine) as conn:
            return conn.execute(decisions.insert().returning(decisions.c.id), dict(
                decided_at=decided_at or _now(), kind=kind, target_fingerprint=target_fingerprint,
                draft_version=draft_version, payload=payload_json)).scalar_one()

    def add_pipeline_success(self, flow: str, target_fingerprint: str = "", payload: dict | None = None,
                             when: datetime | None = None) -> int:
        """A flow (nightly, monitor) that ran to its end: what `specdistill_pipeline_last_success_timestamp_seconds`
        reports, read by the exporter (`monitor serve`) from here."""
        return self.add_decision(PIPELINE_SUCCESS, target_fingerprint, None,
                                 json.dumps({"flow": flow, **(payload or {})}, default=str, sort_keys=True), when)

    def last_pipeline_success(self) -> datetime | None:
        """When a flow last succeeded (None: never)."""
        d = decisions.c
        with self.engine.connect() as conn:
            return conn.execute(sa.select(sa.func.max(d.decided_at)).where(d.kind == PIPELINE_SUCCESS)).scalar()

    def decisions(self, *, kind: str | None = None, target_fingerprint: str | None = None,
                  limit: int | None = 100) -> list[dict]:
        """Decisions, newest first, with their payload parsed."""
        d = decisions.c
        query = sa.select(decisions).order_by(d.decided_at.desc(), d.id.desc()).limit(limit)
        if kind is not None:
            query = query.where(d.kind == kind)
        if target_fingerprint is not None:
            query = query.where(d.target_fingerprint == target_fingerprint)
        with self.engine.connect() as conn:
            rows = conn.execute(query).mappings().all()
        return [{**r, "payload": json.loads(r["payload"])} for r in rows]
