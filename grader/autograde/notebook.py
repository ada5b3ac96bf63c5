"""Read a lab notebook's JSON (the student's modules, the grade cells' checks) and grade it outside its kernel.

The trusted path never asks the kernel: it rebuilds the modules from the notebook source,
so whatever the kernel did (patching torch, redefining `check`) cannot reach the grade.
"""
from __future__ import annotations

import ast
import glob
import json
import os
import re
import shutil
import warnings

from grader import ROOT
from grader.judge.sources import cell_source, module_sources


def check_names(source: str) -> list[str]:
    """The string arguments of every `check(...)` call in a cell (hidden tests included)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return re.findall(r"check\(\s*[\"']([^\"']+)[\"']", source)
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "check":
            names += [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return names


def grade_cells(nb) -> list[tuple[int, dict, list[str], float]]:
    """(index, cell, check names, points) for every nbgrader grade cell that calls check()."""
    out = []
    for i, cell in enumerate(nb.get("cells", [])):
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.get("cell_type") == "code" and meta.get("grade"):
            names = check_names(cell_source(cell))
            if names:
                out.append((i, cell, names, float(meta.get("points", 0))))
    return out


def check_names_of(cells) -> list[str]:
    """Every check the grade cells `cells` (as `grade_cells` lists them) call, once each, in their order."""
    names: list[str] = []
    for _, _, ns, _ in cells:
        names += [n for n in ns if n not in names]
    return names


def released_grade_cells(nb, name: str = "") -> tuple[list, list[str]]:
    """The grade cells `nbgrader autograde` would grade in `nb` (as `grade_cells` lists them), and a plain note for
    each one graded otherwise than the student's copy shows it.

    autograde restores every locked grade cell from the release before it grades (nbgrader's OverwriteCells, missing
    cells included). Here the release is this course's own labs/ (beside this grader, never a path the notebook
    names): the lab that shares most of the notebook's nbgrader cell ids (`name`, the notebook's file name, breaks a
    tie). Each of its grade cells is graded with its released checks and points. The student's copy of a cell stands
    when its source is the release's or the nbgrader source's (solutions/, hidden tests included)."""
    release = _release_of(nb, name)
    if release is None:
        return grade_cells(nb), ["this notebook is not one of the course's labs (no released lab has its grade "
                                 "cells): its own grade cells are graded"]
    path, released = release
    source = _cells_by_id(_read(os.path.join(ROOT, "solutions", os.path.basename(os.path.dirname(path)),
                                             os.path.basename(path))))
    mine = {gid: (i, cell) for i, cell in enumerate(nb.get("cells", [])) if (gid := grade_id(cell))}
    cells, notes = [], []
    for _, cell, names, points in grade_cells(released):
        gid = grade_id(cell)
        i, own = mine.pop(gid, (None, None))
        if own is None:
            notes.append(f"grade cell `{gid}` is missing; the released cell is graded")
        elif _same(own, cell) or _same(own, source.get(gid)):
            cell, names = own, check_names(cell_source(own))
        else:
            notes.append(f"grade cell `{gid}` was edited; the released cell is graded")
        cells.append((i, cell, names, points))
    notes += [f"cell `{grade_id(cell)}` is not a grade cell of the released lab: it is not graded"
              for _, cell, _, _ in grade_cells(nb) if grade_id(cell) in mine]
    return cells, notes


def grade_id(cell) -> str | None:
    """The nbgrader cell id of `cell` (a student's JSON may hold anything there)."""
    meta = cell.get("metadata") if isinstance(cell, dict) else None
    nbg = meta.get("nbgrader") if isinstance(meta, dict) else None
    return nbg.get("grade_id") if isinstance(nbg, dict) else None


def _read(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            nb = json.load(f)
    except (OSError, ValueError):
        return {}
    return nb if isinstance(nb, dict) else {}


def _cells_by_id(nb) -> dict:
    return {gid: cell for cell in nb.get("cells", []) if (gid := grade_id(cell))}


def _release_of(nb, name: str) -> tuple[str, dict] | None:
    """(path, notebook) of the released lab `nb` is a copy of, or None: it shares no nbgrader cell with any."""
    ids = set(_cells_by_id(nb))
    best = None
    for path in sorted(glob.glob(os.path.join(ROOT, "labs", "week*", "*.ipynb"))):
        released = _read(path)
        key = (len(ids & set(_cells_by_id(released))), os.path.basename(path) == name)
        if key[0] and (best is None or key > best[0]):
            best = key, path, released
    return best[1:] if best else None


def _same(cell, released) -> bool:
    """The same source, as nbgrader's checksum of a locked cell sees it (line endings and outer blanks aside)."""
    def text(c):
        return cell_source(c).replace("\r\n", "\n").strip()
    return released is not None and text(cell) == text(released)


def give_up(first):
    """A held first attempt that no job took over: its launcher stops, its folder goes."""
    first.cancel()
    shutil.rmtree(first.jobdir, ignore_errors=True)


def run_trusted(nb, log=None, first=None, cells=None):
    """Run the grade-cell checks of `nb` outside the kernel; returns (cells, report or exception).
    cells: the grade cells to grade (default: `nb`'s own, which nbgrader has restored from the release);
    first: the job's first attempt, already held (`hold_first_attempt(check_names_of(cells))`); held here otherwise."""
    from grader.judge.attempt import hold_first_attempt
    cells = grade_cells(nb) if cells is None else cells
    names = check_names_of(cells)
    if not names:
        if first is not None:
            give_up(first)
        return cells, None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if first is None:
                first = hold_first_attempt(names)     # its launcher imports torch while this process does
            from grader.judge.job import run_checks
            report = run_checks(names, module_sources(nb), graded_together=[list(ns) for _, _, ns, _ in cells],
                                first=first)
        except Exception as exc:  # the grader itself failed: never a silent pass
            if first is not None and first.launch is not None and first.launch.proc.poll() is None:   # run_checks never took it over
                give_up(first)
            if log:
                log.error("trusted checks failed to run: %s", exc)
            return cells, exc
    return cells, report
