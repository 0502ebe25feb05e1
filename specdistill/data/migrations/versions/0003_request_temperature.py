"""The sampling temperature an OpenAI log's request asked for: a logged answer claimed by the target is
held to what the target writes at that temperature (`pipeline.stages.answers.logged.own_text_check`).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("conversations") as batch:
        batch.add_column(sa.Column("request_temperature", sa.Float()))


def downgrade() -> None:
    with op.batch_alter_table("conversations") as batch:
        batch.drop_column("request_temperature")
