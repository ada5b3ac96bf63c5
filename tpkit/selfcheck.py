"""`check("week02/column_parallel")` in a lab notebook: a self-check of your modules on N ranks.

It runs in your kernel for fast feedback and grades nothing. Grades come from the trusted path
(`nbgrader autograde` with `grader.autograde.plugin.TrustedChecks`, or `python -m grader check`),
which rebuilds your modules from the notebook JSON and compares in its own process.
"""
from __future__ import annotations

import glob
import os
import warnings

from tpkit.course_imports import course_imports

MAX_MODULE_BYTES = 1_000_000


def kernel_sources(folder: str = ".") -> dict[str, str]:
    """{filename: text} of the modules your %%writefile cells left in `folder`."""
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.py"))):
        if os.path.getsize(path) <= MAX_MODULE_BYTES:
            with open(path) as f:
                out[os.path.basename(path)] = f.read()
    return out


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
    from grader.judge.case import get_case
    from grader.judge.job import run_checks
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
    notes = [c.notes() for c in report.cases.values() if c.passed and c.notes()]
    if report.passed:
        print("\n".join([report.table()] + notes))
        return
    failed = [c.message() for c in report.cases.values() if not c.passed] + notes
    raise AssertionError("\n".join(failed) + f"\n({report.seconds:.1f} s)") from None
