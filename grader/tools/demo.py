"""`python -m grader demo` (make demo): one scratch class through the whole nbgrader flow.

Release the Week 2 lab from solutions/, hand in a few submissions (the solution, the
untouched stub, and broken ones from tests/fixtures/week02), `nbgrader autograde` them with
the trusted checks, then print the gradebook and export it to CSV.
"""
from __future__ import annotations

import csv
import os
import shutil
import sys
import time

from nbgrader.plugins.export import CsvExportPlugin

from grader.autograde.nbgrader_tools import course_api
from grader.autograde.gradebooks import gradebook
from grader.autograde.class_autograde import autograde
from grader.autograde.nbgrader_tools import scratch_course
from grader.tools.corpus import build, load_manifest

WEEK = "week02"
CLASS = [  # student id, submission (fixture name, or solution/stub)
    ("alice", "solution"),
    ("bob", "stub"),
    ("carol", "bias_every_rank"),
    ("dave", "deadlock_skip"),
    ("erin", "unsharded_cheat"),
    ("frank", "redefined_check"),
    ("grace", "edited_locked_cell"),
]


def submission(kind: str):
    if kind == "solution":
        return build(WEEK, {"base": "solution"})
    if kind == "stub":
        return build(WEEK, {})
    return build(WEEK, load_manifest(WEEK)["submissions"][kind])


def main(keep: str | None = None) -> int:
    t0 = time.monotonic()
    course = scratch_course([WEEK])
    print(f"scratch course: {course}", flush=True)
    result = course_api(course).generate_assignment(WEEK, force=True)
    if not result["success"]:
        raise RuntimeError(f"nbgrader generate_assignment {WEEK} failed:\n{result.get('error') or result.get('log')}")
    print(f"released {WEEK} with nbgrader generate_assignment ({time.monotonic() - t0:.0f} s)", flush=True)
    subs = {student: submission(kind) for student, kind in CLASS}
    print(f"autograding {len(subs)} submissions (trusted checks run outside each student's kernel) ...", flush=True)
    rows = autograde(course, WEEK, subs, jobs=2, out=sys.stdout)
    kinds = dict(CLASS)
    cells = sorted({c for r in rows for c in r["cells"]})
    print(f"\n{'student':<8} {'submission':<20} " + " ".join(f"{c:>13}" for c in cells) + f" {'score':>8}")
    for r in rows:
        print(f"{r['student']:<8} {kinds[r['student']]:<20} " +
              " ".join(f"{r['cells'][c]:>13g}" for c in cells) + f" {r['score']:>4g}/{r['max_score']:g}")
    out = os.path.join(course, "grades.csv")
    with gradebook(os.path.join(course, "gradebook.db")) as gb:
        CsvExportPlugin(to=out).export(gb)       # what `nbgrader export` does
    with open(out) as f:
        n = sum(1 for _ in csv.reader(f)) - 1
    print(f"\nexported {n} rows to {out}")
    print(f"make demo took {time.monotonic() - t0:.0f} s")
    if keep:
        shutil.copytree(course, keep, dirs_exist_ok=True)
        print(f"kept the course in {keep}")
    shutil.rmtree(course, ignore_errors=True)
    return 0
