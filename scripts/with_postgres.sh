#!/usr/bin/env bash
# Run a command with a throwaway PostgreSQL server, for the log store's tests:
#   scripts/with_postgres.sh python -m pytest -q
# Installs Debian's postgresql package when it is missing (needs root and apt), starts a private
# cluster on 127.0.0.1 on a free port with a random password, creates the database
# specdistill_test, exports SPECDISTILL_TEST_PG_URL, runs the command, then stops the server and
# removes its files. Already set SPECDISTILL_TEST_PG_URL: runs the command against that server.
# SPECDISTILL_SKIP_PG=1: runs the command without PostgreSQL (its tests are then reported skipped).
set -euo pipefail

if [[ -n "${SPECDISTILL_TEST_PG_URL:-}" || "${SPECDISTILL_SKIP_PG:-0}" == "1" ]]; then
    exec "$@"
fi

find_bindir() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1; }

BINDIR="$(find_bindir)"
if [[ -z "$BINDIR" || ! -x "$BINDIR/initdb" ]]; then
    if [[ "$(id -u)" != "0" ]] || ! command -v apt-get >/dev/null; then
        echo "with_postgres: PostgreSQL is not installed and cannot be installed here (needs root and apt-get)." >&2
        echo "with_postgres: install it (apt-get install postgresql), or set SPECDISTILL_SKIP_PG=1 to skip its tests." >&2
        exit 1
    fi
    echo "with_postgres: installing PostgreSQL from Debian's packages" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends postgresql >&2
    BINDIR="$(find_bindir)"
fi

# The server refuses to run as root: run it as the package's postgres user then.
if [[ "$(id -u)" == "0" ]]; then
    RUNAS=(runuser -u postgres --)
else
    RUNAS=()
fi

WORK="$(mktemp -d /tmp/specdistill-pg.XXXXXX)"
PORT="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
PASSWORD="$(python3 -c 'import secrets; print(secrets.token_hex(12))')"
printf '%s\n' "$PASSWORD" > "$WORK/pwfile"
[[ "$(id -u)" == "0" ]] && chown -R postgres: "$WORK"

cd "$WORK"  # the server's user may not be allowed into the caller's directory

cleanup() {
    "${RUNAS[@]}" "$BINDIR/pg_ctl" -D "$WORK/data" -m immediate stop >/dev/null 2>&1 || true
    rm -rf "$WORK"
}
trap cleanup EXIT

"${RUNAS[@]}" "$BINDIR/initdb" -D "$WORK/data" -U postgres --auth=scram-sha-256 --pwfile="$WORK/pwfile" \
    --no-sync --encoding=UTF8 --locale=C >"$WORK/initdb.log" 2>&1 || { cat "$WORK/initdb.log" >&2; exit 1; }
"${RUNAS[@]}" "$BINDIR/pg_ctl" -D "$WORK/data" -l "$WORK/server.log" -w -t 60 start \
    -o "-p $PORT -k $WORK -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=100" \
    >/dev/null || { cat "$WORK/server.log" >&2; exit 1; }
PGPASSWORD="$PASSWORD" "$BINDIR/psql" -q -h 127.0.0.1 -p "$PORT" -U postgres -d postgres \
    -c "CREATE DATABASE specdistill_test" >/dev/null

export SPECDISTILL_TEST_PG_URL="postgresql+psycopg://postgres:${PASSWORD}@127.0.0.1:${PORT}/specdistill_test"
echo "with_postgres: PostgreSQL $("$BINDIR/postgres" --version | awk '{print $3}') on 127.0.0.1:$PORT" >&2
cd - >/dev/null
"$@"
