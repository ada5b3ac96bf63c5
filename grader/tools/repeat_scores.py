"""`python -m grader repeat-scores`: the same notebook must get the same score on every run.

Grades every lab's solution and every correct submission of the bad-submission corpus (each fixture whose
manifest expects every grade cell to pass: the independently written variants, and the wrong-in-spirit ones
whose only fault is seen inside the rank and is a note) `--runs` times in a row through the trusted checks
(`run_trusted`, as `nbgrader autograde` grades), each run with freshly drawn seeds; optionally with `--busy`
processes spinning beside it. With `--wrong`, every other fixture too: a wrong submission must fail the same grade
cells on every draw of the hidden cases' seeds, exactly those its manifest names. Prints one row per submission:
its scores over the runs, and whether they were all the same and as expected (full, for a correct one). Exit 1 if
any submission's score changed between runs or its grade cells were not the expected ones.
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
    cells = _grade_ids(week)
    return [(name, spec) for name, spec in submissions(week) if all(spec["expect"].get(c) == "pass" for c in cells)]


def submissions(week: str) -> list[tuple[str, dict]]:
    """(name, spec) of the lab's solution (expected to pass every grade cell) and of every fixture graded by the
    trusted checks alone, each with the verdict its manifest expects of the grade cells it names."""
    cells = _grade_ids(week)
    subs = [("solution", {"base": "solution", "expect": {c: "pass" for c in cells}})]
    try:
        fixtures = load_manifest(week)["submissions"]
    except FileNotFoundError:
        return subs
    for name, spec in fixtures.items():
        if spec.get("nbgrader_only") or spec.get("sandbox"):
            continue             # graded through nbgrader, or needs files planted around the job
        subs.append((name, spec))
    return subs


def _grade_ids(week: str) -> set[str]:
    return {cell.metadata["nbgrader"]["grade_id"] for _, cell, _, _ in grade_cells(lab_notebooks(week)[1])}


def score(nb) -> tuple[float, float, frozenset]:
    """(points, out of, the grade cells that passed)."""
    cells, report = run_trusted(nb)
    if isinstance(report, Exception):
        raise report
    passed = [(cell, points) for _, cell, names, points in cells if all(report.cases[n].passed for n in names)]
    return (sum(points for _, points in passed), sum(points for *_, points in cells),
            frozenset(cell.metadata["nbgrader"]["grade_id"] for cell, _ in passed))


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


def main(runs: int = 10, busy_procs: int = 0, only: list[str] | None = None, wrong: bool = False) -> int:
    kind = "submission of the corpus" if wrong else "correct submission"
    print(f"each {kind} graded {runs} times in a row through the trusted checks, fresh seeds each run"
          f"{f', with {busy_procs} busy processes beside it' if busy_procs else ', on a quiet machine'}", flush=True)
    bad = 0
    with busy(busy_procs):
        for week in only or weeks():
            for name, spec in (submissions if wrong else correct_submissions)(week):
                nb = build(week, spec)
                t0 = time.monotonic()
                scores = [score(nb) for _ in range(runs)]
                expected = frozenset(c for c, v in spec["expect"].items() if v == "pass")
                same = len(set(scores)) == 1
                ok = same and scores[0][2] & set(spec["expect"]) == expected
                bad += not ok
                shown = " ".join(f"{g:g}" for g, _, _ in scores)
                verdict = ("full" if ok else "NOT FULL") if expected == set(spec["expect"]) else \
                    ("as expected" if ok else "NOT AS EXPECTED")
                print(f"{week}/{name:<40} {'same' if same else 'CHANGED':<8} {verdict} /{scores[0][1]:g}: {shown}  "
                      f"({(time.monotonic() - t0) / runs:.1f} s a run)", flush=True)
    print("every score the same and as expected" if not bad else f"{bad} submission(s) changed or not as expected")
    return 1 if bad else 0
