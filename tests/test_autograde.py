"""nbgrader autograde, end to end, per lab: the solution full marks, the stub zero, and for
Week 2 the kernel and notebook tampering (redefined check, edited or deleted locked cells, cells that
read the solutions or the instructor's files or write the gradebook)."""
import glob
import os
import shutil
import sqlite3

import pytest

from grader.autograde.class_autograde import autograde
from grader.autograde.nbgrader_tools import ROOT, nbgrader, scratch_course, weeks
from grader.tools.corpus import FIXTURES, SECRET, build, load_manifest, plant_secret

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


def test_a_class_graded_in_slices_merges_into_one_gradebook(course):
    """Two slices graded into their own gradebooks (as two SLURM array tasks would), then merged with
    nbgrader's API into the course's gradebook: every grade lands once, nothing is lost."""
    import json
    from grader.autograde.class_autograde import autograde_class, slice_of
    from grader.autograde.gradebooks import merge
    from grader.autograde.nbgrader_tools import gradebook_rows
    nbgrader(["generate_assignment", "week02", "--force"], course)
    subs = {"s0": build("week02", {"base": "solution"}), "s1": build("week02", {}),
            "s2": build("week02", {"base": "solution"})}
    for student, nb in subs.items():
        d = os.path.join(course, "submitted", student, "week02")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "tp_linear.ipynb"), "w") as f:
            json.dump(nb, f)
    slices = [os.path.join(course, f"gradebook-{k}.db") for k in range(2)]
    for k, db in enumerate(slices):
        autograde_class(course, "week02", jobs=2, students=slice_of(list(subs), f"{k}/2"), db=db,
                        out=open(os.devnull, "w"))
    assert merge(os.path.join(course, "gradebook.db"), slices) == 3
    rows = {r["student"]: r for r in gradebook_rows(course, "week02")}
    assert rows["s0"]["score"] == rows["s2"]["score"] == rows["s0"]["max_score"] > 0
    assert rows["s1"]["score"] == 0
    with pytest.raises(ValueError, match="each student belongs to exactly one slice"):
        merge(os.path.join(course, "gradebook.db"), slices + slices[:1])


def test_a_worker_past_its_timeout_is_killed_and_named(course, monkeypatch):
    """A submission whose notebook never ends cannot stall a class: its worker is killed at the worker timeout
    with everything it started, and the run names the student instead of hanging. Nothing of it is left in
    the temporary folder: not the killed worker's kernel box, not the run's reports."""
    import tempfile
    import time
    from grader.autograde import class_autograde
    monkeypatch.setattr(class_autograde, "WORKER_TIMEOUT", 10.0)
    tmp = tempfile.mkdtemp(prefix="class-tmp-")    # not pytest's tmp_path: a kernel socket's path must stay short
    monkeypatch.setattr(tempfile, "tempdir", tmp)
    nbgrader(["generate_assignment", "week02", "--force"], course)
    slow = build("week02", {"base": "solution", "append_cell": "import time\ntime.sleep(600)"})
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="autograde failed for never_ends"):
        autograde(course, "week02", {"never_ends": slow})
    assert time.monotonic() - t0 < 90           # two tries of 10 s each, then the verdict
    assert os.listdir(tmp) == []
    os.rmdir(tmp)
