"""A store that grows: the logged `user` of a request (what `logs forget --user` finds), and one index
for the windows the nightly and the monitor read (a source's split since a time), so a window's count and
sample read the window, not the store (it replaces the index on source alone: one index
less to write per conversation).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # ADD COLUMN is native on SQLite too: no table copy, whatever the store's size
    op.add_column("conversations", sa.Column("user", sa.String(256)))
    op.create_index("ix_conversations_user", "conversations", ["user"])
    op.create_index("ix_conversations_source_split_arrived", "conversations", ["source", "split", "arrived_at"])
    op.drop_index("ix_conversations_source", "conversations")  # the new one's first column: one index less to write


def downgrade() -> None:
    op.create_index("ix_conversations_source", "conversations", ["source"])
    op.drop_index("ix_conversations_source_split_arrived", "conversations")
    op.drop_index("ix_conversations_user", "conversations")
    with op.batch_alter_table("conversations") as batch:
        batch.drop_column("user")
