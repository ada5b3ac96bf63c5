# One command each: `make test`, `make demo`, `make lab`. Each sets up .venv itself.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build by default. For CUDA: make venv TORCH_SPEC=torch==2.13.0 TORCH_INDEX=<PyTorch CUDA wheel index> (README)
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
export PATH := $(abspath $(VENV))/bin:$(PATH)
export OMP_NUM_THREADS ?= 1
export MPLBACKEND ?= module://matplotlib_inline.backend_inline

# the self-study site and the browser tests (book/, tests/test_e2e.py)
-include mk/e2e.mk
E2E_DEPS := $(if $(wildcard mk/e2e.mk),e2e-deps,)
# one-node SLURM, PostgreSQL gradebook, gpu-check (launch/slurm/, tests/test_cluster.py)
-include mk/cluster.mk
CLUSTER_DEPS := $(if $(wildcard mk/cluster.mk),cluster-deps,)
# the course on JupyterHub: shared venv, configurable-http-proxy, `make hub` (grader/hub/, tests/test_hub.py)
-include mk/hub.mk
HUB_DEPS := $(if $(wildcard mk/hub.mk),hub-deps,)

.PHONY: venv sandbox-deps test demo lab labs notebooks student-install bench clean

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	@touch $@

venv: $(VENV)/.installed

# bubblewrap isolates student ranks during grading; without it grading refuses (GRADER_SANDBOX=off: unboxed on purpose)
sandbox-deps:
	@command -v bwrap >/dev/null || { if [ "$$(id -u)" = 0 ]; then \
	  (apt-get install -y -q bubblewrap >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q bubblewrap >/dev/null)); \
	  else echo "bubblewrap missing and not root: install it (sudo apt-get install bubblewrap), or grade unboxed on purpose with GRADER_SANDBOX=off"; fi; }

# two passes: everything but the timed lecture cells on both cores, then the lectures alone (their
# measured claims are asserted, and a neighbour's load must not move them)
test: venv sandbox-deps $(E2E_DEPS) $(CLUSTER_DEPS) $(HUB_DEPS)
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not serial" --durations=25 tests
	$(PY) -m pytest -q -m serial --durations=10 tests

demo: venv sandbox-deps
	$(PY) -m grader demo

lab: venv
	$(VENV)/bin/jupyter lab --notebook-dir=. $(LAB_ARGS)

# regenerate labs/ (the student release) from solutions/ (the nbgrader source)
labs: venv
	$(PY) -m grader release

# re-execute the lecture notebooks in place (CPU/gloo) so their committed outputs are fresh
notebooks: venv
	$(PY) -m grader execute-lectures

# what a student's account needs (labs, tpkit, launch, the rank side; no answer): make student-install DEST=/srv/tp-student
student-install: venv
	@test -n "$(DEST)" || { echo "usage: make student-install DEST=/path/to/folder"; exit 2; }
	$(PY) -m grader student-install "$(DEST)" $(if $(FORCE),--force,)

# cold check, warm check and class-scale autograde timings on this machine
bench: venv sandbox-deps
	$(PY) -m grader bench --n 20 --jobs 2

clean:
	rm -rf $(VENV) build .pytest_cache
