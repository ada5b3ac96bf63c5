"""`python -m grader repeat-scores`: the same notebook must get the same score on every run.

Grades every lab's solution and every correct submission of the bad-submission corpus (each fixture whose
manifest expects every grade cell to pass: the independently written variants, and the wrong-in-spirit ones
whose only fault is seen inside the rank and is a note) `--runs` times in a row through the trusted checks
(`run_trusted`, as `nbgrader autograde` grades), each run with freshly drawn seeds; optionally with `--busy`
processes spinning beside it. Prints one row per submission: its scores over the runs, and whether they were all
the same and full. Exit 1 if any submission's score changed between runs or fell below full marks.
"""
from __future__ import annotations

import contextlib
import subprocess
import sys
import time

from grader.autograde.nbgrader_tools import weeks
from grader.autograde.notebook import grade_cells, run_trusted
from grader.tools.corpus import build, lab_notebooks, load_manifest


def correct_submissions(week: str) -> list[tuple[str, dict]]:
    """(name, spec) of the lab's solution and of every fixture expected to pass every grade cell of the lab."""
    subs = [("solution", {"base": "solution"})]
    try:
        fixtures = load_manifest(week)["submissions"]
    except FileNotFoundError:
        return subs
    cells = {cell.metadata["nbgrader"]["grade_id"] for _, cell, _, _ in grade_cells(lab_notebooks(week)[1])}
    for name, spec in fixtures.items():
        if spec.get("nbgrader_only") or spec.get("sandbox"):
            continue             # graded through nbgrader, or needs files planted around the job
        if set(spec["expect"]) >= cells and all(v == "pass" for v in spec["expect"].values()):
            subs.append((name, spec))
    return subs


def score(nb) -> tuple[float, float]:
    cells, report = run_trusted(nb)
    if isinstance(report, Exception):
        raise report
    got = sum(points for _, cell, names, points in cells if all(report.cases[n].passed for n in names))
    return got, sum(points for *_, points in cells)


@contextlib.contextmanager
def busy(n: int):
    """`n` processes that each keep one core busy, for as long as the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main(runs: int = 10, busy_procs: int = 0, only: list[str] | None = None) -> int:
    print(f"each correct submission graded {runs} times in a row through the trusted checks, fresh seeds each run"
          f"{f', with {busy_procs} busy processes beside it' if busy_procs else ', on a quiet machine'}", flush=True)
    bad = 0
    with busy(busy_procs):
        for week in only or weeks():
            for name, spec in correct_submissions(week):
                nb = build(week, spec)
                t0 = time.monotonic()
                scores = [score(nb) for _ in range(runs)]
                full = scores[0][1]
                same = len(set(scores)) == 1
                ok = same and scores[0][0] == full
                bad += not ok
                shown = " ".join(f"{g:g}" for g, _ in scores)
                print(f"{week}/{name:<40} {'same' if same else 'CHANGED':<8} {'full' if ok else 'NOT FULL':<9}"
                      f"/{full:g}: {shown}  ({(time.monotonic() - t0) / runs:.1f} s a run)", flush=True)
    print(f"{'every score the same and full' if not bad else f'{bad} submission(s) changed or lost points'}")
    return 1 if bad else 0
