"""The course's grader: `check("week02/column_parallel")` in a lab notebook.

In the kernel, `check` is a self-check for fast feedback. Grades come from the
trusted path (`grader.nbgrader_plugin.TrustedChecks`, `python -m grader check`),
which reads the module source from the notebook JSON and compares in its own process.
"""
from __future__ import annotations

import glob
import os
import warnings

__all__ = ["check"]

MAX_MODULE_BYTES = 1_000_000


def _kernel_sources(folder: str = ".") -> dict[str, str]:
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
    from grader.job import run_checks
    from grader.case import get_case
    for n in names:
        get_case(n)  # unknown names fail before anything is launched
    sources = _kernel_sources()
    module = get_case(names[0]).module
    if f"{module}.py" not in sources:
        raise AssertionError(f"{module}.py was not found in {os.getcwd()}: run the %%writefile {module}.py cell "
                             "above first.") from None
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
