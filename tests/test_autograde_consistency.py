"""A failed, killed or mixed-user autograde never leaves the gradebook and autograded/ disagreeing.

Agreement, per submission: either autograded/<student>/<week>/ holds the notebook the gradebook's automatic
scores were computed from (nbgrader's own `determine_grade` of its grade cells gives the same scores), or the
gradebook has no automatic score for it (None, flagged for manual grading) and there is no autograded notebook.
A re-autograde that fails must never leave the previous run's scores standing for a notebook that is gone."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import nbformat
import pytest
from nbgrader import utils as nbgrader_utils

from grader.autograde.gradebooks import gradebook
from grader.autograde.nbgrader_tools import ROOT, course_api, nbgrader, scratch_course
from grader.tools.corpus import build

WEEK, NOTEBOOK = "week02", "tp_linear"


def submit(course: str, student: str, nb: dict):
    d = os.path.join(course, "submitted", student, WEEK)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, NOTEBOOK + ".ipynb"), "w") as f:
        json.dump(nb, f)


def autograded_path(course: str, student: str) -> str:
    return os.path.join(course, "autograded", student, WEEK, NOTEBOOK + ".ipynb")


def gradebook_auto(course: str, student: str) -> dict[str, tuple]:
    """{grade cell: (auto_score, needs_manual_grade)} of the student's submission in the course's gradebook."""
    with gradebook(os.path.join(course, "gradebook.db")) as gb:
        nb = gb.find_submission_notebook(NOTEBOOK, WEEK, student)
        return {g.name: (g.auto_score, g.needs_manual_grade) for g in nb.grades}


def notebook_scores(path: str) -> dict[str, float]:
    """What nbgrader's SaveAutoGrades computes from a notebook's grade cells."""
    nb = nbformat.read(path, as_version=4)
    return {c.metadata.nbgrader.grade_id: nbgrader_utils.determine_grade(c)[0]
            for c in nb.cells if nbgrader_utils.is_grade(c)}


def assert_agree(course: str, student: str):
    auto = gradebook_auto(course, student)
    path = autograded_path(course, student)
    if os.path.exists(path):
        assert {k: s for k, (s, _) in auto.items()} == notebook_scores(path), \
            f"the gradebook's scores {auto} are not those of {path}"
    else:
        assert all(s is None and manual for s, manual in auto.values()), \
            f"{path} is gone, but the gradebook still scores it: {auto}"


def full_marks(course: str, student: str) -> bool:
    auto = gradebook_auto(course, student)
    return all(s is not None and s > 0 for s, _ in auto.values())


@pytest.fixture(scope="module")
def graded_course():
    """A course where student `s` was autograded once (the solution: full marks)."""
    course = scratch_course([WEEK])
    nbgrader(["generate_assignment", WEEK, "--force"], course)
    submit(course, "s", build(WEEK, {"base": "solution"}))
    result = course_api(course).autograde(WEEK, "s", force=True, create=True)
    assert result["success"], result.get("error") or result.get("log")
    assert full_marks(course, "s")
    assert_agree(course, "s")
    yield course
    shutil.rmtree(course, ignore_errors=True)


@pytest.fixture
def course(graded_course):
    """A fresh copy of the graded course, with `s`'s stub resubmitted (a regrade must change the score)."""
    # short: the kernel's sockets live below the temporary folder
    copy = os.path.join(tempfile.mkdtemp(prefix="agc-"), "c")
    shutil.copytree(graded_course, copy)
    submit(copy, "s", build(WEEK, {}))
    yield copy
    shutil.rmtree(os.path.dirname(copy), ignore_errors=True)


def test_a_kernel_that_dies_leaves_no_old_score(course, monkeypatch):
    """The issue's `!nbgrader autograde` in a cell: the boxed kernel died before replying to kernel_info.
    nbgrader removes autograded/s/; the gradebook must not keep the previous run's full marks."""
    from grader.autograde import plugin

    def dies(self, nb, resources):
        raise RuntimeError("Kernel died before replying to kernel_info")
    monkeypatch.setattr(plugin.DeferredExecute, "preprocess", dies)
    result = course_api(course).autograde(WEEK, "s", force=True, create=True)
    assert not result["success"]
    assert not os.path.exists(autograded_path(course, "s"))
    assert_agree(course, "s")


def test_a_worker_killed_mid_run_leaves_no_old_score(course, monkeypatch):
    """The class grader kills a worker past its timeout, mid-execution: autograded/s/ then holds the sanitized,
    never executed copy nbgrader wrote before running it. Neither it nor the old score may stand."""
    import time
    from grader.autograde import class_autograde, plugin
    from grader.autograde.class_autograde import autograde_class
    monkeypatch.setattr(class_autograde, "WORKER_TIMEOUT", 6.0)   # past the sanitizing, into the run
    monkeypatch.setattr(plugin.DeferredExecute, "preprocess", lambda self, nb, resources: time.sleep(600))
    with pytest.raises(RuntimeError, match="autograde failed for s"):
        autograde_class(course, WEEK, students=["s"], out=open(os.devnull, "w"))
    assert not os.path.exists(autograded_path(course, "s"))
    assert_agree(course, "s")


def test_a_failure_after_the_scores_are_saved_leaves_no_new_score(course, monkeypatch):
    """The notebook cannot be written after SaveAutoGrades stored its scores (a full disk): nbgrader removes
    autograded/s/; the class grader must not leave the new scores for a notebook that was never written."""
    from nbconvert.writers import FilesWriter
    from grader.autograde.class_autograde import autograde_class

    writes = []     # per worker (a forked copy): the sanitized notebook is written first, then the graded one

    def disk_full(self, output, resources, notebook_name=None, **kw):
        writes.append(notebook_name)
        if len(writes) == 2:
            raise OSError(28, "No space left on device")
        return real_write(self, output, resources, notebook_name=notebook_name, **kw)
    real_write = FilesWriter.write
    monkeypatch.setattr(FilesWriter, "write", disk_full)
    with pytest.raises(RuntimeError, match="autograde failed for s"):
        autograde_class(course, WEEK, students=["s"], out=open(os.devnull, "w"))
    assert_agree(course, "s")


INSTRUCTOR = 4242       # no account needed: a uid that owns the course and is not root
# a Python the instructor's uid can run and start kernels with: this venv's, unless it lives under /root (a pyenv
# build), else the hub's shared venv (`make hub-deps`), which holds the same packages
PYTHONS = [sys.executable, os.path.join(os.environ.get("HUB_PREFIX", "/opt/tp-course"), "venv", "bin", "python")]


def as_instructor(argv: list[str], course: str, home: str, python: str) -> subprocess.CompletedProcess:
    """`python ARGV` in the course as the instructor's uid (setpriv), with this repository first on the path."""
    env = {"HOME": home, "PATH": os.path.dirname(python) + os.pathsep + "/usr/bin:/bin",
           "PYTHONPATH": ROOT, "LANG": "C.UTF-8", "GRADER_CHECK_SERVER": "off", "OMP_NUM_THREADS": "1"}
    return subprocess.run(["setpriv", f"--reuid={INSTRUCTOR}", f"--regid={INSTRUCTOR}", "--clear-groups",
                           python, *argv], cwd=course, env=env, capture_output=True, text=True, timeout=600)


def instructor_python(course: str, home: str) -> str | None:
    """The first of PYTHONS with which the instructor's uid runs nbgrader in a child of itself, as a kernel starts."""
    child = "import subprocess, sys; subprocess.run([sys.executable, '-m', 'nbgrader', '--version'], check=True)"
    for python in filter(os.path.exists, PYTHONS):
        if as_instructor(["-c", child], course, home, python).returncode == 0:
            return python
    return None


def as_root(args: list[str], course: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", *args], cwd=course, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture
def instructors_course():
    """A course the instructor (uid INSTRUCTOR) owns, readable by them from a folder root made for it; its
    gradebook made by root (`sudo nbgrader generate_assignment`), so root's next autograde must hand it over."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv: grades once as root, once as another uid")
    top = tempfile.mkdtemp(prefix="agu-")
    os.chmod(top, 0o755)
    course, home = os.path.join(top, "c"), os.path.join(top, "home")
    scratch = scratch_course([WEEK])
    shutil.copytree(scratch, course)
    shutil.rmtree(scratch)
    os.makedirs(home)
    for d, _, files in os.walk(top):
        for p in [d, *(os.path.join(d, f) for f in files)]:
            os.chown(p, INSTRUCTOR, INSTRUCTOR)
    python = instructor_python(course, home)
    if python is None:
        shutil.rmtree(top)
        pytest.skip(f"uid {INSTRUCTOR} can start none of {PYTHONS} from a child process (a kernel)")
    nbgrader(["generate_assignment", WEEK, "--force"], course)
    yield course, home, python
    shutil.rmtree(top, ignore_errors=True)


def submit_as_instructor(course: str, student: str, nb: dict):
    submit(course, student, nb)
    for d, _, files in os.walk(os.path.join(course, "submitted")):
        for p in [d, *(os.path.join(d, f) for f in files)]:
            os.chown(p, INSTRUCTOR, INSTRUCTOR)


def test_root_and_the_instructor_take_turns(instructors_course):
    """`nbgrader autograde` and `generate_feedback` as root, then as the instructor: the instructor's run regrades
    root's student and adds a new one (root left no folder or gradebook of its own), and the gradebook agrees."""
    course, home, python = instructors_course
    submit_as_instructor(course, "a", build(WEEK, {"base": "solution"}))
    for step in (["autograde", WEEK, "--force"], ["generate_feedback", WEEK, "--force"]):
        p = as_root(["nbgrader", *step], course)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    submit_as_instructor(course, "b", build(WEEK, {"base": "solution"}))
    for step in (["autograde", WEEK, "--force"], ["generate_feedback", WEEK, "--force"]):
        p = as_instructor(["-m", "nbgrader", *step], course, home, python)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    for student in ("a", "b"):
        assert full_marks(course, student)
        assert_agree(course, student)
    assert os.stat(os.path.join(course, "gradebook.db")).st_uid == INSTRUCTOR


def test_a_folder_left_by_an_old_root_run_is_an_error_naming_the_fix(instructors_course):
    """Folders a root run left without handing them over (an older config, or a run as another user): the
    instructor's class grader stops before grading anyone and says whose they are and what to run; nbgrader's own
    run for a student without an old folder says the same, and leaves that student not autograded."""
    course, home, python = instructors_course
    os.chown(os.path.join(course, "gradebook.db"), INSTRUCTOR, INSTRUCTOR)
    for student in ("a", "b"):
        submit_as_instructor(course, student, build(WEEK, {}))
    old = os.path.join(course, "autograded", "a", WEEK)
    os.makedirs(old)            # as root, owned by root: what such a run left
    shutil.copy(os.path.join(course, "submitted", "a", WEEK, NOTEBOOK + ".ipynb"), old)
    p = as_instructor(["-m", "grader", "autograde", WEEK, "--course", course], course, home, python)
    assert p.returncode != 0
    assert f"autograded belongs to root, and you ({INSTRUCTOR})" in p.stderr, p.stderr[-2000:]
    assert f"sudo chown -R {INSTRUCTOR}: {os.path.join(course, 'autograded')}" in p.stderr, p.stderr[-2000:]
    p = as_instructor(["-m", "nbgrader", "autograde", WEEK, "--student", "b", "--force"], course, home, python)
    assert p.returncode != 0
    assert "autograded belongs to root" in p.stdout + p.stderr, (p.stdout + p.stderr)[-3000:]
    assert_agree(course, "b")
