"""The modules a lab notebook's %%writefile cells write, read from the notebook's JSON (never from a kernel).

The judging core reads a notebook this way (a lab solution's modules, grader/judge/dtensor_tables.py), and so do the
nbgrader integration and the tools: the student's code is whatever these cells hold.
"""
from __future__ import annotations

import re

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
