# Included by the Makefile. The class beyond one machine, on real engines (tests/test_cluster.py):
#   make cluster-deps  Debian's slurm-wlm, munge and postgresql through apt, when missing (root, or sudo)
#   make cluster       the tests: a one-node SLURM (array job of class slices, a torchrun training job) and
#                      a shared PostgreSQL gradebook, daemons started in a temp dir and stopped after
#   make gpu-check     on a CUDA machine: the install, every lab on NCCL, the lectures' GPU cells (one table)
CLUSTER_APT := slurm-wlm munge postgresql

.PHONY: cluster-deps cluster gpu-check

cluster-deps:
	@missing=; for b in /usr/sbin/slurmctld /usr/sbin/slurmd /usr/sbin/munged; do [ -x $$b ] || missing=1; done; \
	  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing=1; \
	  if [ -z "$$missing" ]; then exit 0; fi; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO=sudo; else \
	    echo "warning: cluster-deps: not root and no sudo: tests/test_cluster.py will skip (install $(CLUSTER_APT))"; exit 0; fi; \
	  if ! command -v apt-get >/dev/null; then \
	    echo "warning: cluster-deps: no apt-get here: tests/test_cluster.py will skip (install $(CLUSTER_APT))"; exit 0; fi; \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $(CLUSTER_APT) >/dev/null && \
	  echo "installed $$(/usr/sbin/slurmd -V), munge, $$(ls -d /usr/lib/postgresql/*/ | head -n 1)"

cluster: venv cluster-deps
	$(PY) -m pytest -q --durations=10 tests/test_cluster.py

gpu-check: venv
	$(PY) -m grader gpu-check
