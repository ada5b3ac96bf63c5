"""The class's trusted grading service, and the student install it serves.

A student's account holds a **student install** (`python -m grader student-install DEST`): labs/, tpkit/, launch/,
grader/__init__.py, grader/__main__.py and grader/rank/ (the rank side and the typed exchange module, without the
per-week runners grader/rank/weekNN.py: only grading runs them, and week06.py holds week 5's answer). It holds no
reference/, solutions/, grader/cases, grader/judge, grader/autograde, lecture notebooks or gradebook: nothing a
student could read an answer from. Its `check(...)` and `python -m grader check NOTEBOOK` grade nothing themselves;
they send the kernel's modules, or the notebook's JSON, to this service (the socket COURSE_GRADING_SERVICE names)
and print its answer.

The service (`python -m grader grading-service --socket PATH`) is a long-running trusted process that runs as its
own user (the instructor's, or a `grader` account) from the full course root. It:
- listens on a Unix socket made 0660 (its owner and, with --group, the class's group), in a folder that nobody but
  its owner may write (so no student can put another socket in its place); it refuses to start otherwise;
- learns who asks from the socket itself (SO_PEERCRED: uid, pid) and logs it; it never reads a student's file:
  a request carries the notebook's JSON or the modules' text, and one that names a path is refused;
- runs exactly the trusted checks `python -m grader check` runs (grader/tools/cli_check.py `check_notebook`:
  the released grade cells, the boxed kernel, one sandboxed job) or, for a kernel's `check()`, the checks it names
  on the modules it sends (tpkit/selfcheck.py `run_local`, sandboxed as the service's GRADER_SANDBOX says: it
  refuses to start with GRADER_SANDBOX=off unless told --allow-unboxed, for a machine with no students);
- streams the verdicts back as they are printed, then the exit status and the score;
- is bounded: a request is one JSON line of at most MAX_REQUEST_BYTES sent within REQUEST_TIMEOUT_S; one check at a
  time per uid (a second is refused at once, never queued); at most `max_checks` at a time in all; each check in its
  own forked process (its own stdout, folder and environment) that is killed with what it started after `timeout`
  seconds. A malformed request is answered with an error that says what was wrong.

The wire (shared with the client in tpkit/selfcheck.py): the client sends one line, a JSON object
  {"notebook": {...the .ipynb JSON...}, "name": "tp_linear.ipynb", "execute": true}   or
  {"checks": ["week02/column_parallel"], "modules": {"tp_linear.py": "..."}}
and reads lines {"to": 1|2, "text": ...} (what the check prints), then {"exit": N, "score": "8/8"}, or
{"error": "..."} where the request is refused.
"""
from __future__ import annotations

import contextlib
import glob
import grp
import json
import os
import pwd
import re
import select
import shutil
import signal
import socket
import stat
import struct
import sys
import tempfile
import threading
import time

from grader import ROOT
from grader.tools.check_server import ANSWER_GRACE_S, _kill_children, _send, _Wire

MAX_REQUEST_BYTES = 4 << 20      # one request: a lab notebook is 10 to 60 kB, a module at most 1 MB
REQUEST_TIMEOUT_S = 10           # a client sends its whole request within this after it connects
SERVICE_CELL_TIMEOUT = 300.0     # a cell of a served notebook run (a lab's cells take seconds)
DRAIN_S = 2.0                    # a refused client's unread request is read and dropped for this long at most
REAP_WAIT_S = 0.5              # a client's next check may arrive before its last one's process is gone
KILL_GRACE_S = 15                # past a check's timeout, the service kills its process group
MAX_CHECKS = max(1, (os.cpu_count() or 2) // 2)
NOTEBOOK_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}\.ipynb")
MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}\.py")
MAX_CHECK_NAMES = 64
MAX_DRAINING = 64                # refused connections drained at once; past it one is closed as it is
KEYS = {"notebook": {"notebook", "name", "execute"}, "checks": {"checks", "modules"}}

# what a student install holds (relative to the course root), and what it never holds
STUDENT_TREE = ("labs", "tpkit", "launch", "grader/rank", "grader/__init__.py", "grader/__main__.py")
NEVER = ("reference", "solutions", "notebooks", "grader/cases", "grader/judge", "grader/autograde", "grader/box",
         "grader/tools", "tests", "source", "submitted", "autograded", "feedback", "release", "gradebook.db")
_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints", "hub", "*.db", "*.db-journal")
# a student install never runs a grading rank (the service grades, from the course root), so it leaves out what each
# week's ranks run: grader/rank/week06.py, for one, holds week 5's answer (the sequence all-gather and reduce-scatter)
_SKIP_RANK = shutil.ignore_patterns("__pycache__", "*.pyc", "week[0-9]*.py")


# ---------------------------------------------------------------------------------------------- the student install

def student_install(dest: str, force: bool = False) -> list[str]:
    """Write a student install into `dest` (a new or empty folder; `force`: replace what an earlier install wrote).
    Returns the top-level entries written."""
    dest = os.path.abspath(dest)
    if os.path.realpath(dest).startswith(os.path.realpath(ROOT) + os.sep) or os.path.realpath(dest) == ROOT:
        raise ValueError(f"{dest} is inside the course root: give a folder outside it")
    if os.path.exists(dest) and os.listdir(dest) and not force:
        raise ValueError(f"{dest} is not empty (--force replaces an earlier student install there)")
    os.makedirs(dest, exist_ok=True)
    for rel in STUDENT_TREE:
        src, out = os.path.join(ROOT, rel), os.path.join(dest, rel)
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        if os.path.isdir(src):
            shutil.copytree(src, out, ignore=_SKIP_RANK if rel == "grader/rank" else _SKIP, symlinks=False)
        else:
            shutil.copy2(src, out)
    for rel in NEVER:       # a leftover of an older layout, or of a mistake: never part of an install
        path = os.path.join(dest, rel)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.unlink(path)
    with open(os.path.join(dest, "STUDENT_INSTALL.txt"), "w") as f:
        f.write("A student install of the tensor-parallelism course (python -m grader student-install).\n"
                "Open labs/weekNN/*.ipynb; check(...) and `python -m grader check NOTEBOOK` are graded by the\n"
                "course's grading service: COURSE_GRADING_SERVICE must name its socket (your hub sets it).\n")
    for top, dirs, files in os.walk(dest):          # readable by every account, writable by none
        os.chmod(top, 0o755)
        for name in files:
            os.chmod(os.path.join(top, name), 0o644)
    return sorted(os.listdir(dest))


# ------------------------------------------------------------------------------------------------------ the service

def _log(msg: str):
    sys.__stderr__.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} grading-service[{os.getpid()}] {msg}\n")
    sys.__stderr__.flush()


def _peer(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of `conn`, as the kernel tells it (SO_PEERCRED)."""
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def _user(uid: int) -> str:
    try:
        return f"{uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return str(uid)


class Refused(Exception):
    """A request the service will not run; its text goes to the client."""


def read_request(conn: socket.socket, limit: int = MAX_REQUEST_BYTES, timeout: float = REQUEST_TIMEOUT_S) -> dict:
    """The client's one-line JSON request, read within `timeout` s and `limit` bytes, checked field by field."""
    deadline = time.monotonic() + timeout
    data = bytearray()
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Refused(f"no complete request within {timeout:g} s (send one JSON line)")
        conn.settimeout(left)
        try:
            chunk = conn.recv(1 << 16)
        except socket.timeout:
            continue
        if not chunk:
            raise Refused("the request ended before its newline")
        data += chunk
        if len(data) > limit + 1:
            raise Refused(f"the request is larger than {limit >> 20} MiB: refused unread")
    line = bytes(data.split(b"\n", 1)[0])
    if len(line) > limit:
        raise Refused(f"the request is larger than {limit >> 20} MiB: refused")
    try:
        request = json.loads(line)
    except ValueError as exc:
        raise Refused(f"the request is not JSON ({exc})") from None
    return validate(request)


def validate(request) -> dict:
    """The request if it is one the service runs; Refused saying why otherwise."""
    if not isinstance(request, dict):
        raise Refused("the request must be a JSON object")
    if isinstance(request.get("notebook"), str) or any(k in request for k in ("path", "cwd", "out", "file")):
        raise Refused("the grading service reads none of your files: send the notebook itself (its JSON), not a "
                      "path (`python -m grader check NOTEBOOK` does)")
    kind = "notebook" if "notebook" in request else "checks" if "checks" in request else None
    if kind is None:
        raise Refused('the request has neither "notebook" (a notebook\'s JSON) nor "checks" (with "modules")')
    extra = set(request) - KEYS[kind]
    if extra:
        raise Refused(f"unknown field(s) {', '.join(sorted(extra))}; a {kind} request has "
                      f"{', '.join(sorted(KEYS[kind]))}")
    if kind == "notebook":
        nb, name = request["notebook"], request.get("name", "notebook.ipynb")
        if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
            raise Refused('"notebook" must be a notebook\'s JSON (an object with "cells")')
        if not isinstance(name, str) or not NOTEBOOK_NAME.fullmatch(name):
            raise Refused(f'"name" must be a plain notebook file name such as tp_linear.ipynb, not {name!r}')
        if not isinstance(request.get("execute", True), bool):
            raise Refused('"execute" must be true or false')
        return request
    names, modules = request["checks"], request.get("modules")
    if not (isinstance(names, list) and 0 < len(names) <= MAX_CHECK_NAMES and all(isinstance(n, str) and
                                                                                    len(n) < 200 for n in names)):
        raise Refused(f'"checks" must be a list of 1 to {MAX_CHECK_NAMES} check names, e.g. ["week02/column_parallel"]')
    if not isinstance(modules, dict) or not all(isinstance(k, str) and MODULE_NAME.fullmatch(k) and isinstance(v, str)
                                                for k, v in modules.items()):
        raise Refused('"modules" must map plain module file names (tp_linear.py) to their text')
    return request


def _refuse(conn: socket.socket, why: str):
    """Answer `why`, then end this side: the client reads the answer, then the end."""
    _send(conn, {"error": why})
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)


def _drain(conn: socket.socket, until: float) -> bool:
    """Read and drop what the client still sends (closing on unread bytes would reset the connection before the
    client read its answer), until it closes or `until`; True when done."""
    conn.setblocking(False)
    try:
        while time.monotonic() < until:
            try:
                if not conn.recv(1 << 16):
                    return True
            except BlockingIOError:
                if not select.select([conn], [], [], max(0.0, min(0.1, until - time.monotonic())))[0]:
                    continue
            except OSError:
                return True
        return True
    finally:
        conn.close()


def _score_of(text: str) -> str | None:
    found = re.findall(r"^score: (\S+)$", text, re.M)
    return found[-1] if found else None


class _Tee(_Wire):
    """The check server's wire to the client, keeping the last KEEP characters (where the score is printed)."""
    KEEP = 4096

    def __init__(self, *a):
        super().__init__(*a)
        self.tail = ""

    def write(self, text: str) -> int:
        self.tail = (self.tail + text)[-self.KEEP:]
        return super().write(text)


def _run_notebook(request: dict, out: _Tee, cell_timeout: float) -> int:
    """`python -m grader check` on the notebook JSON the client sent, written into this check's own folder."""
    from grader.tools.cli_check import check_notebook
    with tempfile.TemporaryDirectory(prefix="notebook-") as work:
        path = os.path.join(work, request.get("name", "notebook.ipynb"))
        with open(path, "w") as f:
            json.dump(request["notebook"], f)
        return check_notebook(path, execute=request.get("execute", True), timeout=cell_timeout)


def released_checks() -> list[str]:
    """The checks the released labs' grade cells call: all a kernel's check() may ask for (hidden ones are not)."""
    from grader.autograde.notebook import check_names_of, grade_cells
    names: list[str] = []
    for path in sorted(glob.glob(os.path.join(ROOT, "labs", "week*", "*.ipynb"))):
        with open(path) as f:
            names += [n for n in check_names_of(grade_cells(json.load(f))) if n not in names]
    return names


_RELEASED: list[str] = []       # released_checks(), read once by the service before it forks


def _run_checks(request: dict, out: _Tee) -> tuple[int, str]:
    """A kernel's `check(...)`: the named checks on the modules it sent, as tpkit.check runs them (sandboxed)."""
    from tpkit.selfcheck import run_local
    names = request["checks"]
    unknown = [n for n in names if n not in (_RELEASED or released_checks())]
    if unknown:
        print(f"error: no check named {unknown[0]!r} in the released labs. Known checks: {', '.join(_RELEASED)}")
        return 2, None
    try:
        passed, text = run_local(names, request["modules"],
                                 where="your notebook's folder (the modules your kernel sent)",
                                 sandbox=os.environ.get("GRADER_SANDBOX", "auto"))
    except (KeyError, ValueError, AssertionError) as exc:
        print(f"error: {exc.args[0] if exc.args else exc}")
        return 2, None
    print(text)
    n = len(names)
    return (0 if passed else 1), (f"{n}/{n}" if passed else None)


def _serve_one(conn: socket.socket, uid: int, timeout: float, cell_timeout: float) -> int:
    """In the forked child: read, check and run one request, answering on `conn`."""
    try:
        request = read_request(conn)
    except Refused as exc:
        _log(f"uid {_user(uid)}: refused: {exc}")
        _refuse(conn, str(exc))
        _drain(conn, time.monotonic() + DRAIN_S)
        return 2
    what = request.get("name", "notebook") if "notebook" in request else ",".join(request["checks"])
    _log(f"uid {_user(uid)}: {what}")
    return _serve_request(conn, uid, request, what, timeout, cell_timeout)


def _serve_request(conn: socket.socket, uid: int, request: dict, what: str, timeout: float,
                   cell_timeout: float) -> int:
    lock = threading.Lock()
    out, err = _Tee(conn, 1, lock), _Wire(conn, 2, lock)

    def expire():
        with lock:
            _send(conn, {"error": f"the check ran past the grading service's {timeout:g} s limit and was stopped"})
        _kill_children()
        _log(f"uid {_user(uid)}: {what}: stopped after {timeout:g} s")
        os._exit(3)     # the service unmounts and removes what it left (`_clean`)

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    t0 = time.monotonic()
    score = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if "notebook" in request:
                code = _run_notebook(request, out, cell_timeout)
                score = _score_of(out.tail)
            else:
                code, score = _run_checks(request, out)
        except Exception as exc:    # noqa: BLE001  the grader failed: said, never a silent pass
            print(f"error: the grader could not run: {type(exc).__name__}: {exc}")
            code = 2
    timer.cancel()
    with lock:
        _send(conn, {"exit": code, "score": score})
    _log(f"uid {_user(uid)}: {what}: exit {code}, score {score}, {time.monotonic() - t0:.1f} s")
    return code


def _check_folder(sock: str, allow_shared_folder: bool):
    where = os.path.dirname(os.path.abspath(sock))
    st = os.stat(where)
    if st.st_mode & 0o022 and not allow_shared_folder:
        raise SystemExit(f"error: {where} is writable by others (mode {stat.S_IMODE(st.st_mode):o}): a student could "
                         "put a socket of their own in the service's place. Use a folder only the service's user "
                         "writes, e.g. install -d -o grader -g students -m 0750 /run/tp-course")


def serve(sock: str, group: str | None = None, max_checks: int = MAX_CHECKS, timeout: float | None = None,
          cell_timeout: float = SERVICE_CELL_TIMEOUT, allow_unboxed: bool = False) -> int:
    """Serve students' checks at `sock` until SIGTERM or SIGINT."""
    from grader.tools.cli_check import run_timeout
    timeout = timeout or run_timeout(cell_timeout) + ANSWER_GRACE_S
    if os.environ.get("GRADER_SANDBOX") == "off" and not allow_unboxed:
        print("error: GRADER_SANDBOX=off: the service would run students' code unboxed as its own user. Unset it "
              "(or, on a machine with no students, pass --allow-unboxed)", file=sys.stderr)
        return 2
    _check_folder(sock, allow_shared_folder=False)
    gid = grp.getgrnam(group).gr_gid if group else -1
    # the imports a check needs, done once: every check forks from here warm
    import nbformat  # noqa: F401
    import papermill  # noqa: F401
    import torch  # noqa: F401
    from grader.judge import job  # noqa: F401
    from grader.judge.case import cases_of_week
    from grader.tools import cli_check  # noqa: F401
    _RELEASED[:] = released_checks()
    for path in sorted(os.listdir(os.path.join(ROOT, "grader", "cases"))):
        if re.fullmatch(r"week\d+\.py", path):
            cases_of_week(path[:-3])
    with contextlib.suppress(FileNotFoundError):
        os.unlink(sock)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        srv.bind(sock)
    finally:
        os.umask(old)
    if gid != -1:
        os.chown(sock, -1, gid)
    os.chmod(sock, 0o660)
    srv.listen(64)
    running: dict[int, tuple[int, socket.socket, float, str]] = {}    # pid -> (uid, conn, deadline, its folder)
    draining: dict[socket.socket, float] = {}                       # refused, their requests read and dropped until
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    _log(f"serving {sock} (mode 0660{f', group {group}' if group else ''}; {max_checks} check(s) at a time, one per "
         f"uid; {timeout:g} s each)")
    try:
        while not stopping:
            _reap(running)
            try:
                ready = select.select([srv, *draining], [], [], 0.5)[0]
            except InterruptedError:
                continue
            now = time.monotonic()
            for conn in list(draining):
                if conn in ready or now > draining[conn]:
                    with contextlib.suppress(OSError):
                        if conn in ready and now <= draining[conn] and conn.recv(1 << 16):
                            continue
                    del draining[conn]
                    conn.close()
            if srv not in ready:
                continue
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            pid, uid = _peer(conn)
            _reap(running, wait_for=uid)
            why = None
            if any(u == uid for u, _, _, _ in running.values()):
                why = "you have a check running already: one at a time; wait for its answer"
            elif len(running) >= max_checks:
                why = f"the grading service is busy with {len(running)} checks; try again in a minute"
            if why is not None:
                _log(f"uid {_user(uid)} (pid {pid}): refused: {why}")
                conn.setblocking(False)
                _refuse(conn, why)
                if len(draining) < MAX_DRAINING:
                    draining[conn] = time.monotonic() + DRAIN_S
                else:
                    conn.close()
                continue
            # every folder the check makes (its job's, its kernel's, the notebook's) goes under one, which the
            # service removes when the check ends, however it ended
            work = tempfile.mkdtemp(prefix="grading-service-")
            child = os.fork()
            if child == 0:
                code = 2
                try:
                    os.setpgid(0, 0)
                    tempfile.tempdir = work
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    signal.signal(signal.SIGINT, signal.SIG_DFL)
                    srv.close()
                    for other in [c for _, c, _, _ in running.values()] + list(draining):
                        other.close()
                    code = _serve_one(conn, uid, timeout, cell_timeout)
                finally:
                    with contextlib.suppress(Exception):
                        sys.stdout.flush()
                        conn.close()
                    os._exit(code)
            running[child] = (uid, conn, time.monotonic() + timeout + KILL_GRACE_S, work)
    finally:
        srv.close()
        with contextlib.suppress(OSError):
            os.unlink(sock)
        for child, (_, conn, _, _) in running.items():
            with contextlib.suppress(OSError):
                os.killpg(child, signal.SIGKILL)
            conn.close()
        for child, (_, _, _, work) in running.items():
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child, 0)
            _clean(work)
        _log("stopped")
    return 0


def _clean(work: str):
    """Remove a check's folder (every folder the check made is under it), unmounting first what its job mounted there
    (its ranks' capped out/ folders): a check that was killed did not."""
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    from launch.isolation import unmount
    for point in sorted((p for p in points if p.startswith(work + "/")), key=len, reverse=True):
        with contextlib.suppress(Exception):
            unmount(point)
    shutil.rmtree(work, ignore_errors=True)


def _reap(running: dict, wait_for: int | None = None):
    """Forget the checks that ended; kill those past their deadline (the child's own timer failed). wait_for: a uid
    whose check may be ending (its answer sent, its process not yet gone): wait REAP_WAIT_S at most for it."""
    now = time.monotonic()
    for child, (uid, conn, deadline, work) in list(running.items()):
        done, _ = os.waitpid(child, os.WNOHANG)
        end = time.monotonic() + REAP_WAIT_S if uid == wait_for else 0
        while not done and time.monotonic() < end:
            time.sleep(0.02)
            done, _ = os.waitpid(child, os.WNOHANG)
        if not done and now > deadline:
            with contextlib.suppress(OSError):
                os.killpg(child, signal.SIGKILL)
            _send(conn, {"error": "the check ran past the grading service's limit and was stopped"})
            os.waitpid(child, 0)
            done = child
        if done:
            conn.close()
            _clean(work)
            del running[child]
