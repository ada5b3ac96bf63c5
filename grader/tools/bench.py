"""`python -m grader bench`: the grader's speed, measured on this machine, in one run.

- a bare `import torch` in a fresh interpreter: the unit the other figures are compared with;
- one Week 2 check on 4 ranks three ways: cold (torchrun: a fresh interpreter per rank), fork (as
  grading runs: torch imported once per job, ranks forked, sandboxed) and warm (as a notebook's `check()`
  runs: a resident process forks each job);
- a correct and a deadlocking submission through the trusted checks (the deadlock's own seconds): Week 2, and
  Weeks 1, 6 and 7, whose ranks block where gloo cannot abort them (send/recv, DTensor's functional waits);
- `python -m grader check` on every lab's solution (notebook run + trusted checks), as a student runs it: cold (no
  check server) and warm (a lab's later checks, served by grader/tools/check_server.py), as a multiple of a bare
  `import torch` timed beside the runs, and how busy the machine's cores were meanwhile (near 100%: CPU-bound, only
  less work makes it faster);
- a 64 MiB float32 all-reduce on 4 ranks, on the course backend (as grading carries it: grader/tools/bench_payload.py)
  and on gloo;
- class-scale autograde: N submissions of the `make demo` mix (solutions, stubs, broken, a deadlock),
  `jobs` at a time, through nbgrader with the trusted checks.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid

from grader.judge.job import run_checks
from grader.tools import check_server

CHECK = ["week02/column_parallel"]
PAUSE_S = 6.0       # between warm checks: the server's next held launcher has imported torch by then


def _sources(kind: str = "solution") -> dict[str, str]:
    from grader.tools.demo import submission
    from grader.judge.sources import module_sources
    return module_sources(submission(kind))


def _runs(xs: list[float], fmt: str = "{:.1f}") -> str:
    return f"median {fmt.format(statistics.median(xs))} s (runs: " + ", ".join(fmt.format(x) for x in xs) + ")"


def time_import_torch(repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        out.append(time.monotonic() - t0)
    return out


def time_check(launcher: str, repeats: int, sandbox: str = "off") -> list[float]:
    src = _sources()
    out = []
    for _ in range(repeats):
        t0 = time.monotonic()
        rep = run_checks(CHECK, src, launcher=launcher, sandbox=sandbox, interactive=launcher == "warm")
        out.append(time.monotonic() - t0)
        assert rep.passed, rep.cases[CHECK[0]].message()
    return out


def time_submission(kind: str, repeats: int) -> list[float]:
    """The whole trusted grading of one Week 2 submission (every grade cell's checks, sandboxed)."""
    from grader.tools.demo import submission
    return _time_trusted(lambda: submission(kind), repeats)


def time_fixture(week: str, name: str, repeats: int) -> list[float]:
    """The same for a submission of the corpus (tests/fixtures/weekNN), e.g. a deadlocking one."""
    from grader.tools.corpus import build, load_manifest
    spec = {"base": "solution"} if name == "solution" else load_manifest(week)["submissions"][name]
    return _time_trusted(lambda: build(week, spec), repeats)


def _time_trusted(make_notebook, repeats: int) -> list[float]:
    from grader.autograde.notebook import run_trusted
    out = []
    for _ in range(repeats):
        nb = make_notebook()
        t0 = time.monotonic()
        _, report = run_trusted(nb)
        out.append(time.monotonic() - t0)
        assert not isinstance(report, Exception), report
    return out


# a deadlocking submission per week where the ranks can block where gloo cannot abort them
DEADLOCKS = [("week01", "deadlock_send_first"), ("week06", "deadlock_blocking_ring"),
             ("week07", "deadlock_barrier_on_one_rank")]


def busy_cpu_seconds() -> float:
    """CPU time the whole machine has spent busy so far, all cores together (/proc/stat); nan off Linux."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    except (OSError, ValueError):
        return float("nan")
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def time_cli(path: str, env: dict) -> tuple[float, float, str]:
    """Seconds of `python -m grader check path`, the machine's busy CPU-seconds meanwhile, and its score line."""
    c0, t0 = busy_cpu_seconds(), time.monotonic()
    p = subprocess.run([sys.executable, "-m", "grader", "check", path], capture_output=True, text=True, env=env)
    score = (p.stdout.strip().splitlines() or ["?"])[-1]
    return time.monotonic() - t0, busy_cpu_seconds() - c0, score


def time_checks(path: str, repeats: int) -> dict[str, tuple[list, list]]:
    """`python -m grader check path`, `repeats` times each: cold (no check server: three interpreters import torch),
    then warm (served by a check server of the bench's own, each check PAUSE_S after the one before, as a student's
    edits are). {"cold" or "warm": (a bare `import torch` timed just before each run, the runs)}."""
    cold_env = {**os.environ, "GRADER_CHECK_SERVER": "off"}
    warm_env = {**os.environ, "GRADER_CHECK_SERVER": "on", "COURSE_BENCH_SERVER": uuid.uuid4().hex}
    out = {"cold": ([], []), "warm": ([], [])}
    for _ in range(repeats):
        out["cold"][0].extend(time_import_torch(1))
        out["cold"][1].append(time_cli(path, cold_env))
    time_cli(path, warm_env)        # cold: it starts the server
    try:
        for _ in range(repeats):
            time.sleep(PAUSE_S)
            out["warm"][0].extend(time_import_torch(1))
            out["warm"][1].append(time_cli(path, warm_env))
    finally:
        check_server.stop(check_server.address(warm_env))
    return out


def class_autograde(n: int, jobs: int) -> str:
    from grader.autograde.class_autograde import autograde_class, summary
    from grader.tools.demo import CLASS, WEEK, submission
    from grader.autograde.nbgrader_tools import scratch_course
    from grader.autograde.nbgrader_tools import course_api
    course = scratch_course([WEEK])
    try:
        result = course_api(course).generate_assignment(WEEK, force=True)
        assert result["success"], result.get("error")
        kinds = [k for _, k in CLASS]
        for i in range(n):
            d = os.path.join(course, "submitted", f"s{i:03d}", WEEK)
            os.makedirs(d)
            with open(os.path.join(d, "tp_linear.ipynb"), "w") as f:
                json.dump(submission(kinds[i % len(kinds)]), f)
        t0 = time.monotonic()
        secs = autograde_class(course, WEEK, jobs=jobs, out=open(os.devnull, "w"))
        wall = time.monotonic() - t0
        dead = [secs[f"s{i:03d}"] for i in range(n) if kinds[i % len(kinds)] == "deadlock_skip"]
        return (summary(secs, wall) + f" ({jobs} at a time, {os.cpu_count()} cores; the demo mix of "
                f"{len(set(kinds))} kinds; deadlocking ones: " + ", ".join(f"{d:.1f} s" for d in dead) + ")")
    finally:
        shutil.rmtree(course, ignore_errors=True)


def main(n: int = 20, jobs: int = 2, repeats: int = 3) -> int:
    from grader import ROOT
    print(f"grader benchmark (CPU/gloo, this machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})",
          flush=True)
    from grader.judge import dtensor_tables
    for week in dtensor_tables.missing(dtensor_tables.WEEKS):     # once per install: not part of any timing below
        t0 = time.monotonic()
        dtensor_tables.ensure(week)
        print(f"recorded {week}'s DTensor table (once per torch version and lab solution): "
              f"{time.monotonic() - t0:.1f} s", flush=True)
    torch_s = time_import_torch(repeats)
    print(f"bare `import torch`: {_runs(torch_s, '{:.2f}')}", flush=True)
    print(f"one check, 4 ranks, cold (torchrun): {_runs(time_check('torchrun', repeats))}", flush=True)
    print(f"one check, 4 ranks, fork launcher, sandboxed (as grading): "
          f"{_runs(time_check('fork', repeats, sandbox='auto'))}", flush=True)
    first, *warm = time_check("warm", repeats + 1)
    print(f"one check, 4 ranks, warm launcher (as check() in a notebook): {_runs(warm, '{:.2f}')}; "
          f"the first call, which starts it: {first:.1f} s", flush=True)
    from grader.tools.bench_payload import time_payload
    course, gloo = time_payload("course"), time_payload("gloo")
    print(f"a 64 MiB all_reduce on 4 ranks: course backend {_runs(course[1:], '{:.3f}')} (the first, touching its "
          f"arena's pages: {course[0]:.3f} s); gloo {_runs(gloo[1:], '{:.3f}')} (the first: {gloo[0]:.3f} s); course "
          f"/ gloo {statistics.median(course[1:]) / statistics.median(gloo[1:]):.2f}", flush=True)
    ok = time_submission("solution", repeats)
    dead = time_submission("deadlock_skip", repeats)
    print(f"trusted grading of a Week 2 submission: correct {_runs(ok)}; deadlocking {_runs(dead)}; "
          f"the deadlock costs {statistics.median(dead) - statistics.median(ok):+.1f} s", flush=True)
    for week, name in DEADLOCKS:
        ok, dead = time_fixture(week, "solution", repeats), time_fixture(week, name, repeats)
        print(f"trusted grading of a {week} submission: correct {_runs(ok)}; deadlocking ({name}) {_runs(dead)}; "
              f"the deadlock costs {statistics.median(dead) - statistics.median(ok):+.1f} s", flush=True)
    # each lab's ratio is to a bare `import torch` timed just before each of its runs: this machine's speed drifts
    # by 10-30% over minutes, and one figure taken at the start would move every ratio with it
    for path in sorted(glob.glob(os.path.join(ROOT, "solutions", "week*", "*.ipynb"))):
        line = f"python -m grader check {os.path.relpath(path, ROOT)}:"
        label = {"cold": "cold", "warm": f"warm (a check server up, {PAUSE_S:.0f} s after the last check)"}
        for kind, (base, runs) in time_checks(path, repeats).items():
            secs = [s for s, _, _ in runs]
            busy = statistics.median(c / (s * (os.cpu_count() or 1)) for s, c, _ in runs)
            line += (f"\n    {label[kind]}: "
                     f"{_runs(secs)} = {statistics.median(secs) / statistics.median(base):.1f}x `import torch` "
                     f"(median {statistics.median(base):.2f} s beside it); the machine's cores busy {busy:.0%} of that "
                     f"time ({runs[-1][2]})")
        print(line, flush=True)
    if n:
        print(f"class autograde of {n} Week 2 submissions ...", flush=True)
        print(class_autograde(n, jobs), flush=True)
    return 0
