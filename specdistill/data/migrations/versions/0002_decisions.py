"""Monitor decisions: keep / fallback / no-sample / recovered, with every number they were made on.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "decisions",
        sa.Column("id", ID, primary_key=True, autoincrement=True),
        sa.Column("decided_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("target_fingerprint", sa.String(128), nullable=False),
        sa.Column("draft_version", sa.String(256)),
        sa.Column("payload", sa.Text(), nullable=False),
    )
    op.create_index("ix_decisions_decided_at", "decisions", ["decided_at"])
    op.create_index("ix_decisions_target_fingerprint", "decisions", ["target_fingerprint"])


def downgrade() -> None:
    op.drop_table("decisions")
