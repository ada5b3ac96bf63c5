"""nbgrader autograde, end to end, per lab: the solution full marks, the stub zero, and for
Week 2 the kernel and notebook tampering (redefined check, edited or deleted locked cells, cells that
read the solutions or the instructor's files or write the gradebook)."""
import glob
import os
import shutil
import sqlite3

import pytest

from grader.nbgrader_tools import ROOT, autograde, nbgrader, scratch_course, weeks
from tests.corpus import FIXTURES, SECRET, build, load_manifest, plant_secret

WEEKS = weeks()


@pytest.fixture(scope="module")
def course():
    c = scratch_course(WEEKS)
    yield c
    shutil.rmtree(c, ignore_errors=True)


@pytest.mark.parametrize("week", WEEKS)
def test_autograde(course, week):
    planted = plant_secret()
    nbgrader(["generate_assignment", week, "--force"], course)
    subs = {"solution": build(week, {"base": "solution"}), "stub": build(week, {})}
    expect = {}
    if os.path.exists(os.path.join(FIXTURES, week, "manifest.json")):
        for name, spec in load_manifest(week)["submissions"].items():
            if spec.get("nbgrader_only"):
                subs[name] = build(week, spec, course=course)
                expect[name] = spec["expect"]
    rows = {r["student"]: r for r in autograde(course, week, subs)}
    sol, stub = rows["solution"], rows["stub"]
    assert sol["max_score"] > 0 and sol["score"] == sol["max_score"], f"solution: {sol}"
    assert stub["score"] == 0, f"stub: {stub}"
    for name, want in expect.items():
        for gid, verdict in want.items():
            got = rows[name]["cells"][gid]
            assert (got > 0) == (verdict == "pass"), f"{name}: {gid} scored {got}, expected {verdict}"
    # the gradebook holds every submission, graded
    assert set(rows) == set(subs)
    # nothing a notebook cell did reached the gradebook, the course, the home folder or the feedback
    with sqlite3.connect(os.path.join(course, "gradebook.db")) as db:
        tables = {r[0] for r in db.execute("select name from sqlite_master where type='table'")}
    assert "pwned" not in tables
    for folder in (course, ROOT, os.path.expanduser("~")):
        assert not os.path.exists(os.path.join(folder, "ESCAPED")), f"a notebook cell wrote into {folder}"
    for path in glob.glob(os.path.join(course, "autograded", "*", week, "*.ipynb")):
        assert SECRET not in open(path).read(), f"{path} holds the instructor's private file"
    os.unlink(planted)
