# Included by the Makefile. The course on JupyterHub on this machine (grader/hub/, tests/test_hub.py):
#   make hub-deps  the shared venv $(HUB_VENV), built with a system Python every user can run (/usr/bin/python3,
#                  not one under /root): the course venv's packages (copied when the Python minor versions match,
#                  else installed from pip) + jupyterhub; the student install of the course (labs, tpkit, launch,
#                  grader; no reference/, solutions/ or gradebook) on its path; a kernel that starts without the
#                  hub's tokens; nbgrader's Exchange.root; the formgrader off by default (on for the instructor);
#                  configurable-http-proxy from npm into $(HUB_PREFIX)/proxy
#   make hub       start the hub as root (PAM users, LocalProcessSpawner): python grader/hub/start.py
HUB_PREFIX ?= /opt/tp-course
HUB_VENV := $(HUB_PREFIX)/venv
HUB_PYTHON ?= /usr/bin/python3
HUB_PIP := "jupyterhub>=5,<7"
HUB_PROXY := $(HUB_PREFIX)/proxy/node_modules/.bin/configurable-http-proxy

.PHONY: hub-deps hub

# all of it needs root (a machine-wide venv and exchange); as another user it says so and the hub test skips
hub-deps: venv
	@if [ "$$(id -u)" != 0 ]; then echo "warning: hub-deps: not root: tests/test_hub.py will skip (run make hub-deps as root)"; exit 0; fi; \
	  if [ ! -x $(HUB_PYTHON) ]; then echo "warning: hub-deps: no $(HUB_PYTHON) (apt-get install python3-venv): tests/test_hub.py will skip"; exit 0; fi; \
	  $(MAKE) --no-print-directory $(HUB_VENV)/.installed $(HUB_VENV)/.course $(HUB_PROXY) || \
	  echo "warning: hub-deps failed (no network to PyPI or npm?): tests/test_hub.py will skip"

$(HUB_VENV)/.installed: $(VENV)/.installed mk/hub.mk
	@test -x $(HUB_VENV)/bin/python || $(HUB_PYTHON) -m venv $(HUB_VENV)
	@sp=$$($(HUB_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))'); \
	if [ "$$($(HUB_VENV)/bin/python -c 'import sys; print(sys.version_info[:2])')" = "$$($(PY) -c 'import sys; print(sys.version_info[:2])')" ]; then \
	  echo "hub-deps: copying $(VENV)'s packages into $(HUB_VENV) (same Python minor version, no download)"; \
	  rm -rf $$sp && mkdir -p $$sp && cp -a $$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/. $$sp/; \
	  rm -rf $$sp/__editable__*tp_course* $$sp/tp_course-*.dist-info; \
	  for d in etc share; do test -d $(VENV)/$$d && cp -a $(VENV)/$$d $(HUB_VENV)/; done; \
	  for f in $(VENV)/bin/*; do case "$$(basename $$f)" in python*|activate*|Activate*) continue;; esac; \
	    if head -c 200 $$f | head -n 1 | grep -q '^#!.*python'; then \
	      sed "1s|^#!.*|#!$(abspath $(HUB_VENV))/bin/python|" $$f > $(HUB_VENV)/bin/$$(basename $$f); chmod 755 $(HUB_VENV)/bin/$$(basename $$f); fi; done; \
	else \
	  $(HUB_VENV)/bin/pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) && \
	  $(HUB_VENV)/bin/pip install -q "nbgrader>=0.9.6,<0.10" "papermill>=2.6" "jupyterlab>=4.2" "ipykernel>=6.29" \
	    "matplotlib>=3.8" "nbformat>=5.9" "nbclient>=0.10"; fi
	$(HUB_VENV)/bin/pip install -q $(HUB_PIP)
	@# soupsieve 2.6+ uses possessive regex quantifiers, which Debian 12's Python 3.11.2 gets wrong (nbgrader's
	@# generate_feedback then fails on `img:not([alt])`): an older soupsieve where the system Python needs one
	@$(HUB_VENV)/bin/python -c "import soupsieve; soupsieve.compile('img:not([alt])')" 2>/dev/null || \
	  $(HUB_VENV)/bin/pip install -q "soupsieve<2.6"
	$(HUB_VENV)/bin/python grader/hub/start.py --install-config
	@chmod -R a+rX $(HUB_PREFIX)
	@touch $@

# the student install: what a student's kernel and `python -m grader check` import, refreshed when the course changes
$(HUB_VENV)/.course: $(HUB_VENV)/.installed $(shell find grader launch tpkit labs -type f -not -path '*__pycache__*' 2>/dev/null)
	$(HUB_VENV)/bin/python grader/hub/start.py --install-course
	@touch $@

$(HUB_PROXY):
	@command -v npm >/dev/null || { echo "hub-deps: no npm here (apt-get install npm)"; exit 1; }
	npm install -q --no-audit --no-fund --prefix $(HUB_PREFIX)/proxy configurable-http-proxy@4 >/dev/null
	@chmod -R a+rX $(HUB_PREFIX)/proxy

hub: hub-deps
	$(HUB_VENV)/bin/python grader/hub/start.py
