"""Drive nbgrader from Python: release labs/ from solutions/, autograde a scratch class.

Everything runs in a scratch course folder, so no gradebook.db lands in the repository.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

from grader.judge.sources import module_sources

from grader import ROOT

CONFIG = "nbgrader_config.py"


def weeks(root: str = ROOT) -> list[str]:
    d = os.path.join(root, "solutions")
    return sorted(w for w in os.listdir(d) if os.path.isdir(os.path.join(d, w)) and w.startswith("week"))


def nbgrader(args: list[str], course: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run the nbgrader CLI with this repo's config, rooted at `course`."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # nbgrader needs alembic
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "nbgrader", *args, f"--CourseDirectory.root={course}"]
    p = subprocess.run(cmd, cwd=course, env=env, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"nbgrader {' '.join(args)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def course_config(course: str, db: str | None = None):
    """The course's nbgrader_config.py, rooted at `course`; gradebook `db` (a file or a database URL) if given,
    else the config's `CourseDirectory.db_url` (nbgrader's default: `course`/gradebook.db)."""
    from traitlets.config.loader import PyFileConfigLoader
    from grader.autograde.gradebooks import url
    config = PyFileConfigLoader(CONFIG, path=course).load_config()
    config.CourseDirectory.root = course
    if db:
        config.CourseDirectory.db_url = url(db)
    return config


def course_api(course: str, db: str | None = None):
    """nbgrader's API on `course`, configured by the course's nbgrader_config.py (gradebook `db` if given)."""
    from nbgrader.apps.api import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory
    from grader.autograde.gradebooks import alembic_on_path
    alembic_on_path()
    config = course_config(course, db)
    return NbGraderAPI(coursedir=CourseDirectory(config=config), config=config)


def scratch_course(week_list: list[str] | None = None) -> str:
    """A temp nbgrader course: this repo's config and the chosen weeks' solutions."""
    course = tempfile.mkdtemp(prefix="tp-course-")
    shutil.copy(os.path.join(ROOT, "nbgrader_config.py"), course)
    for w in week_list or weeks():
        src = os.path.join(ROOT, "solutions", w)
        # modules a notebook's %%writefile cells left beside it hold solutions: never release them
        written = set()
        for nb in (f for f in os.listdir(src) if f.endswith(".ipynb")):
            written |= set(module_sources(json.load(open(os.path.join(src, nb)))))
        shutil.copytree(src, os.path.join(course, "solutions", w),
                        ignore=lambda d, names: [n for n in names if n in written or n == ".ipynb_checkpoints"])
    return course


def release(week_list: list[str] | None = None, dest: str | None = None) -> list[str]:
    """Regenerate the student release of each week into dest (default: this repo's labs/)."""
    week_list = week_list or weeks()
    dest = dest or os.path.join(ROOT, "labs")
    course = scratch_course(week_list)
    written = []
    try:
        api = course_api(course)          # in this process: one nbgrader start for every week
        for w in week_list:
            result = api.generate_assignment(w, force=True)
            if not result["success"]:
                raise RuntimeError(f"nbgrader generate_assignment {w} failed:\n{result.get('error') or result.get('log')}")
            out = os.path.join(dest, w)
            shutil.rmtree(out, ignore_errors=True)
            shutil.copytree(os.path.join(course, "labs", w), out)
            written += [os.path.join(out, f) for f in sorted(os.listdir(out))]
    finally:
        shutil.rmtree(course, ignore_errors=True)
    return written


def gradebook_rows(course: str, week: str) -> list[dict]:
    from grader.autograde.gradebooks import gradebook
    with gradebook(os.path.join(course, "gradebook.db")) as gb:
        rows = []
        for sub in gb.assignment_submissions(week):
            rows.append({"student": sub.student_id, "score": sub.score, "max_score": sub.max_score,
                         "cells": {g.name: g.score for nb in sub.notebooks for g in nb.grades}})
        return sorted(rows, key=lambda r: r["student"])
