# Included by the Makefile. The self-study site and the browser tests' dependencies.
#   make book      build/book/index.html from the notebooks present (offline, nothing executed)
#   make e2e-deps  Debian chromium (apt, when missing) + playwright, jupyter-book<2, MathJax (pip, .venv)
#   make e2e       the browser tests (tests/test_e2e.py): the built site and JupyterLab
# No `playwright install`: playwright drives Debian's /usr/bin/chromium through executable_path.
CHROMIUM ?= /usr/bin/chromium
BOOK_PIP := "jupyter-book>=1.0.4,<2" "django-static-mathjax==3.2.2.1"
E2E_PIP := "playwright>=1.45,<2"

.PHONY: book book-deps e2e-deps e2e

$(VENV)/.book-deps: $(VENV)/.installed
	$(PY) -m pip install -q $(BOOK_PIP)
	@touch $@

book-deps: $(VENV)/.book-deps

book: venv book-deps
	$(PY) book/build.py

$(CHROMIUM):
	@if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  (command -v apt-get >/dev/null || { echo "e2e-deps: no apt-get here; install chromium yourself and set CHROMIUM=/path/to/chromium"; exit 1; }) && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null && \
	  echo "installed $$($(CHROMIUM) --version)"

$(VENV)/.e2e-deps: $(VENV)/.book-deps
	$(PY) -m pip install -q $(E2E_PIP)
	@touch $@

e2e-deps: venv $(CHROMIUM) $(VENV)/.e2e-deps

e2e: e2e-deps
	CHROMIUM=$(CHROMIUM) $(PY) -m pytest -q --durations=10 tests/test_e2e.py
