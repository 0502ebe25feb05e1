#!/usr/bin/env bash
# promtool (Debian's prometheus package) unit-tests deploy/prometheus/rules.yml in the test suite.
# Installs it when missing and this is root with apt-get; otherwise says so and carries on (the
# promtool tests then skip outside CI and fail inside it).
set -euo pipefail
command -v promtool >/dev/null && exit 0
if [[ "$(id -u)" == "0" ]] && command -v apt-get >/dev/null; then
    echo "ensure_promtool: installing Debian's prometheus package for promtool" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends prometheus >&2
else
    echo "ensure_promtool: promtool missing and cannot be installed here (needs root and apt-get)" >&2
fi
