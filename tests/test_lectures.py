"""Every lecture notebook executes headless (papermill, CPU/gloo) and is committed executed."""
import glob
import json
import os
import re

import pytest

from grader.tools.lectures import execute_lecture, lecture_paths, machine_traces
from grader.autograde.nbgrader_tools import ROOT

LECTURES = lecture_paths()


@pytest.mark.parametrize("path", LECTURES, ids=[os.path.basename(p) for p in LECTURES])
def test_lecture_is_committed_executed(path):
    nb = json.load(open(path))
    code = [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    assert code, "a lecture without code"
    assert all(c.get("execution_count") for c in code), "commit the notebook executed: make notebooks"


@pytest.mark.serial          # timed cells: run alone (make test's second pass), never beside other tests
@pytest.mark.parametrize("path", LECTURES, ids=[os.path.basename(p) for p in LECTURES])
def test_lecture_executes(path, tmp_path):
    out = str(tmp_path / os.path.basename(path))
    seconds = execute_lecture(path, out)
    print(f"{os.path.basename(path)}: {seconds:.0f} s")


COMMITTED = LECTURES + sorted(glob.glob(os.path.join(ROOT, "labs", "week*", "*.ipynb"))
                              + glob.glob(os.path.join(ROOT, "solutions", "week*", "*.ipynb")))


@pytest.mark.parametrize("path", COMMITTED, ids=[os.path.relpath(p, ROOT) for p in COMMITTED])
def test_committed_notebook_is_clean(path):
    """No path of the machine that executed it; no citation of files a reader does not have."""
    text = open(path).read()
    assert not machine_traces(json.loads(text)), "absolute machine paths: re-execute with `make notebooks`"
    assert "REFERENCES" not in text and not re.search(r"course seed|seed 00\d", text), \
        "cite docs/sources.md, not the course's private notes"
