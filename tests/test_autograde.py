"""nbgrader autograde, end to end, per lab: the solution full marks, the stub zero, and for
Week 2 the kernel and notebook tampering (redefined check, edited or deleted locked cells)."""
import shutil

import pytest

from grader.nbgrader_tools import autograde, nbgrader, scratch_course, weeks
from tests.corpus import FIXTURES, build, load_manifest
import os

WEEKS = weeks()


@pytest.fixture(scope="module")
def course():
    c = scratch_course(WEEKS)
    yield c
    shutil.rmtree(c, ignore_errors=True)


@pytest.mark.parametrize("week", WEEKS)
def test_autograde(course, week):
    nbgrader(["generate_assignment", week, "--force"], course)
    subs = {"solution": build(week, {"base": "solution"}), "stub": build(week, {})}
    expect = {}
    if os.path.exists(os.path.join(FIXTURES, week, "manifest.json")):
        for name, spec in load_manifest(week)["submissions"].items():
            if spec.get("nbgrader_only"):
                subs[name] = build(week, spec)
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
