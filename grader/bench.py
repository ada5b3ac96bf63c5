"""`python -m grader bench`: the grader's speed, measured on this machine.

- cold check: one Week 2 check on 4 ranks started with torchrun (a fresh interpreter per rank);
- fork check: the same with the fork launcher (torch imported once per job, ranks forked), as grading runs;
- warm check: the same with the warm launcher (a resident process forks each job), as a notebook runs;
- class-scale autograde: N submissions (solutions, stubs and broken ones), graded in parallel.
"""
from __future__ import annotations

import os
import shutil
import statistics
import time

from grader.job import run_checks

CHECK = ["week02/column_parallel"]


def _sources() -> dict[str, str]:
    from grader.notebook import module_sources
    from tests.corpus import build
    return module_sources(build("week02", {"base": "solution"}))


def time_check(launcher: str, repeats: int) -> list[float]:
    src = _sources()
    out = []
    for _ in range(repeats):
        t0 = time.monotonic()
        rep = run_checks(CHECK, src, launcher=launcher, sandbox="off", interactive=launcher == "warm")
        out.append(time.monotonic() - t0)
        assert rep.passed, rep.cases[CHECK[0]].message()
    return out


def class_autograde(n: int, jobs: int) -> str:
    from grader.demo import CLASS, submission
    from grader.nbgrader_tools import nbgrader, scratch_course
    from grader.class_autograde import autograde_class, summary
    import json
    course = scratch_course(["week02"])
    try:
        nbgrader(["generate_assignment", "week02", "--force"], course)
        kinds = [k for _, k in CLASS]
        for i in range(n):
            d = os.path.join(course, "submitted", f"s{i:03d}", "week02")
            os.makedirs(d)
            with open(os.path.join(d, "tp_linear.ipynb"), "w") as f:
                json.dump(submission(kinds[i % len(kinds)]), f)
        t0 = time.monotonic()
        secs = autograde_class(course, "week02", jobs=jobs)
        return summary(secs, time.monotonic() - t0) + f" ({jobs} at a time, {os.cpu_count()} cores)"
    finally:
        shutil.rmtree(course, ignore_errors=True)


def main(n: int = 20, jobs: int = 2, repeats: int = 3) -> int:
    print("grader benchmark (CPU/gloo, this machine)", flush=True)
    cold = time_check("torchrun", repeats)
    print(f"cold check, torchrun, 4 ranks: median {statistics.median(cold):.1f} s  (runs: "
          + ", ".join(f"{s:.1f}" for s in cold) + ")", flush=True)
    fork = time_check("fork", repeats)
    print(f"fork check, fork launcher, 4 ranks: median {statistics.median(fork):.1f} s  (runs: "
          + ", ".join(f"{s:.1f}" for s in fork) + ")", flush=True)
    first, *warm = time_check("warm", repeats + 1)
    print(f"warm check, warm launcher, 4 ranks: median {statistics.median(warm):.2f} s  (runs: "
          + ", ".join(f"{s:.2f}" for s in warm) + f"; the first call, which starts it: {first:.1f} s)", flush=True)
    if n:
        print(f"autograde of {n} Week 2 submissions ...", flush=True)
        print(class_autograde(n, jobs), flush=True)
    return 0
