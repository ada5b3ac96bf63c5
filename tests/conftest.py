import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
# every `python -m grader check` of the suite runs in its own process: a check server (grader/tools/check_server.py)
# would outlive the suite; tests/test_check_server.py starts its own
os.environ["GRADER_CHECK_SERVER"] = "off"
# nbgrader shells out to alembic: the venv's bin must be on PATH
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")


def pytest_configure(config):
    # `make test` relies on --dist loadgroup keeping each xdist_group on one worker; pytest 9.2 silently stops
    # that (pytest-dev/pytest-xdist#1386), and the e2e tests would build one site on two workers at once
    version = tuple(int(x) for x in pytest.__version__.split(".")[:2])
    if getattr(config.option, "dist", None) == "loadgroup" and version >= (9, 2):
        raise pytest.UsageError(f"pytest {pytest.__version__} breaks --dist loadgroup: install the versions "
                                "pyproject.toml pins (pip install -e '.[dev]')")
    config.addinivalue_line("markers", "serial: timed; `make test` runs these alone, after the parallel pass")


_CORPUS_ROWS = []


def pytest_runtest_logreport(report):
    """Rows of the bad-submission corpus, recorded by tests/test_labs.py (from xdist workers too)."""
    if report.when == "call":
        _CORPUS_ROWS.extend(v for k, v in report.user_properties if k == "corpus_row")


def pytest_terminal_summary(terminalreporter):
    """The bad-submission corpus as a table: case, verdict, seconds, leftover processes."""
    if not _CORPUS_ROWS:
        return
    tr = terminalreporter
    tr.write_sep("=", "bad-submission corpus")
    tr.write_line(f"{'case':<34} {'seconds':>7} {'left':>4}  verdict per grade cell")
    for case, verdict, secs, left in sorted(_CORPUS_ROWS):
        tr.write_line(f"{case:<34} {secs:>7.1f} {left:>4}  {verdict}")

