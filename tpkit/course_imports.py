"""Which imports a grading rank cannot satisfy: the course's own packages outside the teaching library.

Used by the kernel self-check (`tpkit.check` refuses such a module before running it) and by the grader's
verdicts (a rank's ModuleNotFoundError for one of them is explained, not shown as a bare traceback).
"""
from __future__ import annotations

import ast

# packages a grading rank cannot import: the grader's trusted side and the lectures' reference code
NOT_AT_GRADING = ("reference", "grader", "notebooks", "solutions", "tests")


def course_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) for each import in `source` of a package that grading ranks cannot see."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) \
                and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("import_module", "__import__"):
            names = [node.args[0].value]
        found += [(node.lineno, n) for n in names if n.split(".")[0] in NOT_AT_GRADING]
    return found
