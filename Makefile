# The two commands a new user runs (as root on a fresh Debian 12 machine):
#   make demo   venv + local Slurm cluster with simulated GPUs + a short demo
#   make test   lint, type check, unit and end-to-end tests
# Debian's Python, not a per-user one (pyenv under /root): jobs, TaskProlog and the
# simulated jobs run as other users and must be able to execute the venv's python.
PY ?= /usr/bin/python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: all venv demo test unit e2e lint devcluster-up devcluster-down clean

all: test

$(STAMP): setup.cfg pyproject.toml
	@$(PY) -c 'import ensurepip, venv' 2>/dev/null || { apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-venv python3-dev; }
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

venv: $(STAMP)

# Installs the Debian packages it needs (slurm*, munge, mariadb-server) when missing.
devcluster-up: venv
	$(BIN)/colloc devcluster up

devcluster-down: venv
	$(BIN)/colloc devcluster down

demo: venv
	$(BIN)/colloc demo

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy slurm_colloc estimators prolog epilog
	$(BIN)/python tools/check_architecture.py

unit: venv
	$(BIN)/pytest -q tests/unit

e2e: venv
	$(BIN)/pytest -q tests/e2e

test: venv lint
	@command -v chromium-headless-shell >/dev/null || [ "$$(id -u)" != 0 ] || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium-headless-shell; }
	$(BIN)/pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache
