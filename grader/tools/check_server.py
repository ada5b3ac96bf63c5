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
- **One check at a time, never a wait.** A check that arrives while the server is busy runs in its own process. A
  check's own time is bounded (its notebook's run, its job's wall clock: grader/tools/cli_check.py), and so is its
  client's wait for the answer.
- **Stopping.** `python -m grader check-server --stop` is answered within seconds, even during a check: the server
  kills what that check runs (its kernel, its job's launcher), tells its client, and exits.
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
import select
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
ANSWER_GRACE_S = 60        # a client waits this long beyond its check's bound (the notebook's run, the job's clock)
REQUEST_TIMEOUT_S = 10     # a client sends its request as it connects
STOP_WAIT_S = 5            # a stopped check ends within this once what it runs is killed; else the server exits anyway
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


def check(path: str, backend: str | None = None, execute: bool = True, out: str | None = None,
          timeout: float | None = None) -> int:
    """`python -m grader check`: through this user's check server when one is up and free; else here, and then one
    is started for the next check. timeout: seconds a cell of the notebook may run (default: CELL_TIMEOUT)."""
    from grader.tools.cli_check import CELL_TIMEOUT, check_notebook, run_timeout
    timeout = CELL_TIMEOUT if timeout is None else timeout
    try:
        sock = address() if mode() == "on" else None
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    if sock is None:
        return check_notebook(path, backend=backend, execute=execute, out=out, timeout=timeout)
    # the longest the server is silent: the check's own bound (its job's wall clock is below a default cell's)
    wait = run_timeout(max(timeout, CELL_TIMEOUT)) + ANSWER_GRACE_S
    answer = ask(sock, {"notebook": path, "backend": backend, "execute": execute, "out": out, "cwd": os.getcwd(),
                        "timeout": timeout}, wait)
    if isinstance(answer, int):
        return answer
    if answer == "busy":
        print("note: the check server is busy with another check; this one runs on its own", flush=True)
        return check_notebook(path, backend=backend, execute=execute, out=out, timeout=timeout)
    print("note: this check starts cold; a check server then keeps the grader warm for the next ones "
          f"({IDLE_EXIT_S // 60} idle minutes; GRADER_CHECK_SERVER=off turns it off)", flush=True)
    code = check_notebook(path, backend=backend, execute=execute, out=out, timeout=timeout)
    if os.path.exists(path):
        spawn(sock, os.path.abspath(path))    # after the check: it does not compete with it for the cores
    return code


def ask(sock: str, request: dict, wait: float) -> int | str | None:
    """Send `request` to the server at `sock`, print what it prints, at most `wait` seconds apart; its exit code,
    "busy" where it serves another check, or None where it cannot answer (none is up, its code is stale, it stopped
    midway)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(wait)
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
                elif msg.get("busy"):
                    return "busy"
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
    """Stop the server at `sock` (and the check it is serving); False where none was up."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(REQUEST_TIMEOUT_S + STOP_WAIT_S + POLL_S)
            conn.connect(sock)
            conn.sendall(b'{"stop": true}\n')
            conn.recv(64)
        return True
    except socket.timeout:      # up, but not answering: left to its idle exit
        return False
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
    """The checks a check of `notebook` runs (its released grade cells')."""
    from grader.autograde.notebook import check_names_of, released_grade_cells
    try:
        with open(notebook, "rb") as f:
            return check_names_of(released_grade_cells(json.load(f), os.path.basename(notebook))[0])
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


def _serve_check(conn: socket.socket, request: dict, held: _Held | None,
                 lock: threading.Lock) -> tuple[str | None, int]:
    """Run one check for the client on `conn` (written under `lock`), in its folder, with what `held` started where it
    fits (what does not fit is given back); returns the notebook's path and the check's exit status."""
    from grader.tools.cli_check import CELL_TIMEOUT, check_notebook
    cwd, path = request.get("cwd"), request.get("notebook")
    notebook = os.path.join(cwd, path) if isinstance(cwd, str) and isinstance(path, str) else None
    fits = held is not None and notebook is not None and not request.get("backend") and held.names == _names(notebook)
    execute = bool(request.get("execute", True))
    first = held.first if fits else None
    kernel = held.kernel if fits and execute else None
    if held is not None:
        held.give_back(first=first is None, kernel=kernel is None)
    timeout = request.get("timeout")
    timeout = timeout if type(timeout) in (int, float) and timeout > 0 else CELL_TIMEOUT
    conn.settimeout(ANSWER_GRACE_S)     # a client that stops reading loses its output; the check goes on
    env = dict(os.environ)
    code = 1
    try:
        if notebook is None:
            raise OSError("not a check request (it names no notebook and folder)")
        os.chdir(cwd)
        with contextlib.redirect_stdout(_Wire(conn, 1, lock)), contextlib.redirect_stderr(_Wire(conn, 2, lock)):
            try:
                code = check_notebook(path, backend=request.get("backend"), execute=execute,
                                      out=request.get("out"), first=first, kernel=kernel, timeout=timeout)
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
    return notebook, code


def _send(conn: socket.socket, msg: dict):
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps(msg).encode() + b"\n")


def _request(conn: socket.socket) -> dict | None:
    """What a client asks as it connects; None: nothing, or no request."""
    conn.settimeout(REQUEST_TIMEOUT_S)
    try:
        request = json.loads(conn.makefile("r", encoding="utf-8").readline())
    except (OSError, ValueError):
        return None
    return request if isinstance(request, dict) else None


def _kill_children():
    """SIGKILL every process this server started (a kernel's box, a job's launcher), each with its process group."""
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == os.getpid():
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(OSError):
                    kill(int(pid), signal.SIGKILL)


class _Door:
    """While the server's thread is busy (a check, or starting what the next one needs), this one answers at its
    socket: a stop kills what is in flight, then ends the server; a check that arrives during a check (`client`, the
    one in flight) is told to run on its own, never to wait; the first that arrives while the server prepares is
    kept for it (`pending`)."""

    def __init__(self, srv: socket.socket, client: socket.socket | None = None, lock: threading.Lock | None = None):
        self.srv, self.client, self.lock = srv, client, lock
        self.pending: tuple[socket.socket, dict] | None = None
        self.stopping = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._answer, daemon=True)

    def __enter__(self) -> "_Door":
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()

    def _answer(self):
        while not self._done.is_set() and not self.stopping.is_set():
            if not select.select([self.srv], [], [], 0.2)[0]:
                continue
            try:
                conn, _ = self.srv.accept()
            except OSError:
                continue
            request = _request(conn)
            if request is not None and request.get("stop"):
                self._stop(conn)
            elif request is not None and self.client is None and self.pending is None:
                self.pending = conn, request
            else:
                _send(conn, {"busy": True})
                conn.close()

    def _stop(self, conn: socket.socket):
        """Kill what the server runs until its thread is done (STOP_WAIT_S at most), then answer the stop."""
        self.stopping.set()
        if self.client is not None:
            with self.lock:
                _send(self.client, {"to": 1, "text": "note: the check server is stopping (python -m grader "
                                                     "check-server --stop): this check is cut short\n"})
        for waiting in [self.pending[0]] if self.pending else []:
            _send(waiting, {"stopped": True})       # it runs on its own
            waiting.close()
        self.pending = None
        deadline = time.monotonic() + STOP_WAIT_S
        while not self._done.wait(0.1) and time.monotonic() < deadline:
            _kill_children()
        _send(conn, {"stopped": True})
        conn.close()
        if not self._done.is_set():     # still not done: the server's thread ends it (serve's SIGTERM handler)
            os.kill(os.getpid(), signal.SIGTERM)


def _accept(srv: socket.socket) -> tuple[socket.socket | None, dict | None]:
    try:
        conn, _ = srv.accept()
    except socket.timeout:
        return None, None
    return conn, _request(conn)


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
        with _Door(srv) as door:
            import nbformat  # noqa: F401
            import papermill  # noqa: F401
            import torch  # noqa: F401
            from grader.judge import job  # noqa: F401
            fingerprint = _code()
            held = _hold(notebook)
        last = time.monotonic()
        srv.settimeout(POLL_S)
        while not door.stopping.is_set() and time.monotonic() - last < idle and _code() == fingerprint:
            conn, request = door.pending or _accept(srv)
            door.pending = None
            if conn is None:
                continue
            with conn:
                if request is None:
                    continue
                if request.get("stop") or _code() != fingerprint:
                    _send(conn, {"stopped": True})
                    break
                lock = threading.Lock()
                with _Door(srv, conn, lock) as door:
                    served, code = _serve_check(conn, request, held, lock)
                _send(conn, {"exit": code})     # once the door is shut: this client's next check is served
                notebook, held = served or notebook, None
            if door.stopping.is_set():
                break
            with _Door(srv) as door:
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
