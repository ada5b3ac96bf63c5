"""`python -m grader check NOTEBOOK`: run the notebook, then grade its modules the trusted way."""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor

from grader.autograde.notebook import check_names_in, give_up, run_trusted


def start_kernel(work: str):
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
        stop_kernel(km)       # a kernel papermill was handed is not papermill's to stop


def stop_kernel(km):
    from jupyter_core.utils import run_sync
    run_sync(km.shutdown_kernel)(now=True)


def _summary(exc: Exception) -> str:
    first = str(exc).strip().splitlines()
    return first[-1] if first else type(exc).__name__


def check_notebook(path: str, backend: str | None = None, execute: bool = True, out: str | None = None,
                   first=None, kernel=None) -> int:
    """Started earlier for this check (the check server's), each used here or given back:
    first: the job's first attempt, held for exactly this notebook's checks;
    kernel: a boxed kernel that has run nothing (its folder is empty: papermill sends it the notebook's cells)."""
    from grader.judge import dtensor_tables
    from grader.judge.attempt import hold_first_attempt
    names = None
    if not os.path.exists(path):
        print(f"error: {path} does not exist (give the path of a lab notebook, e.g. labs/week02/tp_linear.ipynb)")
    else:
        try:
            with open(path, "rb") as f:
                names = check_names_in(json.load(f))
        except (OSError, ValueError, AttributeError, TypeError) as exc:
            print(f"error: {path} is not a readable notebook ({exc})")
    if names is None or not execute:
        if kernel is not None:
            stop_kernel(kernel)
            kernel = None
    if names is None:
        if first is not None:
            give_up(first)
        return 2
    if backend:
        os.environ["COURSE_BACKEND"] = backend
    weeks = dtensor_tables.missing(n.split("/")[0] for n in names)
    if weeks:
        print(f"recording DTensor's sharding decisions for {', '.join(weeks)} (once per torch version and lab "
              "solution: a few seconds) ...", flush=True)
    # the job's launcher first, then the notebook's kernel, then this process's own imports (nbformat, papermill):
    # on some labs the launcher's imports are the longest path of a check, on others the kernel's
    try:
        first = first or (hold_first_attempt(names) if names else None)
    except Exception:   # noqa: BLE001  no box, say: the checks meet it again and report it
        first = None
    # the trusted checks read the modules from the notebook JSON, not from the run: both go at once. The notebook
    # runs in a scratch folder: its %%writefile cells must not write beside the original
    with tempfile.TemporaryDirectory(prefix="grader-check-") as work, ThreadPoolExecutor(max_workers=1) as pool:
        km = err = None
        if execute:
            copy = shutil.copy(path, os.path.join(work, "input-" + os.path.basename(path)))
            try:
                km = kernel or start_kernel(work)
            except Exception as exc:   # noqa: BLE001  the checks still run
                err = _summary(exc)
        try:
            import nbformat
            nb = nbformat.read(path, as_version=4)
        except Exception as exc:       # noqa: BLE001  JSON, but not a notebook nbformat can read
            if first is not None:
                give_up(first)
            if km is not None:
                stop_kernel(km)
            print(f"error: {path} is not a readable notebook ({exc})")
            return 2
        checks = pool.submit(run_trusted, nb, None, first)
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
