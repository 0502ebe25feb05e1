"""The log store's tables, engine and migrations, and the hashes that give a conversation its
identity and its split.

The tables here are what the migrations in `specdistill/data/migrations/versions/` build (a test
compares the two); change both together, with a new migration.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timezone
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy.engine import Connection, Engine

from specdistill.env import driver_url, mask_secrets
from specdistill.paths import create_private_file, read_only_reason

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
_ADVISORY_LOCK = 0x5D15_7111  # PostgreSQL advisory lock id for migrations


class UTCDateTime(sa.types.TypeDecorator):
    """Timezone-aware UTC datetimes on every backend (SQLite keeps naive UTC text)."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value}: pass a timezone-aware one")
        value = value.astimezone(timezone.utc)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value, dialect):
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value


_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
metadata = sa.MetaData()

ingest_runs = sa.Table(
    "ingest_runs", metadata,
    sa.Column("id", _ID, primary_key=True, autoincrement=True),
    sa.Column("source", sa.String(1024), nullable=False),
    sa.Column("format", sa.String(32), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),  # running | done
    sa.Column("started_at", UTCDateTime(), nullable=False),
    sa.Column("finished_at", UTCDateTime()),
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

conversations = sa.Table(
    "conversations", metadata,
    sa.Column("id", _ID, primary_key=True, autoincrement=True),
    sa.Column("content_hash", sa.String(64), nullable=False, unique=True),
    sa.Column("prompt_hash", sa.String(64), nullable=False, index=True),
    sa.Column("split", sa.String(8), nullable=False),  # indexed first in (split, arrived_at)
    sa.Column("messages", sa.Text(), nullable=False),  # JSON [{"role", "content"}]
    sa.Column("num_messages", sa.Integer(), nullable=False),
    sa.Column("num_chars", sa.Integer(), nullable=False),
    sa.Column("source", sa.String(1024), nullable=False),  # indexed first in (source, split, arrived_at)
    sa.Column("location", sa.String(1024), nullable=False),
    sa.Column("record_id", sa.String(256)),
    sa.Column("target_version", sa.String(256), index=True),  # the model that served it, if logged
    sa.Column("request_temperature", sa.Float()),  # the sampling temperature its request asked for, if logged
    sa.Column("user", sa.String(256), index=True),  # the request's logged `user` (OpenAI logs): what `logs forget` finds
    sa.Column("notes", sa.Text()),  # JSON list: what normalization changed
    sa.Column("arrived_at", UTCDateTime(), nullable=False, index=True),
    sa.Column("ingested_at", UTCDateTime(), nullable=False),
    sa.Column("ingest_run_id", _ID, sa.ForeignKey("ingest_runs.id")),
    sa.Index("ix_conversations_source_split_arrived", "source", "split", "arrived_at"),
    sa.Index("ix_conversations_split_arrived", "split", "arrived_at"),  # a split's window (migration 0005)
)

responses = sa.Table(
    "responses", metadata,
    sa.Column("id", _ID, primary_key=True, autoincrement=True),
    sa.Column("conversation_id", _ID, sa.ForeignKey("conversations.id"), nullable=False, index=True),
    sa.Column("prompt_messages", sa.Integer(), nullable=False),  # how many leading messages formed the prompt
    sa.Column("target_fingerprint", sa.String(128), nullable=False, index=True),
    sa.Column("params_hash", sa.String(16), nullable=False),
    sa.Column("params", sa.Text(), nullable=False),  # JSON generation settings
    sa.Column("text", sa.Text(), nullable=False),
    sa.Column("token_ids", sa.Text()),  # JSON list of generated ids, if kept
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.UniqueConstraint("conversation_id", "prompt_messages", "target_fingerprint", "params_hash",
                        name="uq_responses_prompt_target_params"),
)

quarantine = sa.Table(
    "quarantine", metadata,
    sa.Column("id", _ID, primary_key=True, autoincrement=True),
    sa.Column("source", sa.String(1024), nullable=False, index=True),
    sa.Column("location", sa.String(1024), nullable=False),
    sa.Column("reason", sa.Text(), nullable=False),
    sa.Column("raw", sa.Text(), nullable=False),
    sa.Column("raw_hash", sa.String(64), nullable=False),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("ingest_run_id", _ID, sa.ForeignKey("ingest_runs.id")),
    sa.UniqueConstraint("source", "location", "raw_hash", name="uq_quarantine_source_location_raw"),
)

watermarks = sa.Table(
    "watermarks", metadata,
    sa.Column("source", sa.String(1024), primary_key=True),
    sa.Column("format", sa.String(32), nullable=False),
    sa.Column("byte_offset", sa.BigInteger(), nullable=False),  # bytes read and committed
    sa.Column("record_index", sa.Integer(), nullable=False),  # line / element number at byte_offset
    sa.Column("fingerprint", sa.String(64), nullable=False),  # hash of the bytes at the start and before byte_offset
    sa.Column("updated_at", UTCDateTime(), nullable=False),
)

acceptance_samples = sa.Table(
    "acceptance_samples", metadata,
    sa.Column("id", _ID, primary_key=True, autoincrement=True),
    sa.Column("measured_at", UTCDateTime(), nullable=False, index=True),
    sa.Column("target_fingerprint", sa.String(128), nullable=False, index=True),
    sa.Column("draft_version", sa.String(256), nullable=False),
    sa.Column("conversation_id", _ID, sa.ForeignKey("conversations.id")),
    sa.Column("gamma", sa.Integer(), nullable=False),
    sa.Column("num_drafts", sa.Integer(), nullable=False),
    sa.Column("num_draft_tokens", sa.Integer(), nullable=False),
    sa.Column("num_accepted_tokens", sa.Integer(), nullable=False),
    sa.Column("accepted_per_position", sa.Text(), nullable=False),  # JSON list, length gamma
)

decisions = sa.Table(
    "decisions", metadata,
    sa.Column("id", _ID, primary_key=True, autoincrement=True),
    sa.Column("decided_at", UTCDateTime(), nullable=False, index=True),
    sa.Column("kind", sa.String(32), nullable=False),  # keep | fallback | no-sample | recovered | ...
    sa.Column("target_fingerprint", sa.String(128), nullable=False, index=True),
    sa.Column("draft_version", sa.String(256)),
    sa.Column("payload", sa.Text(), nullable=False),  # JSON: the numbers the decision was made on
)


SUPPORTED_BACKENDS = ("sqlite", "postgresql")


class LogStoreError(RuntimeError):
    """A log store URL that cannot be used: unparsable, of an unsupported kind, missing or unreachable.
    The message names the URL with its password masked."""


def display_url(url: str | sa.URL) -> str:
    """The URL with every credential masked (user:password@, ?password=..., secrets from the
    environment): the only form that goes into logs, errors and reports."""
    try:
        return mask_secrets(_make_url(url).render_as_string(hide_password=True), context=str(url))
    except (sa.exc.ArgumentError, ValueError):  # ValueError: a port that is not a number
        return mask_secrets(str(url))


def _make_url(url: str | sa.URL) -> sa.URL:
    """SQLAlchemy's parse of a URL whose password may hold an @ (`env.driver_url`)."""
    return sa.make_url(driver_url(url) if isinstance(url, str) else url)


def _sqlite_file(parsed: sa.URL) -> bool:
    """A SQLite URL naming a plain file path (not :memory:, not a `file:...?uri=true` URI that SQLite opens itself)."""
    is_uri = str(parsed.query.get("uri", "")).lower() in ("true", "1")
    return bool(parsed.database) and parsed.database != ":memory:" and not is_uri


def parse_url(url: str | sa.URL, *, create: bool = True) -> sa.URL:
    """The URL checked before any engine: a known backend whose driver is installed; for SQLite, a
    file path that is not a directory and, unless `create` (a writer), a file that exists."""
    try:
        parsed = _make_url(url)
    except sa.exc.ArgumentError:
        raise LogStoreError(f"not a database URL: {display_url(url)!r} (expected e.g. sqlite:///path/logs.db or "
                            "postgresql+psycopg://user:password@host/db)") from None
    except ValueError as exc:  # sqlalchemy parses the port with int()
        raise LogStoreError(f"not a database URL: {display_url(url)!r}: its port is not a number "
                            f"({str(exc).rpartition(': ')[2]})") from None
    backend = parsed.get_backend_name()
    if backend not in SUPPORTED_BACKENDS:
        raise LogStoreError(f"log store {display_url(parsed)}: unsupported database {backend!r} "
                            f"(supported: {', '.join(SUPPORTED_BACKENDS)})")
    try:
        parsed.get_dialect()
    except (ImportError, sa.exc.NoSuchModuleError) as exc:
        raise LogStoreError(f"log store {display_url(parsed)}: its database driver is not installed ({exc})") from None
    if backend == "sqlite" and _sqlite_file(parsed):
        path = Path(parsed.database)
        if path.is_dir():
            raise LogStoreError(f"log store {display_url(parsed)}: {path} is a directory, not a database file")
        if not create and not path.is_file():
            raise LogStoreError(f"log store {display_url(parsed)}: {path} does not exist (read commands never create "
                                "one; `specdistill ingest` does)")
    return parsed


def make_engine(url: str, *, create: bool = True) -> Engine:
    """An engine for a checked URL (`parse_url`). A new SQLite file is created 0600 (it holds traffic)."""
    parsed = parse_url(url, create=create)
    if parsed.get_backend_name() == "sqlite":
        if _sqlite_file(parsed):
            create_private_file(Path(parsed.database).resolve())
        engine = sa.create_engine(parsed, connect_args={"timeout": 60})

        @sa.event.listens_for(engine, "connect")
        def _sqlite_connect(dbapi_conn, _record):
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves, below
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a crash loses no committed batch's consistency
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=60000")
            # 64 MiB of page cache (the default is 2 MiB): the hash indexes take random inserts, which at a
            # million conversations and more read their pages from disk again and again on the default
            cur.execute("PRAGMA cache_size=-65536")
            cur.close()

        @sa.event.listens_for(engine, "begin")
        def _sqlite_begin(conn):
            # Writers take the write lock up front: a deferred transaction that reads and then
            # writes fails with "database is locked" when another process wrote in between.
            # Readers never block on a writer (WAL).
            conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("writes") else "BEGIN")

        return engine
    return sa.create_engine(parsed, pool_pre_ping=True)


def database_error(url: str | sa.URL, exc: sa.exc.DBAPIError) -> LogStoreError:
    """A driver's error as one line naming the store: never the SQL statement or its parameters
    (which hold traffic), and never a credential. A SQLite file SQLite cannot write (it writes its
    journal beside it) is said to be read-only, with the path."""
    reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
    try:
        parsed = _make_url(url)
    except (sa.exc.ArgumentError, ValueError):
        parsed = None
    if parsed is not None and parsed.get_backend_name() == "sqlite" and _sqlite_file(parsed):
        path = Path(parsed.database).absolute()
        why = (read_only_reason(path) if path.exists() else None) or read_only_reason(path.parent)
        if why:
            reason = f"{why}: SQLite cannot write {path.name} or its journal beside it ({reason})"
    secret_url = url.render_as_string(hide_password=False) if isinstance(url, sa.URL) else str(url)
    return LogStoreError(f"log store {display_url(url)}: {mask_secrets(reason, context=secret_url)}")


@contextmanager
def writing(engine: Engine) -> Iterator[Connection]:
    """A transaction that will write (on SQLite it takes the write lock when it begins). A database
    that refuses the write (a read-only file, a full disk, a lost server) is a `LogStoreError`."""
    try:
        with engine.connect() as conn:
            conn.execution_options(writes=True)
            with conn.begin():
                yield conn
    except sa.exc.OperationalError as exc:  # from None: the driver's own text (a traceback, Prefect's log) is unmasked
        raise database_error(engine.url, exc) from None


def _migrate(engine: Engine, direction: str, revision: str) -> None:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    with writing(engine) as conn:  # SQLite: the write lock; PostgreSQL: an advisory lock
        if conn.dialect.name == "postgresql":
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _ADVISORY_LOCK})
        config.attributes["connection"] = conn
        getattr(command, direction)(config, revision)


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Run the versioned migrations up to `revision`, one process at a time."""
    _migrate(engine, "upgrade", revision)


def downgrade(engine: Engine, revision: str) -> None:
    """Undo migrations down to `revision` ("base": an empty database)."""
    _migrate(engine, "downgrade", revision)


def schema_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return _revision(conn)


def _revision(conn: Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()
