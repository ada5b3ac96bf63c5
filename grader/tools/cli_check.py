"""`python -m grader check NOTEBOOK`: run the notebook, then grade its modules the trusted way.

The run is bounded, as everything on the trusted side: each cell within CELL_TIMEOUT seconds (what nbgrader's
Execute.timeout allows a cell in autograde), the whole notebook within `run_timeout`, and what this process keeps of a
cell's output within OUTPUT_KEEP characters (a cell that prints more than OUTPUT_LIMIT stops the run). Past a limit the
kernel is killed and the check says which cell and why; the trusted checks read the modules from the notebook JSON, so
a run stopped early is still graded. The grade cells are the released lab's, as `nbgrader autograde` grades them.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

from grader.autograde.notebook import check_names_of, give_up, grade_id, released_grade_cells, run_trusted
from grader.judge.sources import cell_source
from grader.judge.timeouts import EXECUTE_TIMEOUT

CELL_TIMEOUT = EXECUTE_TIMEOUT   # seconds a cell may run: what autograde allows it
OUTPUT_KEEP = 1 << 20            # characters of a cell's output kept here (and in --output's notebook)
OUTPUT_LIMIT = 32 << 20          # characters of a cell's output that stop the run: receiving them costs time too
ENGINE = "grader-bounded"        # papermill's nbclient engine, with `Bounds` on its client


def run_timeout(cell_timeout: float) -> float:
    """The whole notebook's limit, for cells of `cell_timeout` seconds each: a lab's cells take seconds."""
    return 2 * cell_timeout


def start_kernel(work: str):
    """The notebook's boxed kernel (in-kernel checks deferred), started in `work` before anything else: on most
    labs its start and the notebook's own `import torch` are the longest path of a check."""
    from jupyter_core.utils import run_sync
    from grader.box.kernel_box import BoxedKernelManager, grading_kernel_env
    km = BoxedKernelManager(kernel_name="python3")
    with grading_kernel_env():
        run_sync(km.start_kernel)(cwd=work)
    return km


class Bounds:
    """The limits of one notebook run, kept from outside its kernel. A watchdog thread kills the kernel when a cell or
    the whole run is past its time; the run's client (`_bounded_engine`) keeps OUTPUT_KEEP characters of each cell's
    output and kills the kernel past OUTPUT_LIMIT. papermill then ends the run, and `why` says what stopped it."""

    def __init__(self, km, cell_timeout: float):
        self.km, self.cell_timeout = km, cell_timeout
        self.why: str | None = None
        self.cell: str | None = None     # the cell running now, as a person finds it ("cell 12 (`...`)")
        self.since = time.monotonic()
        self.injected = 0                # cells papermill added (its parameters): not the student's
        self.kept: dict[int, int] = {}   # characters of output kept, per cell
        self.seen: dict[int, int] = {}   # and received
        self.cut: list[str] = []         # the cells whose output was cut
        self._done = threading.Event()

    def started(self, cell, cell_index: int, **_):
        """nbclient's on_cell_start hook."""
        self.injected += "injected-parameters" in cell.get("metadata", {}).get("tags", [])
        line = next((ln.strip() for ln in cell_source(cell).splitlines() if ln.strip()), "")
        line = line if len(line) <= 60 else line[:57] + "..."
        self.cell, self.since = f"cell {cell_index + 1 - self.injected} (`{line}`)", time.monotonic()

    def stop(self, why: str):
        """Kill the kernel, from any thread (the first reason stands)."""
        if self.why is None:
            self.why = f"the grader stopped the notebook{f' in {self.cell}' if self.cell else ''}: {why}"
        pgid = getattr(getattr(self.km, "provisioner", None), "pgid", None)
        if pgid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)

    def admit(self, content: dict, stream: bool, cell_index: int) -> bool:
        """Whether to keep an output message of the cell; a stream's text is cut to what is left of OUTPUT_KEEP."""
        size = _chars(content)
        self.seen[cell_index] = self.seen.get(cell_index, 0) + size
        if self.seen[cell_index] > OUTPUT_LIMIT:
            self.stop(f"it printed more than {OUTPUT_LIMIT >> 20} MiB")
            return False
        room = OUTPUT_KEEP - self.kept.get(cell_index, 0)
        self.kept[cell_index] = min(OUTPUT_KEEP, OUTPUT_KEEP - room + size)
        if size <= room:
            return True
        if self.cell not in self.cut:
            self.cut.append(self.cell)
        if room <= 0 or not stream:
            return False
        content["text"] = (content["text"][:room] + f"\n[the grader keeps the first {OUTPUT_KEEP >> 20} MiB of a "
                           "cell's output]\n")
        return True

    @contextlib.contextmanager
    def watch(self):
        """While the notebook runs: kill its kernel past a cell's limit or the whole run's."""
        watchdog = threading.Thread(target=self._watch, args=(time.monotonic() + run_timeout(self.cell_timeout),),
                                    daemon=True)
        watchdog.start()
        try:
            yield
        finally:
            self._done.set()
            watchdog.join()

    def _watch(self, end: float):
        while not self._done.wait(0.2):
            now = time.monotonic()
            if self.cell is not None and now - self.since > self.cell_timeout:
                self.stop(f"it ran past its {self.cell_timeout:g} s limit")
                return
            if now > end:
                self.stop(f"the notebook ran past its {run_timeout(self.cell_timeout):g} s limit")
                return

    def notes(self) -> list[str]:
        return [f"note: {cell} printed more than {OUTPUT_KEEP >> 20} MiB: the grader kept the first "
                f"{OUTPUT_KEEP >> 20} MiB of its output" for cell in self.cut]


def _chars(value) -> int:
    """The characters an output message carries (its text, data, traceback)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_chars(v) for v in value.values())
    if isinstance(value, list):
        return sum(_chars(v) for v in value)
    return 8


@functools.cache
def _bounded_engine():
    """papermill's nbclient engine whose client keeps its `Bounds`, and the kernel client it needs (imported when a
    notebook runs, not before the job's launcher starts)."""
    import logging

    import zmq
    from jupyter_client.asynchronous import AsyncKernelClient
    from papermill.clientwrap import PapermillNotebookClient
    from papermill.engines import NBClientEngine

    class BoundedClient(PapermillNotebookClient):
        def __init__(self, nb_man, bounds: Bounds, **kw):
            super().__init__(nb_man, on_cell_start=bounds.started, **kw)
            self.bounds = bounds

        def output(self, outs, msg, display_id, cell_index):
            if self.bounds.admit(msg.get("content") or {}, msg.get("msg_type") == "stream", cell_index):
                return super().output(outs, msg, display_id, cell_index)
            return None

    class BoundedKernelClient(AsyncKernelClient):
        def connect_iopub(self, identity=None):
            # a message larger than this is refused by ZeroMQ before it is read: the trusted process never holds it
            self.context.setsockopt(zmq.MAXMSGSIZE, OUTPUT_LIMIT)
            try:
                return super().connect_iopub(identity)
            finally:
                self.context.setsockopt(zmq.MAXMSGSIZE, -1)

    # nbclient logs a kernel it saw die to stderr; the check says in its own words why the run stopped
    quiet = logging.getLogger("grader.check.notebook")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False

    class BoundedEngine(NBClientEngine):
        @classmethod
        def execute_managed_notebook(cls, nb_man, kernel_name, km=None, bounds=None, start_timeout=60, **_):
            return BoundedClient(nb_man, bounds, km=km, kernel_name=kernel_name, startup_timeout=start_timeout,
                                 log=quiet).execute()

    return BoundedEngine, BoundedKernelClient


def _execute(km, path: str, work: str, backend: str | None, out: str | None, bounds: Bounds) -> str | None:
    """Run the notebook with papermill on the started kernel `km` within `bounds`, then stop it. Returns why it
    stopped early, in plain words, or None."""
    import papermill as pm
    from papermill.engines import papermill_engines
    engine, km.client_factory = _bounded_engine()
    papermill_engines.register(ENGINE, engine)
    params = {"BACKEND": backend} if backend else {}
    try:
        with warnings.catch_warnings(), bounds.watch():
            warnings.simplefilter("ignore")
            pm.execute_notebook(path, out or os.path.join(work, os.path.basename(path)), parameters=params,
                                cwd=work, progress_bar=False, log_output=False, kernel_name="python3", km=km,
                                engine_name=ENGINE, bounds=bounds)
        return bounds.why
    except Exception as exc:  # papermill stops at the first error; the checks still run
        if bounds.why is None and "Timeout waiting for IOPub output" in str(exc):    # the cell's end never came
            bounds.stop(f"its output did not all arrive (an output of more than {OUTPUT_LIMIT >> 20} MiB at once is "
                        "refused)")
        return bounds.why or f"the notebook stopped early ({_summary(exc)})"
    finally:
        stop_kernel(km)       # a kernel papermill was handed is not papermill's to stop


def stop_kernel(km):
    from jupyter_core.utils import run_sync
    run_sync(km.shutdown_kernel)(now=True)


def _summary(exc: Exception) -> str:
    first = str(exc).strip().splitlines()
    return first[-1] if first else type(exc).__name__


def check_notebook(path: str, backend: str | None = None, execute: bool = True, out: str | None = None,
                   first=None, kernel=None, timeout: float = CELL_TIMEOUT) -> int:
    """Run the notebook at `path` (each cell within `timeout` seconds, the whole within `run_timeout(timeout)`) and
    grade its modules the trusted way: prints each grade cell's verdict and the score; 0 full marks, 1 not, 2 no grade.
    Started earlier for this check (the check server's), each used here or given back:
    first: the job's first attempt, held for exactly this notebook's checks;
    kernel: a boxed kernel that has run nothing (its folder is empty: papermill sends it the notebook's cells)."""
    graded = _graded_cells(path)
    if kernel is not None and (graded is None or not execute):
        stop_kernel(kernel)
        kernel = None
    if graded is None:
        if first is not None:
            give_up(first)
        return 2
    cells, notes = graded
    names = check_names_of(cells)
    if backend:
        os.environ["COURSE_BACKEND"] = backend
    _say_recording(names)
    first = _hold_first(first, names)
    for note in notes:
        print(f"note: {note}")
    # the trusted checks read the modules from the notebook JSON, not from the run: both go at once. The notebook
    # runs in a scratch folder: its %%writefile cells must not write beside the original
    with tempfile.TemporaryDirectory(prefix="grader-check-") as work, ThreadPoolExecutor(max_workers=1) as pool:
        copy, km, err = _start_run(path, kernel, work) if execute else (None, None, None)
        nb = _read_notebook(path, first, km)
        if nb is None:
            return 2
        checks = pool.submit(run_trusted, nb, None, first, cells)
        if execute:
            print(f"running {path} and its checks ...", flush=True)
            bounds = Bounds(km, timeout)
            err = err or _execute(km, copy, work, backend, out, bounds)
            for note in bounds.notes() + ([f"note: {err}; the checks use its %%writefile cells"] if err else []):
                print(note, flush=True)
        report = checks.result()[1]
    return _score(path, cells, report)


def _graded_cells(path: str) -> tuple[list, list[str]] | None:
    """The grade cells of the notebook at `path` as autograde grades them (the released ones), and notes on them;
    None where it is no notebook (said why)."""
    if not os.path.exists(path):
        print(f"error: {path} does not exist (give the path of a lab notebook, e.g. labs/week02/tp_linear.ipynb)")
        return None
    try:
        with open(path, "rb") as f:
            return released_grade_cells(json.load(f), os.path.basename(path))
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        print(f"error: {path} is not a readable notebook ({exc})")
        return None


def _say_recording(names: list[str]):
    from grader.judge import dtensor_tables
    weeks = dtensor_tables.missing(n.split("/")[0] for n in names)
    if weeks:
        print(f"recording DTensor's sharding decisions for {', '.join(weeks)} (once per torch version and lab "
              "solution: a few seconds) ...", flush=True)


def _hold_first(first, names: list[str]):
    """The job's first attempt: the one held for this check, else one held now. The job's launcher first, then the
    notebook's kernel, then this process's own imports (nbformat, papermill): on some labs the launcher's imports are
    the longest path of a check, on others the kernel's."""
    from grader.judge.attempt import hold_first_attempt
    try:
        return first or (hold_first_attempt(names) if names else None)
    except Exception:   # noqa: BLE001  no box, say: the checks meet it again and report it
        return None


def _start_run(path: str, kernel, work: str):
    """(the notebook's copy in `work`, its kernel, why there is none): the copy first, the kernel's folder holds it."""
    copy = shutil.copy(path, os.path.join(work, "input-" + os.path.basename(path)))
    try:
        return copy, kernel or start_kernel(work), None
    except Exception as exc:   # noqa: BLE001  the checks still run
        return copy, None, f"the notebook stopped early ({_summary(exc)})"


def _read_notebook(path: str, first, km):
    """The notebook as nbformat reads it; None (the held job and kernel given back) where it cannot."""
    try:
        import nbformat
        return nbformat.read(path, as_version=4)
    except Exception as exc:       # noqa: BLE001  JSON, but not a notebook nbformat can read
        if first is not None:
            give_up(first)
        if km is not None:
            stop_kernel(km)
        print(f"error: {path} is not a readable notebook ({exc})")
        return None


def _score(path: str, cells, report) -> int:
    """Each grade cell's points and verdict, then the score; the exit status."""
    if not cells:
        print(f"error: {path} has no graded check cells")
        return 2
    if isinstance(report, Exception):
        print(f"error: the grader could not run: {report}")
        return 2
    got = total = 0.0
    for _, cell, names, points in cells:
        passed, text = report.cell_verdict(names)
        total += points
        got += points if passed else 0
        print(f"\n{grade_id(cell) or '?'}: {points if passed else 0:g}/{points:g}\n{text}")
    print(f"\n{report.footer()}")
    for note in report.sandbox.get("notes", []):      # what the box could not do, said where it is seen
        print(f"sandbox: {note}")
    print(f"score: {got:g}/{total:g}")
    sys.stdout.flush()
    return 0 if got == total else 1
