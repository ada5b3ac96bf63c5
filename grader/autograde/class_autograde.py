"""Grade a class: `python -m grader autograde WEEK --jobs N` in an nbgrader course folder.

One driver process imports nbgrader, torch and the grader once, adds every student to the gradebook
through nbgrader's API, then forks one worker per submission, N at a time. A worker runs nbgrader's
`Autograde` for its student in-process (`NbGraderAPI.autograde`): the boxed kernel, the trusted
checks in their own sandboxed job, the gradebook writes. So a submission pays for its kernel and its
ranks, not for another Python, nbgrader and torch start. Workers share nothing but gradebook.db, which
SQLite serialises; a student whose run still fails (a locked database) is graded again alone at the end.
With a shared gradebook on PostgreSQL (nbgrader's `db_url`), drivers on many machines write into one
database; a student another worker is grading at that moment is an error, never graded twice at once.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time

from grader.autograde.nbgrader_tools import CONFIG, course_api, course_config, gradebook_rows
from grader.judge.timeouts import EXECUTE_TIMEOUT


def students_with_submissions(course: str, week: str) -> list[str]:
    d = os.path.join(course, "submitted")
    if not os.path.isdir(d):
        return []
    return sorted(s for s in os.listdir(d) if os.path.isdir(os.path.join(d, s, week)))


def add_students(db_url: str, students: list[str]):
    from grader.autograde.gradebooks import gradebook
    with gradebook(db_url) as gb:
        for s in students:
            gb.update_or_create_student(s)


def slice_of(students: list[str], spec: str) -> list[str]:
    """'K/N': the K-th of N interleaved slices (K = 0..N-1) of the sorted students."""
    try:
        k, n = (int(x) for x in spec.split("/"))
        assert 0 <= k < n
    except (ValueError, AssertionError):
        raise SystemExit(f"--slice {spec!r}: give K/N with 0 <= K < N, e.g. --slice 0/4") from None
    return sorted(students)[k::n]


TAKEN = 3   # a worker's exit status: another worker holds this student (grader.autograde.gradebooks.claim)
# one submission, whole: nbgrader's run of every cell (each bounded by EXECUTE_TIMEOUT) and the trusted checks
WORKER_TIMEOUT = 3 * EXECUTE_TIMEOUT


def _grade_in_child(course: str, week: str, student: str, report: str, db_url: str, tmp: str):
    """In a forked worker: autograde one submission; write nbgrader's result, then leave. Its temporary
    folders (the kernel's box, the job's) go under `tmp`, which the driver removes even if it kills the worker."""
    from grader.autograde.gradebooks import Taken, claim
    code = 1
    try:
        tempfile.tempdir = tmp
        os.environ["TMPDIR"] = tmp
        # this worker's and its kernel's chatter (nbgrader's SQLAlchemy warnings, ipykernel's banner) go to
        # the student's log, not the instructor's console
        log = os.open(report[:-len(".json")] + ".log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(log, 1)
        os.dup2(log, 2)
        try:
            with claim(db_url, week, student):
                result = course_api(course, db_url).autograde(week, student, force=True, create=True)
            out = {k: str(v) if k != "success" else bool(v) for k, v in result.items()}
        except Taken as e:
            out = {"success": False, "taken": str(e)}
        with open(report, "w") as f:
            json.dump(out, f)
        code = 0 if out["success"] else TAKEN if "taken" in out else 1
    finally:
        os._exit(code)


def _warm():
    """What every worker needs, imported once in the driver (forked workers share it)."""
    import nbgrader.apps.api  # noqa: F401
    import torch  # noqa: F401
    import grader.judge.job  # noqa: F401
    import grader.autograde.plugin  # noqa: F401
    import papermill  # noqa: F401


def autograde_class(course: str, week: str, jobs: int = 2, students: list[str] | None = None,
                    out=sys.stdout, db: str | None = None) -> dict[str, float]:
    """Autograde every submission of `week` (or `students`); returns {student: seconds}. Raises if one cannot
    be graded. `db`: grade into this gradebook file (made from the course's, without its submissions, if new)
    instead of the course's: one slice of a class graded apart (`grader.autograde.gradebooks`); or a database URL
    (a shared gradebook). Default: the course config's `CourseDirectory.db_url`."""
    students = students or students_with_submissions(course, week)
    if not students:
        raise SystemExit(f"no submissions of {week} under {os.path.join(course, 'submitted')}/<student>/{week}/")
    if not os.path.exists(os.path.join(course, CONFIG)):
        raise SystemExit(f"{course} is not an nbgrader course of this repository: {CONFIG} is missing there")
    _warm()
    from nbgrader.coursedir import CourseDirectory
    from grader.autograde.outputs import fail_unless_regradable, give_to_course_owner
    if db and "://" not in db and not os.path.exists(db):
        from grader.autograde.gradebooks import new_slice
        new_slice(os.path.join(course, "gradebook.db"), db)
        give_to_course_owner(course, [db])   # made by root: the instructor grades this slice again
    coursedir = CourseDirectory(config=course_config(course, db))
    try:
        fail_unless_regradable(coursedir, week, students)
    except PermissionError as e:
        raise SystemExit(str(e)) from None
    add_students(coursedir.db_url, students)
    workers = _Workers(coursedir, week, out)
    n = len(students)
    try:
        retry = workers.run(students, max(1, jobs), lambda k: f"[{k}/{n}]")
        still = workers.run(retry, 1, lambda k: "[retry]")
        if still or workers.taken:
            raise RuntimeError("autograde failed for " + ", ".join(still + workers.taken) + ":\n" +
                               "\n".join(workers.why(s) for s in workers.taken + still))
    finally:
        shutil.rmtree(workers.reports, ignore_errors=True)   # the workers' reports and logs, read above
    return workers.seconds


class _Workers:
    """Forked workers, one submission each, `parallel` at a time; one that outlives WORKER_TIMEOUT is killed
    with everything it started and counts as failed (a class run never stalls on one submission)."""

    def __init__(self, coursedir, week: str, out):
        self.coursedir, self.week, self.out = coursedir, week, out
        self.course, self.db_url = coursedir.root, coursedir.db_url
        self.reports = tempfile.mkdtemp(prefix="grader-class-")
        self.seconds: dict[str, float] = {}
        self.taken: list[str] = []
        self.t0 = time.monotonic()

    def run(self, queue: list[str], parallel: int, label) -> list[str]:
        running: dict[int, tuple[str, float, str]] = {}
        failed, done, queue = [], 0, list(queue)
        while queue or running:
            while queue and len(running) < parallel:
                student = queue.pop(0)
                # short: the kernel's sockets live below it, and a socket's path has at most 107 bytes
                tmp = tempfile.mkdtemp(prefix="w", dir=self.reports)
                pid = os.fork()
                if pid == 0:
                    os.setpgid(0, 0)     # the worker and all it starts: one group, killed together on timeout
                    _grade_in_child(self.course, self.week, student, self._report(student), self.db_url, tmp)
                running[pid] = (student, time.monotonic(), tmp)
            pid, code = self._next_exit(running)
            student, started, tmp = running.pop(pid)
            shutil.rmtree(tmp, ignore_errors=True)
            self.seconds[student] = time.monotonic() - started
            if code == TAKEN:
                self.taken.append(student)
            elif code != 0:
                failed.append(student)
                self._discard(student)
            done += 1
            state = {0: "ok", TAKEN: "taken by another worker", -9: "killed at the worker timeout"}.get(
                code, "will retry")
            print(f"{label(done)} {student}: {self.seconds[student]:.1f} s ({state}), "
                  f"{time.monotonic() - self.t0:.0f} s elapsed", file=self.out, flush=True)
        return failed

    def _next_exit(self, running: dict[int, tuple[str, float, str]]) -> tuple[int, int]:
        """(pid, exit status) of the next worker to end; kills one that has run past WORKER_TIMEOUT."""
        while True:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid in running:
                return pid, os.waitstatus_to_exitcode(status)
            if pid == 0:
                for p, (_, started, _) in running.items():
                    if time.monotonic() - started > WORKER_TIMEOUT:
                        try:
                            os.killpg(p, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                time.sleep(0.05)

    def _discard(self, student: str):
        """A failed or killed run may leave old or new scores beside a removed or never-executed notebook: leave
        the student not autograded instead (grader.autograde.outputs), unless another worker grades them now."""
        from grader.autograde.gradebooks import Taken, claim
        from grader.autograde.outputs import discard
        from sqlalchemy.exc import SQLAlchemyError
        try:
            with claim(self.db_url, self.week, student):
                discard(self.coursedir, self.week, student)
        except Taken:
            pass        # that worker's run leaves the student's scores and folder in agreement
        except (OSError, SQLAlchemyError) as e:
            print(f"{student}: could not clear what the failed run left ({type(e).__name__}: {e}); the gradebook may "
                  f"hold a score its autograded notebook does not show until {student} is autograded again",
                  file=self.out, flush=True)

    def _report(self, student: str) -> str:
        return os.path.join(self.reports, f"{student}.json")

    def why(self, student: str) -> str:
        try:
            with open(self._report(student)) as f:
                r = json.load(f)
        except (OSError, ValueError):
            return f"{student}: the worker ended without a report (killed at the {WORKER_TIMEOUT:.0f} s timeout?)"
        return r["taken"] if "taken" in r else f"{student}: {r.get('log', '')[-3000:]}\n{r.get('error', '')[-1500:]}"


def summary(seconds: dict[str, float], wall: float) -> str:
    n = len(seconds)
    return (f"{n} submissions in {wall:.0f} s: {60 * n / wall:.1f} submissions/minute, "
            f"median {statistics.median(seconds.values()):.1f} s per submission")


def autograde(course: str, week: str, submissions: dict[str, dict], jobs: int = 2, out=None) -> list[dict]:
    """Put each {student: notebook_json} under submitted/ and autograde them, `jobs` students at a time;
    returns the gradebook rows."""
    import io
    nb_name = [f for f in os.listdir(os.path.join(course, "labs", week)) if f.endswith(".ipynb")][0]
    for student, nb in submissions.items():
        d = os.path.join(course, "submitted", student, week)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, nb_name), "w") as f:
            json.dump(nb, f, indent=1)
    autograde_class(course, week, jobs=jobs, students=list(submissions), out=out or io.StringIO())
    return gradebook_rows(course, week)
