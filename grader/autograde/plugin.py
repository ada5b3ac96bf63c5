"""nbgrader autograde, the trusted way.

`DeferredExecute` runs the student's notebook as nbgrader always does, but in a boxed kernel
(`grader.box.kernel_box`) that sees no course, gradebook or home, and tells the in-kernel `check()`
to stand down (it would only be a self-check anyway).
`TrustedChecks` then rebuilds the student's modules from the notebook JSON, runs every
grade cell's checks in one job outside the kernel, and writes each verdict into that
grade cell's outputs, which `SaveAutoGrades` scores: an error output scores 0.
"""
from __future__ import annotations

from nbformat.notebooknode import from_dict
from nbgrader.preprocessors import Execute, NbGraderPreprocessor

from grader.box.kernel_box import BoxedKernelManager, grading_kernel_env
from grader.autograde.notebook import run_trusted


class DeferredExecute(Execute):
    """nbgrader's Execute with the kernel in a box (`grader.box.kernel_box`) and in-kernel checks deferred."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.kernel_manager_class = BoxedKernelManager

    def preprocess(self, nb, resources):
        with grading_kernel_env():
            return super().preprocess(nb, resources)


def verdict_outputs(report, names: list[str]) -> list[dict]:
    """A passing cell gets a stdout table; a failing one an AssertionError naming the cause."""
    passed, text = report.cell_verdict(names)
    if passed:
        return [from_dict({"output_type": "stream", "name": "stdout", "text": text + "\n"})]
    return [from_dict({"output_type": "error", "ename": "AssertionError", "evalue": text,
                       "traceback": ["AssertionError: " + text]})]


class TrustedChecks(NbGraderPreprocessor):
    def preprocess(self, nb, resources):
        cells, report = run_trusted(nb, self.log)
        if isinstance(report, Exception):   # never a grade from a grader that did not run: fail loudly
            raise RuntimeError(f"the trusted checks could not run, nothing was graded: {report}") from report
        for i, cell, names, _ in cells:
            if report is not None:
                cell.outputs = verdict_outputs(report, names)
        if report is not None and not isinstance(report, Exception):
            for note in report.sandbox.get("notes", []):
                self.log.warning("sandbox: %s", note)
            self.log.info("trusted checks: %d/%d passed in %.1f s",
                          sum(c.passed for c in report.cases.values()), len(report.cases), report.seconds)
        return nb, resources
