"""`check("week02/column_parallel")` in a lab notebook: a self-check of your modules on N ranks.

It runs in your kernel for fast feedback and grades nothing. Grades come from the trusted path
(`nbgrader autograde` with `grader.nbgrader_plugin.TrustedChecks`, or `python -m grader check`),
which rebuilds your modules from the notebook JSON and compares in its own process.
"""
from __future__ import annotations

import ast
import glob
import os
import warnings

MAX_MODULE_BYTES = 1_000_000
# packages a grading rank cannot import: the grader's trusted side and the lectures' reference code
NOT_AT_GRADING = ("reference", "grader", "notebooks", "solutions", "tests")


def kernel_sources(folder: str = ".") -> dict[str, str]:
    """{filename: text} of the modules your %%writefile cells left in `folder`."""
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.py"))):
        if os.path.getsize(path) <= MAX_MODULE_BYTES:
            with open(path) as f:
                out[os.path.basename(path)] = f.read()
    return out


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


def check(*names: str, backend: str | None = None, launcher: str | None = None) -> None:
    """Run the named checks on this folder's modules (what your %%writefile cells wrote).

    Prints one table when everything matches the single-device reference; raises
    AssertionError naming the rank, tensor and cause otherwise. Prints nothing on stderr.
    """
    __tracebackhide__ = True  # noqa: F841  (IPython hides this frame)
    if not names:
        raise ValueError('name the check to run, e.g. check("week02/column_parallel")')
    if os.environ.get("GRADER_DEFER_CHECKS") == "1":
        print(f"{', '.join(names)}: deferred to the trusted grader")
        return
    from grader.case import get_case
    from grader.job import run_checks
    for n in names:
        get_case(n)  # unknown names fail before anything is launched
    sources = kernel_sources()
    module = get_case(names[0]).module
    if f"{module}.py" not in sources:
        raise AssertionError(f"{module}.py was not found in {os.getcwd()}: run the %%writefile {module}.py cell "
                             "above first.") from None
    used = [(f, line, m) for f, text in sources.items() for line, m in course_imports(text)]
    if used:
        f, line, m = used[0]
        raise AssertionError(f"{f} line {line} imports `{m}`: the course's own code is not there when your lab is "
                             "graded, so this would score 0. Write it yourself (the teaching library `tpkit` and "
                             "torch stay available).") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # your own kernel, your own code: no sandbox unless GRADER_SANDBOX asks for one
        report = run_checks(list(names), sources, backend=backend, launcher=launcher,
                            sandbox=os.environ.get("GRADER_SANDBOX", "off"), interactive=True)
    if report.passed:
        print(report.table())
        return
    failed = [c.message() for c in report.cases.values() if not c.passed]
    raise AssertionError("\n".join(failed) + f"\n({report.seconds:.1f} s)") from None
