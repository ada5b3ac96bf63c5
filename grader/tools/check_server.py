"""A resident trusted process for `python -m grader check`: a lab's later checks start warm.

A check starts three interpreters that each import torch: this trusted process (inputs, references, comparison),
the job's launcher in its box (the ranks fork from it), and the notebook's kernel in its box. The first two need not
be paid per check, nor the kernel's start. After a cold check, a check server stays up. Its imports are done, and
it has already started what the lab's next check needs: the job's launcher, held in a new box (as
`hold_first_attempt` holds one for any job), and a new boxed kernel that has run nothing. A later
`python -m grader check` of the same lab hands it the notebook, and it grades as a local check would:
- each check still gets a new box, launcher and ranks, and a new kernel, used once;
- the server never runs submitted code, and reads the boxes' output the way a local check does;
- nothing of one check's data is carried into the next one.

- **Which server.** There is one per user, interpreter, course code and environment (the variables the grader,
  torch and Jupyter read). A check that differs in any of those gets a server of its own. A server exits when its
  code changes, after IDLE_EXIT_S seconds with no check, or on `python -m grader check-server --stop`. It gives
  back what it holds when it exits.
- **Who can reach it.** Its socket is in /tmp/course-grader-UID/ (mode 0700, this user's). A box sees neither the
  folder nor the socket.
- **One check at a time.** A second check waits for the first.
- **Turning it off.** GRADER_CHECK_SERVER=off: every check runs in its own process and starts no server. The test
  suite runs that way.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import io
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass

from grader import ROOT

IDLE_EXIT_S = 600          # a server with no check for this long exits
ANSWER_TIMEOUT_S = 900     # a check's answer, at most: each job's wall clock and the kernel's timeouts are far below
POLL_S = 5.0               # how often an idle server looks at its code and its clock
# what a check's outcome may depend on: a check whose values differ is served by another server
_ENV_PREFIXES = ("GRADER_", "COURSE_", "OMP_", "MKL_", "CUDA_", "NCCL_", "TORCH", "PYTHON", "JUPYTER", "IPYTHON",
                 "MPL", "XDG_")
_ENV_NAMES = ("PATH", "HOME", "TMPDIR", "VIRTUAL_ENV", "LANG", "LC_ALL")


def mode() -> str:
    value = os.environ.get("GRADER_CHECK_SERVER", "on")
    if value not in ("on", "off"):
        raise ValueError(f"GRADER_CHECK_SERVER={value!r} is unknown: use on (the default) or off")
    return value


def folder() -> str | None:
    """/tmp/course-grader-UID: this user's alone (mode 0700), or None when it cannot be (someone else made it)."""
    path = f"/tmp/course-grader-{os.getuid()}"
    with contextlib.suppress(FileExistsError, OSError):
        os.mkdir(path, 0o700)
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return path


def _code() -> str:
    """Changes with any module the server imports from the course: its packages and the lectures' references."""
    from launch.zygote import code_fingerprint
    return code_fingerprint(("launch", "grader", "tpkit", "reference"))


def address(environ=None) -> str | None:
    """The socket of the server for this interpreter, course code and environment (`environ`, default this
    process's); None: no safe folder."""
    where = folder()
    if where is None:
        return None
    env = sorted((k, v) for k, v in (os.environ if environ is None else environ).items()
                 if k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES)
    key = hashlib.sha256(json.dumps([sys.executable, _code(), env]).encode()).hexdigest()[:16]
    return os.path.join(where, f"{key}.sock")


def check(path: str, backend: str | None = None, execute: bool = True, out: str | None = None) -> int:
    """`python -m grader check`: through this user's check server when one is up; else here, and then one is
    started for the next check."""
    from grader.tools.cli_check import check_notebook
    try:
        sock = address() if mode() == "on" else None
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    if sock is None:
        return check_notebook(path, backend=backend, execute=execute, out=out)
    code = ask(sock, {"notebook": path, "backend": backend, "execute": execute, "out": out, "cwd": os.getcwd()})
    if code is not None:
        return code
    print("note: this check starts cold; a check server then keeps the grader warm for the next ones "
          f"({IDLE_EXIT_S // 60} idle minutes; GRADER_CHECK_SERVER=off turns it off)", flush=True)
    code = check_notebook(path, backend=backend, execute=execute, out=out)
    if os.path.exists(path):
        spawn(sock, os.path.abspath(path))    # after the check: it does not compete with it for the cores
    return code


def ask(sock: str, request: dict) -> int | None:
    """Send `request` to the server at `sock`, print what it prints; its exit code, or None where it cannot
    answer (none is up, its code is stale, it stopped midway)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(ANSWER_TIMEOUT_S)
    try:
        conn.connect(sock)
    except OSError:
        conn.close()
        return None
    with conn:
        try:
            conn.sendall(json.dumps(request).encode() + b"\n")
            for line in conn.makefile("r", encoding="utf-8"):
                msg = json.loads(line)
                if "text" in msg:
                    stream = sys.stderr if msg.get("to") == 2 else sys.stdout
                    stream.write(msg["text"])
                    stream.flush()
                elif "exit" in msg:
                    return int(msg["exit"])
                elif msg.get("stopped"):     # its code changed: it exits, this check runs here
                    return None
        except (OSError, ValueError, TypeError):
            pass
    print("note: the check server stopped before it answered; this check runs here", flush=True)
    return None


def spawn(sock: str, notebook: str):
    """Start a server at `sock` in the background, holding a job for `notebook`'s checks (its output: NAME.log)."""
    with open(sock[:-len(".sock")] + ".log", "w") as log:     # removed by the server when it exits cleanly
        subprocess.Popen([sys.executable, "-m", "grader", "check-server", "--socket", sock, "--notebook", notebook],
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=ROOT, start_new_session=True)


def stop(sock: str) -> bool:
    """Stop the server at `sock` (after the check it is serving); False where none was up."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(ANSWER_TIMEOUT_S)
            conn.connect(sock)
            conn.sendall(b'{"stop": true}\n')
            conn.recv(64)
        return True
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(sock)     # no server behind it
        return False


def stop_all() -> int:
    """Stop this user's check servers; returns how many were up."""
    where = folder()
    return sum(stop(sock) for sock in sorted(glob.glob(os.path.join(where, "*.sock")))) if where else 0


class _Wire(io.TextIOBase):
    """sys.stdout or sys.stderr of a served check: each write goes to the client as one message. A client that left
    (Ctrl-C) gets nothing more; the check still runs to its end, within its own timeouts."""

    def __init__(self, conn: socket.socket, to: int, lock: threading.Lock):
        self.conn, self.to, self.lock, self.open = conn, to, lock, True

    def write(self, text: str) -> int:
        if text and self.open:
            with self.lock:         # the checks' thread prints too: one message at a time on the socket
                try:
                    self.conn.sendall(json.dumps({"to": self.to, "text": text}).encode() + b"\n")
                except OSError:
                    self.open = False
        return len(text)


def _names(notebook: str) -> list[str] | None:
    from grader.autograde.notebook import check_names_in
    try:
        with open(notebook, "rb") as f:
            return check_names_in(json.load(f))
    except (OSError, ValueError, AttributeError, TypeError):
        return None


@dataclass
class _Held:
    """What the server started for the next check of a lab: its job's first attempt (launcher held in a new box)
    and a new boxed kernel that has run nothing. A check that does not fit them gives them back."""
    names: list[str]
    first: object | None
    kernel: object | None

    def give_back(self, first: bool = True, kernel: bool = True):
        from grader.autograde.notebook import give_up
        from grader.tools.cli_check import stop_kernel
        if first and self.first is not None:
            give_up(self.first)
        if kernel and self.kernel is not None:
            stop_kernel(self.kernel)


def _hold(notebook: str) -> _Held | None:
    """Start what the next check of `notebook` needs: its job's launcher, a kernel, and what such a check imports on
    its way (the kernel's spec, the weeks' cases and references). None where the notebook names no check."""
    from grader.judge.attempt import hold_first_attempt
    from grader.judge.case import cases_of_week
    from grader.tools.cli_check import start_kernel
    names = _names(notebook)
    if not names:
        return None
    try:
        first = hold_first_attempt(names)
    except Exception:   # noqa: BLE001  no box here: the check itself meets it and says so
        first = None
    try:
        with tempfile.TemporaryDirectory(prefix="grader-check-") as empty:
            kernel = start_kernel(empty)
    except Exception:   # noqa: BLE001  likewise
        kernel = None
    with contextlib.suppress(Exception):
        for week in dict.fromkeys(n.split("/")[0] for n in names):
            cases_of_week(week)
    return _Held(names, first, kernel)


def _serve_check(conn: socket.socket, request: dict, held: _Held | None) -> str | None:
    """Run one check for the client on `conn`, in its folder, with what `held` started where it fits (what does not
    fit is given back); returns the notebook's path."""
    from grader.tools.cli_check import check_notebook
    cwd, path = request.get("cwd"), request.get("notebook")
    notebook = os.path.join(cwd, path) if isinstance(cwd, str) and isinstance(path, str) else None
    fits = held is not None and notebook is not None and not request.get("backend") and held.names == _names(notebook)
    execute = bool(request.get("execute", True))
    first = held.first if fits else None
    kernel = held.kernel if fits and execute else None
    if held is not None:
        held.give_back(first=first is None, kernel=kernel is None)
    env = dict(os.environ)
    code = 1
    try:
        if notebook is None:
            raise OSError("not a check request (it names no notebook and folder)")
        os.chdir(cwd)
        lock = threading.Lock()
        with contextlib.redirect_stdout(_Wire(conn, 1, lock)), contextlib.redirect_stderr(_Wire(conn, 2, lock)):
            try:
                code = check_notebook(path, backend=request.get("backend"), execute=execute,
                                      out=request.get("out"), first=first, kernel=kernel)
            except Exception:   # noqa: BLE001  what a local check would print; the server stays up
                traceback.print_exc()
    except OSError as exc:      # the client's folder is gone
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"to": 2, "text": f"error: {exc}\n"}).encode() + b"\n")
        code = 2
    finally:
        os.chdir(ROOT)
        os.environ.clear()
        os.environ.update(env)   # a check may set COURSE_BACKEND for its own process
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
    return notebook


def serve(sock: str, notebook: str, idle: float | None = None) -> int:
    """The server at `sock`; it first holds a job for `notebook`'s checks. Exits after `idle` s with no check."""
    idle = IDLE_EXIT_S if idle is None else idle
    stem = sock[:-len(".sock")]
    lock = open(stem + ".lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return 0            # another server serves this address
    with contextlib.suppress(FileNotFoundError):
        os.unlink(sock)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock)
    os.chmod(sock, 0o600)
    srv.listen(8)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    held = None
    try:
        # the imports come after the bind: a check that arrives meanwhile waits for them rather than starting cold
        import nbformat  # noqa: F401
        import papermill  # noqa: F401
        import torch  # noqa: F401
        from grader.judge import job  # noqa: F401
        fingerprint = _code()
        held = _hold(notebook)
        last = time.monotonic()
        srv.settimeout(POLL_S)
        while time.monotonic() - last < idle and _code() == fingerprint:
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                continue
            with conn:
                conn.settimeout(ANSWER_TIMEOUT_S)
                try:
                    request = json.loads(conn.makefile("r", encoding="utf-8").readline())
                except (OSError, ValueError):
                    continue
                if not isinstance(request, dict) or request.get("stop") or _code() != fingerprint:
                    conn.sendall(json.dumps({"stopped": True}).encode() + b"\n")
                    break
                notebook = _serve_check(conn, request, held) or notebook
                held = None
            held = _hold(notebook)
            last = time.monotonic()
        with contextlib.suppress(OSError):
            os.unlink(stem + ".log")    # kept only when the server failed
        return 0
    finally:        # the address first: a give-back that fails still leaves no server behind a socket
        srv.close()
        for path in (sock, stem + ".lock"):
            with contextlib.suppress(OSError):
                os.unlink(path)
        if held is not None:
            held.give_back()
