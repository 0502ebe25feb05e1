"""The window of one split since a time, read through one index (split, arrived_at). The index on split alone
has two or three values, and SQLite's planner (no statistics unless ANALYZE ran) took it for the nightly's
window sample, reading every train conversation of the store and sorting them: 7.6 s at 2M conversations,
growing with the store. The composite index serves the split-only queries too (its first column), so it
replaces that one: no index more to write per conversation.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-06
"""

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_conversations_split_arrived", "conversations", ["split", "arrived_at"])
    op.drop_index("ix_conversations_split", "conversations")


def downgrade() -> None:
    op.create_index("ix_conversations_split", "conversations", ["split"])
    op.drop_index("ix_conversations_split_arrived", "conversations")
