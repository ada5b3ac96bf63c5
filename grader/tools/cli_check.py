"""`python -m grader check NOTEBOOK`: run the notebook, then grade its modules the trusted way."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor

import nbformat

from grader.autograde.notebook import run_trusted


def _start_kernel(work: str):
    """The notebook's boxed kernel (in-kernel checks deferred), started in `work` before anything else: on most
    labs its start and the notebook's own `import torch` are the longest path of a check."""
    from jupyter_core.utils import run_sync
    from grader.box.kernel_box import BoxedKernelManager, grading_kernel_env
    km = BoxedKernelManager(kernel_name="python3")
    with grading_kernel_env():
        run_sync(km.start_kernel)(cwd=work)
    return km


def _execute(km, path: str, work: str, backend: str | None, out: str | None) -> str | None:
    """Run the notebook with papermill on the started kernel `km`, then stop it. Returns an error summary or None."""
    import papermill as pm
    from jupyter_core.utils import run_sync
    params = {"BACKEND": backend} if backend else {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm.execute_notebook(path, out or os.path.join(work, os.path.basename(path)), parameters=params,
                                cwd=work, progress_bar=False, log_output=False, kernel_name="python3", km=km)
        return None
    except Exception as exc:  # papermill stops at the first error; the checks below still run
        return _summary(exc)
    finally:
        run_sync(km.shutdown_kernel)(now=True)     # a kernel papermill was handed is not papermill's to stop


def _summary(exc: Exception) -> str:
    first = str(exc).strip().splitlines()
    return first[-1] if first else type(exc).__name__


def check_notebook(path: str, backend: str | None = None, execute: bool = True, out: str | None = None) -> int:
    if not os.path.exists(path):
        print(f"error: {path} does not exist (give the path of a lab notebook, e.g. labs/week02/tp_linear.ipynb)")
        return 2
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as exc:
        print(f"error: {path} is not a readable notebook ({exc})")
        return 2
    if backend:
        os.environ["COURSE_BACKEND"] = backend
    # the trusted checks read the modules from the notebook JSON, not from the run: both go at once. The notebook
    # runs in a scratch folder: its %%writefile cells must not write beside the original
    with tempfile.TemporaryDirectory(prefix="grader-check-") as work, ThreadPoolExecutor(max_workers=1) as pool:
        km = err = None
        if execute:
            copy = shutil.copy(path, os.path.join(work, "input-" + os.path.basename(path)))
            try:
                km = _start_kernel(work)
            except Exception as exc:   # noqa: BLE001  the checks still run
                err = _summary(exc)
        checks = pool.submit(run_trusted, nb)
        if execute:
            print(f"running {path} and its checks ...", flush=True)
            err = err or _execute(km, copy, work, backend, out)
            if err:
                print(f"note: the notebook stopped early ({err}); the checks use its %%writefile cells")
        cells, report = checks.result()
    if not cells:
        print(f"error: {path} has no graded check cells")
        return 2
    if isinstance(report, Exception):
        print(f"error: the grader could not run: {report}")
        return 2
    got = total = 0.0
    for _, cell, names, points in cells:
        gid = cell.metadata.get("nbgrader", {}).get("grade_id", "?")
        passed, text = report.cell_verdict(names)
        total += points
        got += points if passed else 0
        print(f"\n{gid}: {points if passed else 0:g}/{points:g}\n{text}")
    print(f"\n{report.footer()}")
    for note in report.sandbox.get("notes", []):      # what the box could not do, said where it is seen
        print(f"sandbox: {note}")
    print(f"score: {got:g}/{total:g}")
    sys.stdout.flush()
    return 0 if got == total else 1
