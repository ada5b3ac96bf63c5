"""Execute lecture notebooks in place with papermill (CPU/gloo), so committed outputs are fresh and clean.

A committed notebook carries no trace of the machine that ran it: papermill's metadata keeps the
notebook's name only, and `machine_traces` finds absolute paths of this machine left in outputs.
"""
from __future__ import annotations

import glob
import json
import os
import re
import time

from grader import ROOT

# absolute paths of the machine that executed a notebook (checkout, temp files, home folders, venvs)
_MACHINE_PATH = re.compile(r"(?<![\w.])/(?:tmp|root|home|work|usr/lib/python|opt)/[\w./-]+")


# executed and committed like a lecture, but no week of the syllabus: the cost model checked against
# published measurements (tpkit/costmodel.py)
VALIDATION_NOTEBOOKS = ["cost_model_validation.ipynb"]


def lecture_paths() -> list[str]:
    """The weekly lectures, then the validation notebooks: all executed by `make notebooks` and the tests."""
    return (sorted(glob.glob(os.path.join(ROOT, "notebooks", "week*.ipynb")))
            + [os.path.join(ROOT, "notebooks", n) for n in VALIDATION_NOTEBOOKS])


def clean_metadata(path: str):
    """papermill records where it read and wrote the notebook: keep the file name only."""
    with open(path) as f:
        nb = json.load(f)
    pm = nb.get("metadata", {}).get("papermill", {})
    for key in ("input_path", "output_path"):
        if pm.get(key):
            pm[key] = os.path.basename(pm[key])
    with open(path, "w") as f:
        json.dump(nb, f, indent=1, ensure_ascii=False)
        f.write("\n")


def machine_traces(nb: dict) -> list[str]:
    """Absolute paths of a machine in a notebook's outputs or metadata (each found once)."""
    texts = [json.dumps(nb.get("metadata", {}))]
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []):
            texts += [json.dumps(out.get("text", "")), json.dumps(out.get("data", {}).get("text/plain", "")),
                      json.dumps(out.get("traceback", "")), json.dumps(out.get("evalue", ""))]
    return sorted({m for t in texts for m in _MACHINE_PATH.findall(t)})


def execute_lecture(path: str, out: str | None = None, timeout: int = 600) -> float:
    """Run `path` headless into `out` (default: in place). In place, a failed run leaves the notebook as it was."""
    import papermill as pm
    t0 = time.monotonic()
    target = out or path
    tmp = target if out else os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.running.ipynb")
    try:
        pm.execute_notebook(path, tmp, cwd=os.path.dirname(path), kernel_name="python3",
                            progress_bar=False, execution_timeout=timeout)
        clean_metadata(tmp)
        if tmp != target:
            os.replace(tmp, target)
    finally:
        if tmp != target and os.path.exists(tmp):
            os.unlink(tmp)
    return time.monotonic() - t0


def execute_lectures(paths: list[str] | None = None) -> int:
    """Execute each lecture in place; report every failure, keep the committed version of a failed one."""
    import papermill as pm
    failed = []
    for p in paths or lecture_paths():
        rel = os.path.relpath(os.path.abspath(p), ROOT)
        try:
            s = execute_lecture(os.path.abspath(p))
        except pm.PapermillExecutionError as e:
            failed.append(rel)
            print(f"FAILED {rel} (left unchanged): cell {e.exec_count}: {e.ename}: {e.evalue}", flush=True)
            continue
        print(f"executed {rel} in {s:.0f} s", flush=True)
    return 1 if failed else 0
