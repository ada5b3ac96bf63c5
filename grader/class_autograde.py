"""Grade a class in parallel: `python -m grader autograde WEEK --jobs N` in an nbgrader course folder.

nbgrader autograde is serial. This runs one `nbgrader autograde WEEK --student S` per student,
N at a time, with progress. Each student's job is isolated (its own kernel, its own trusted
grading job and sandbox); the only shared thing is gradebook.db, which SQLite serialises; a
student whose run still fails on a locked database is retried alone at the end.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

from grader.nbgrader_tools import nbgrader


def students_with_submissions(course: str, week: str) -> list[str]:
    d = os.path.join(course, "submitted")
    if not os.path.isdir(d):
        return []
    return sorted(s for s in os.listdir(d) if os.path.isdir(os.path.join(d, s, week)))


def autograde_parallel(course: str, week: str, jobs: int = 2, students: list[str] | None = None,
                       out=sys.stdout) -> dict[str, float]:
    """Autograde every submission of `week`; returns {student: seconds}."""
    students = students or students_with_submissions(course, week)
    if not students:
        raise SystemExit(f"no submissions of {week} under {os.path.join(course, 'submitted')}/<student>/{week}/")
    for s in students:
        nbgrader(["db", "student", "add", s], course)
    seconds: dict[str, float] = {}
    retry: list[str] = []
    t0 = time.monotonic()

    def one(student):
        t = time.monotonic()
        p = nbgrader(["autograde", week, "--force", f"--student={student}"], course, check=False)
        return student, p, time.monotonic() - t

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(one, s) for s in students]
        for n, fut in enumerate(as_completed(futures), 1):
            student, p, secs = fut.result()
            seconds[student] = secs
            if p.returncode != 0:
                retry.append(student)
            state = "ok" if p.returncode == 0 else "will retry"
            print(f"[{n}/{len(students)}] {student}: {secs:.1f} s ({state}), {time.monotonic() - t0:.0f} s elapsed",
                  file=out, flush=True)
    for student in retry:
        _, p, secs = one(student)
        seconds[student] = secs
        if p.returncode != 0:
            raise RuntimeError(f"autograde of {student} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
        print(f"[retry] {student}: {secs:.1f} s", file=out, flush=True)
    return seconds


def summary(seconds: dict[str, float], wall: float) -> str:
    n = len(seconds)
    return (f"{n} submissions in {wall:.0f} s: {60 * n / wall:.1f} submissions/minute, "
            f"median {statistics.median(seconds.values()):.1f} s per submission")
