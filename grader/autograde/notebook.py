"""Read a lab notebook's JSON (the student's modules, the grade cells' checks) and grade it outside its kernel.

The trusted path never asks the kernel: it rebuilds the modules from the notebook source,
so whatever the kernel did (patching torch, redefining `check`) cannot reach the grade.
"""
from __future__ import annotations

import ast
import re
import shutil
import warnings

_WRITEFILE = re.compile(r"^%%writefile(\s+-a|\s+--append)?\s+(\S+)\s*\n?")


def cell_source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def writefile_cells(nb):
    """(cell, the %%writefile match, its source) of each code cell that writes a module, in notebook order."""
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        src = cell_source(cell).lstrip("\n")
        m = _WRITEFILE.match(src)
        if m:
            yield cell, m, src


def module_sources(nb) -> dict[str, str]:
    """{filename: text} as the %%writefile cells would leave the folder, in notebook order."""
    files: dict[str, str] = {}
    for _, m, src in writefile_cells(nb):
        body = src[m.end():]
        if body and not body.endswith("\n"):
            body += "\n"   # %%writefile writes the cell plus a newline
        name = m.group(2).split("/")[-1]
        files[name] = (files.get(name, "") + body) if m.group(1) else body
    return files


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


def check_names_in(nb) -> list[str]:
    """Every check the grade cells of `nb` call, once each, in notebook order."""
    names: list[str] = []
    for _, _, ns, _ in grade_cells(nb):
        names += [n for n in ns if n not in names]
    return names


def give_up(first):
    """A held first attempt that no job took over: its launcher stops, its folder goes."""
    first.cancel()
    shutil.rmtree(first.jobdir, ignore_errors=True)


def run_trusted(nb, log=None, first=None):
    """Run all grade-cell checks of `nb` outside the kernel; returns (cells, report or exception).
    first: the job's first attempt, already held (`hold_first_attempt(check_names_in(nb))`); held here otherwise."""
    from grader.judge.attempt import hold_first_attempt
    cells = grade_cells(nb)
    names = check_names_in(nb)
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
