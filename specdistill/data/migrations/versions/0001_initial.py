"""Initial log store: ingest runs, conversations, target responses, quarantine, watermarks, acceptance samples.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def when(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    # one function per table, created in this order (the foreign keys point back up the list)
    _ingest_runs()
    _conversations()
    _responses()
    _quarantine()
    _watermarks()
    _acceptance_samples()


def _ingest_runs() -> None:
    op.create_table(
        "ingest_runs",
        sa.Column("id", ID, primary_key=True, autoincrement=True),
        sa.Column("source", sa.String(1024), nullable=False),
        sa.Column("format", sa.String(32), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        when("started_at"),
        when("finished_at", nullable=True),
        sa.Column("start_offset", sa.BigInteger(), nullable=False),
        sa.Column("end_offset", sa.BigInteger(), nullable=False),
        sa.Column("read", sa.Integer(), nullable=False),
        sa.Column("stored", sa.Integer(), nullable=False),
        sa.Column("duplicates", sa.Integer(), nullable=False),
        sa.Column("quarantined", sa.Integer(), nullable=False),
        sa.Column("truncated_at", sa.BigInteger()),
        sa.Column("truncated_bytes", sa.BigInteger()),
        sa.Column("note", sa.Text()),
    )


def _conversations() -> None:
    op.create_table(
        "conversations",
        sa.Column("id", ID, primary_key=True, autoincrement=True),
        sa.Column("content_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("prompt_hash", sa.String(64), nullable=False, index=True),
        sa.Column("split", sa.String(8), nullable=False, index=True),
        sa.Column("messages", sa.Text(), nullable=False),
        sa.Column("num_messages", sa.Integer(), nullable=False),
        sa.Column("num_chars", sa.Integer(), nullable=False),
        sa.Column("source", sa.String(1024), nullable=False, index=True),
        sa.Column("location", sa.String(1024), nullable=False),
        sa.Column("record_id", sa.String(256)),
        sa.Column("target_version", sa.String(256), index=True),
        sa.Column("notes", sa.Text()),
        when("arrived_at"),
        when("ingested_at"),
        sa.Column("ingest_run_id", ID, sa.ForeignKey("ingest_runs.id")),
    )
    op.create_index("ix_conversations_arrived_at", "conversations", ["arrived_at"])


def _responses() -> None:
    op.create_table(
        "responses",
        sa.Column("id", ID, primary_key=True, autoincrement=True),
        sa.Column("conversation_id", ID, sa.ForeignKey("conversations.id"), nullable=False, index=True),
        sa.Column("prompt_messages", sa.Integer(), nullable=False),
        sa.Column("target_fingerprint", sa.String(128), nullable=False, index=True),
        sa.Column("params_hash", sa.String(16), nullable=False),
        sa.Column("params", sa.Text(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("token_ids", sa.Text()),
        when("created_at"),
        sa.UniqueConstraint("conversation_id", "prompt_messages", "target_fingerprint", "params_hash",
                            name="uq_responses_prompt_target_params"),
    )


def _quarantine() -> None:
    op.create_table(
        "quarantine",
        sa.Column("id", ID, primary_key=True, autoincrement=True),
        sa.Column("source", sa.String(1024), nullable=False, index=True),
        sa.Column("location", sa.String(1024), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("raw", sa.Text(), nullable=False),
        sa.Column("raw_hash", sa.String(64), nullable=False),
        when("created_at"),
        sa.Column("ingest_run_id", ID, sa.ForeignKey("ingest_runs.id")),
        sa.UniqueConstraint("source", "location", "raw_hash", name="uq_quarantine_source_location_raw"),
    )


def _watermarks() -> None:
    op.create_table(
        "watermarks",
        sa.Column("source", sa.String(1024), primary_key=True),
        sa.Column("format", sa.String(32), nullable=False),
        sa.Column("byte_offset", sa.BigInteger(), nullable=False),
        sa.Column("record_index", sa.Integer(), nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        when("updated_at"),
    )


def _acceptance_samples() -> None:
    op.create_table(
        "acceptance_samples",
        sa.Column("id", ID, primary_key=True, autoincrement=True),
        when("measured_at"),
        sa.Column("target_fingerprint", sa.String(128), nullable=False, index=True),
        sa.Column("draft_version", sa.String(256), nullable=False),
        sa.Column("conversation_id", ID, sa.ForeignKey("conversations.id")),
        sa.Column("gamma", sa.Integer(), nullable=False),
        sa.Column("num_drafts", sa.Integer(), nullable=False),
        sa.Column("num_draft_tokens", sa.Integer(), nullable=False),
        sa.Column("num_accepted_tokens", sa.Integer(), nullable=False),
        sa.Column("accepted_per_position", sa.Text(), nullable=False),
    )
    op.create_index("ix_acceptance_samples_measured_at", "acceptance_samples", ["measured_at"])


def downgrade() -> None:
    for table in ("acceptance_samples", "watermarks", "quarantine", "responses", "conversations", "ingest_runs"):
        op.drop_table(table)
