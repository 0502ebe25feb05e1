"""Alembic environment: migrations always run on a connection handed over by logstore.upgrade."""

from alembic import context

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through specdistill.data.logstore.upgrade(engine), which passes a connection")

context.configure(connection=connection, render_as_batch=connection.dialect.name == "sqlite")
with context.begin_transaction():
    context.run_migrations()
