# The two commands a new user runs (as root on a fresh Debian machine):
#   make demo   venv + local Slurm cluster (Slurm 26.05) with simulated GPUs + a short demo
#   make test   lint, type check, unit and end-to-end tests on Slurm 26.05, and the
#               end-to-end core on every other supported release (24.11)
# Slurm runs from Debian's packages in a root filesystem per release
# (slurm_colloc/devcluster/rootfs.py, built on first use under /var/lib/colloc-rootfs);
# the suite runs inside it, with the project in that root's Python (.venv-slurm-<release>).
# Debian's Python, not a per-user one (pyenv under /root): jobs, TaskProlog and the
# simulated jobs run as other users and must be able to execute the venv's python.
PY ?= /usr/bin/python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

SLURM ?= 26.05
OTHER_SLURM ?= 24.11
# a command inside a release's root filesystem (built or refreshed first), with the
# project in the venv the root's Python made (.venv-slurm-<release>, this checkout)
IN_ROOT = $(BIN)/colloc devcluster rootfs --release
INNER = make --no-print-directory PY=/usr/bin/python3 VENV=$(CURDIR)/.venv-slurm-
E2E_CORE = tests/e2e/test_submit_path.py tests/e2e/test_node_path.py \
	tests/e2e/test_adversarial.py tests/e2e/test_attack_*.py tests/e2e/test_multinode.py \
	tests/e2e/test_site_hooks.py tests/e2e/test_jobstats_coexist.py \
	tests/e2e/test_checkpoint_resume.py

.PHONY: all venv demo demo-here test test-here e2e-core unit e2e lint devcluster-up \
	devcluster-down clean

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
	$(BIN)/colloc devcluster up --slurm $(SLURM)

devcluster-down: venv
	$(BIN)/colloc devcluster down --slurm $(SLURM)

demo: venv
	$(IN_ROOT) $(SLURM) -- $(INNER)$(SLURM) demo-here

demo-here: venv
	$(BIN)/colloc demo

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy slurm_colloc prolog epilog
	$(BIN)/python tools/check_architecture.py

unit: venv
	$(BIN)/pytest -q tests/unit

e2e: venv
	$(BIN)/pytest -q tests/e2e

test: venv lint
	$(IN_ROOT) $(SLURM) -- $(INNER)$(SLURM) test-here
	$(IN_ROOT) $(OTHER_SLURM) -- $(INNER)$(OTHER_SLURM) e2e-core

# inside a release's root filesystem (as `make test` runs them)
test-here: venv
	$(BIN)/pytest -q tests

e2e-core: venv
	$(BIN)/pytest -q $(E2E_CORE)

clean:
	rm -rf $(VENV) .venv-slurm-* build *.egg-info .mypy_cache .ruff_cache .pytest_cache
