"""python -m grader {check NOTEBOOK | check-server --stop | student-install DEST | grading-service --socket PATH |
demo | release [WEEK..] | execute-lectures [NB..] | autograde WEEK | merge-gradebooks DB SLICE.db.. | bench |
repeat-scores | gpu-check}"""
from __future__ import annotations

import argparse
import os
import sys

# the grader forks (autograde workers, launchers) from processes that use torch: an OpenMP pool started with
# several threads before a fork hangs the child's first parallel op, so one thread unless the caller says otherwise
os.environ.setdefault("OMP_NUM_THREADS", "1")
# jsonschema (under nbformat) imports the optional rfc3987_syntax, which builds a grammar for 1.5 s at
# import; notebooks never use its IRI format: one blocked import makes every command that far faster
sys.modules.setdefault("rfc3987_syntax", None)


def cmd_check(a) -> int:
    from tpkit.selfcheck import SERVICE_ENV, check_notebook_served, has_grader
    if os.environ.get(SERVICE_ENV) or not has_grader():
        # a student install (or a class's account): the grading service grades; this process only reads the notebook
        if a.output or a.backend:
            print("note: --output and --backend are not sent to the grading service", file=sys.stderr)
        return check_notebook_served(a.notebook, execute=not a.no_execute)
    from grader.tools.check_server import check
    code = check(a.notebook, backend=a.backend, execute=not a.no_execute, out=a.output, timeout=a.timeout)
    # everything is written and cleaned up: skip the interpreter's teardown of torch (~0.5 s of a check)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_check_server(a) -> int:
    from grader.tools import check_server
    if a.stop:
        print(f"stopped {check_server.stop_all()} check server(s)")
        return 0
    if not (a.socket and a.notebook):
        print("error: give --stop, or --socket and --notebook (`python -m grader check` starts a server itself)")
        return 2
    return check_server.serve(a.socket, a.notebook, idle=a.idle)


def cmd_student_install(a) -> int:
    from grader.tools.grading_service import student_install
    try:
        written = student_install(a.dest, force=a.force)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote a student install into {os.path.abspath(a.dest)}: {', '.join(written)}")
    return 0


def cmd_grading_service(a) -> int:
    from grader.tools.grading_service import MAX_CHECKS, serve
    return serve(a.socket, group=a.group, max_checks=a.max_checks or MAX_CHECKS, timeout=a.timeout,
                 allow_unboxed=a.allow_unboxed)


def cmd_demo(a) -> int:
    from grader.tools.demo import main
    return main(keep=a.keep)


def cmd_release(a) -> int:
    from grader.autograde.nbgrader_tools import release
    for path in release(a.weeks or None):
        print("wrote", os.path.relpath(path))
    return 0


def cmd_execute(a) -> int:
    from grader.tools.lectures import execute_lectures
    return execute_lectures(a.notebooks or None)


def cmd_autograde(a) -> int:
    import time
    from grader.autograde.class_autograde import autograde_class, slice_of, students_with_submissions, summary
    course = os.path.abspath(a.course)
    students = students_with_submissions(course, a.week)
    if a.slice:
        students = slice_of(students, a.slice)
        if not students:
            print(f"slice {a.slice}: no submissions to grade")
            return 0
    t0 = time.monotonic()
    try:
        secs = autograde_class(course, a.week, jobs=a.jobs, students=students or None, db=a.db)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    print(summary(secs, time.monotonic() - t0))
    return 0


def cmd_merge(a) -> int:
    from grader.autograde.gradebooks import merge
    n = merge(a.target, a.slices)
    print(f"merged {n} submissions from {len(a.slices)} gradebooks into {a.target}")
    return 0


def cmd_bench(a) -> int:
    from grader.tools.bench import main
    return main(n=a.n, jobs=a.jobs, repeats=a.repeats)


def cmd_repeat_scores(a) -> int:
    from grader.tools.repeat_scores import main
    return main(runs=a.runs, busy_procs=a.busy, only=a.weeks or None, wrong=a.wrong)


def cmd_gpu_check(a) -> int:
    from grader.tools.gpu_check import main
    return main()


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def main(argv=None) -> int:
    try:
        from grader.judge.timeouts import EXECUTE_TIMEOUT
    except ImportError:     # a student install: only `check` works there, through the grading service
        EXECUTE_TIMEOUT = 900
    p = argparse.ArgumentParser(prog="python -m grader", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="run a lab notebook and grade it the trusted way; prints score: X/Y")
    c.add_argument("notebook")
    c.add_argument("--backend", default=None, help="gloo, nccl or auto (default)")
    c.add_argument("--no-execute", action="store_true", help="skip running the notebook; grade its modules only")
    c.add_argument("--output", default=None, help="where to write the executed notebook (default: a temp file)")
    c.add_argument("--timeout", type=_seconds, default=None, metavar="SECONDS",
                   help=f"stop the notebook when a cell runs longer (default {EXECUTE_TIMEOUT}, as autograde allows; "
                        "the whole notebook: twice that)")
    c.set_defaults(fn=cmd_check)
    s = sub.add_parser("check-server", help="the warm trusted process later checks use (check starts it); "
                       "--stop stops yours")
    s.add_argument("--stop", action="store_true", help="stop this user's check servers")
    s.add_argument("--socket", help=argparse.SUPPRESS)
    s.add_argument("--notebook", help=argparse.SUPPRESS)
    s.add_argument("--idle", type=float, default=None, help="exit after this many seconds with no check (600)")
    s.set_defaults(fn=cmd_check_server)
    i = sub.add_parser("student-install", help="write what a student's account needs (labs, tpkit, launch, the rank "
                       "side) into DEST: no reference, solutions, cases, judge or gradebook")
    i.add_argument("dest")
    i.add_argument("--force", action="store_true", help="replace an earlier student install in DEST")
    i.set_defaults(fn=cmd_student_install)
    v = sub.add_parser("grading-service", help="the trusted service that grades a class's checks on a Unix socket")
    v.add_argument("--socket", required=True, help="the socket to create (its folder: writable by this user only)")
    v.add_argument("--group", default=None, help="the socket's group (the students'); it is made 0660")
    v.add_argument("--max-checks", type=int, default=None, help="checks at a time, in all (default: half the cores)")
    v.add_argument("--timeout", type=_seconds, default=None, help="seconds a check may take before it is stopped")
    v.add_argument("--allow-unboxed", action="store_true", help=argparse.SUPPRESS)
    v.set_defaults(fn=cmd_grading_service)
    d = sub.add_parser("demo", help="a scratch class: release, submissions, nbgrader autograde, gradebook")
    d.add_argument("--keep", default=None, help="keep the scratch course in this folder")
    d.set_defaults(fn=cmd_demo)
    r = sub.add_parser("release", help="regenerate labs/ from solutions/ with nbgrader")
    r.add_argument("weeks", nargs="*")
    r.set_defaults(fn=cmd_release)
    e = sub.add_parser("execute-lectures", help="execute lecture notebooks in place (CPU/gloo)")
    e.add_argument("notebooks", nargs="*")
    e.set_defaults(fn=cmd_execute)
    g = sub.add_parser("autograde", help="nbgrader autograde WEEK for every submission, N students at a time")
    g.add_argument("week")
    g.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    g.add_argument("--course", default=".", help="the nbgrader course folder (default: here)")
    g.add_argument("--slice", default=None, help="K/N: grade only the K-th of N slices of the students")
    g.add_argument("--db", default=None, help="grade into this gradebook file (one per slice), or a database URL "
                                             "(postgresql+psycopg2://...), instead of the course config's db_url")
    g.set_defaults(fn=cmd_autograde)
    m = sub.add_parser("merge-gradebooks", help="copy the submissions of slice gradebooks into the course's")
    m.add_argument("target", help="the course's gradebook.db")
    m.add_argument("slices", nargs="+", help="the slices' gradebook files")
    m.set_defaults(fn=cmd_merge)
    b = sub.add_parser("bench", help="cold check, warm check and class-scale autograde timings")
    b.add_argument("--n", type=int, default=20, help="submissions to autograde (0: skip)")
    b.add_argument("--jobs", type=int, default=2)
    b.add_argument("--repeats", type=int, default=3)
    b.set_defaults(fn=cmd_bench)
    q = sub.add_parser("repeat-scores", help="grade every correct submission N times: the same score every run")
    q.add_argument("weeks", nargs="*", help="weeks to grade (default: all)")
    q.add_argument("--runs", type=int, default=10)
    q.add_argument("--busy", type=int, default=0, help="processes spinning beside the runs (2: a busy 2-core machine)")
    q.add_argument("--wrong", action="store_true", help="the wrong submissions too: each fails exactly the grade cells "
                   "its manifest names, on every draw")
    q.set_defaults(fn=cmd_repeat_scores)
    sub.add_parser("gpu-check", help="on a CUDA machine: the install, every lab on NCCL, the lectures' GPU cells"
                   ).set_defaults(fn=cmd_gpu_check)
    a = p.parse_args(argv)
    if a.cmd != "check":
        from tpkit.selfcheck import has_grader
        if not has_grader():
            print(f"error: this is a student install of the course (no grader here): `{a.cmd}` runs in the course "
                  "root; here only `python -m grader check NOTEBOOK` works, graded by the course's grading service",
                  file=sys.stderr)
            return 2
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
