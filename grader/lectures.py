"""Execute lecture notebooks in place with papermill (CPU/gloo), so committed outputs are fresh."""
from __future__ import annotations

import glob
import os
import time

from grader.nbgrader_tools import ROOT


def lecture_paths() -> list[str]:
    return sorted(glob.glob(os.path.join(ROOT, "notebooks", "week*.ipynb")))


def execute_lecture(path: str, out: str | None = None, timeout: int = 600) -> float:
    import papermill as pm
    t0 = time.monotonic()
    pm.execute_notebook(path, out or path, cwd=os.path.dirname(path), kernel_name="python3",
                        progress_bar=False, execution_timeout=timeout)
    return time.monotonic() - t0


def execute_lectures(paths: list[str] | None = None) -> int:
    for p in paths or lecture_paths():
        s = execute_lecture(os.path.abspath(p))
        print(f"executed {os.path.relpath(p, ROOT)} in {s:.0f} s", flush=True)
    return 0
