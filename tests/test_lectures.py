"""Every lecture notebook executes headless (papermill, CPU/gloo) and is committed executed."""
import json
import os
import tempfile

import pytest

from grader.lectures import execute_lecture, lecture_paths

LECTURES = lecture_paths()


@pytest.mark.parametrize("path", LECTURES, ids=[os.path.basename(p) for p in LECTURES])
def test_lecture_is_committed_executed(path):
    nb = json.load(open(path))
    code = [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    assert code, "a lecture without code"
    assert all(c.get("execution_count") for c in code), "commit the notebook executed: make notebooks"


@pytest.mark.parametrize("path", LECTURES, ids=[os.path.basename(p) for p in LECTURES])
def test_lecture_executes(path):
    out = os.path.join(tempfile.mkdtemp(), os.path.basename(path))
    seconds = execute_lecture(path, out)
    print(f"{os.path.basename(path)}: {seconds:.0f} s")
