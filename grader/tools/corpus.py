"""Make student submissions from the released lab: the solution, the stub, or a fixture.

A fixture folder `tests/fixtures/weekNN/` holds module files and `manifest.json`:

    {"notebook": "tp_linear.ipynb",
     "submissions": {
       "bias_every_rank": {
         "why": "row-parallel adds the bias on every rank",
         "base": "solution",                         # or "stub" (default): the rest of the notebook
         "module": {"tp_linear.py": "bias_every_rank.py"},   # whole-module replacement, or
         "patch": {"tp_linear.py": [["old text", "new text"]]},  # edits of the solution's module
         "append_cell": "def check(*a, **k): print('ok')",    # a cell added after the setup cell
         "edit_grade": {"check_row": "print('all good')"},     # a locked grade cell edited
         "delete_grade": ["check_mlp"],                        # a grade cell deleted
         "expect": {"check_column": "pass", "check_row": "fail"},
         "messages": ["added once"]}}}                         # must appear in the failure output
"""
from __future__ import annotations

import copy
import json
import os
import re

import nbformat

from grader import ROOT
from grader.judge.sources import cell_source, module_sources, writefile_cells

FIXTURES = os.path.join(ROOT, "tests", "fixtures")
# a private file of the grading user's, as an instructor's token would be: no student code may read it
# (one per process: a test run's teardown must not remove the file another run's test probes)
PLANTED = os.path.join(os.path.expanduser("~"), f".grader-corpus-secret-{os.getpid()}")
SECRET = "instructor-only-7f3a"


def plant_secret() -> str:
    with open(PLANTED, "w") as f:
        f.write(SECRET)
    os.chmod(PLANTED, 0o600)
    return PLANTED


def expand(text: str, course: str | None = None) -> str:
    """Fill a fixture's placeholders with this machine's paths (@@REPO@@, @@PLANTED@@, @@HOME@@, @@COURSE@@)."""
    for key, value in {"@@REPO@@": ROOT, "@@PLANTED@@": PLANTED, "@@HOME@@": os.path.expanduser("~"),
                       "@@COURSE@@": course or "/nonexistent-course"}.items():
        text = text.replace(key, value)
    return text


def load_manifest(week: str) -> dict:
    path = os.path.join(FIXTURES, week, "manifest.json")
    with open(path) as f:
        return json.load(f)


def lab_notebooks(week: str) -> tuple[dict, dict]:
    """(solution notebook, released notebook) as JSON dicts."""
    man = load_manifest(week)
    sol = nbformat.read(os.path.join(ROOT, "solutions", week, man["notebook"]), as_version=4)
    rel = nbformat.read(os.path.join(ROOT, "labs", week, man["notebook"]), as_version=4)
    return sol, rel


def replace_modules(nb, files: dict[str, str]):
    """Put each file's text in its first %%writefile cell; empty the cells that append to it."""
    done = set()
    for cell, m, _ in writefile_cells(nb):
        name = m.group(2).split("/")[-1]
        if name not in files:
            continue
        if name in done:
            cell.source = m.group(0).rstrip("\n") + "\n# (moved into the first cell)\n"
        else:
            cell.source = f"%%writefile {m.group(2)}\n" + files[name]
            done.add(name)
    missing = set(files) - done
    if missing:
        raise ValueError(f"no %%writefile cell for {sorted(missing)} in the notebook")


def solution_modules(week: str) -> dict[str, str]:
    """The solution's modules as a student would write them: without nbgrader's markers."""
    sol, _ = lab_notebooks(week)
    return {k: re.sub(r"[ \t]*### (BEGIN|END) SOLUTION\n", "", v) for k, v in module_sources(sol).items()}


def build(week: str, spec: dict, course: str | None = None):
    _, rel = lab_notebooks(week)
    nb = copy.deepcopy(rel)
    if spec.get("base", "stub") == "solution":
        replace_modules(nb, solution_modules(week))
    if "patch" in spec:
        files = solution_modules(week)
        for target, edits in spec["patch"].items():
            text = files[target]
            for old, new in edits:
                if text.count(old) != 1:
                    raise ValueError(f"{week} fixture patch for {target}: {old[:60]!r} occurs {text.count(old)} "
                                     "times in the solution's module (it must occur once): update the manifest")
                text = text.replace(old, new)
            files[target] = text
        replace_modules(nb, {k: files[k] for k in spec["patch"]})
    if "module" in spec:
        files = {}
        for target, fname in spec["module"].items():
            with open(os.path.join(FIXTURES, week, fname)) as f:
                files[target] = f.read()
        replace_modules(nb, files)
    if "append_cell" in spec:
        setup = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "import" in cell_source(c))
        nb.cells.insert(setup + 1, nbformat.v4.new_code_cell(spec["append_cell"]))
    for gid, src in spec.get("edit_grade", {}).items():
        cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == gid)
        cell.source = src
    for gid in spec.get("delete_grade", []):
        nb.cells = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") != gid]
    for cell in nb.cells:
        cell.source = expand(cell_source(cell), course)
    return nb
