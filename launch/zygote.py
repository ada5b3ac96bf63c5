"""A warm launcher for interactive checks: a process that has imported torch once forks each job.

The fork launcher (launch.forkrun) still starts a fresh interpreter per job and imports torch
there (~1.5-3 s on 2 cores). The zygote keeps one such interpreter alive beside a notebook
kernel: a job is a fork of it (which then forks the ranks exactly as forkrun does), so a check
pays no interpreter start and no torch import. It is for CPU/gloo in the student's own kernel;
grading uses the fork launcher inside the sandbox, GPUs use torchrun.

Protocol (Unix socket): the client sends one JSON request and, with it, the write end of a pipe;
the zygote forks a job leader that makes itself a session leader, writes everything to that pipe
(the same stream forkrun writes, ending with "@@status"), and answers with the leader's pid.
The zygote exits with its parent, when the code it preloaded changes, or after an idle hour.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import signal
import socket
import stat
import sys
import time

PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDLE_EXIT_S = 3600


def code_fingerprint(packages=("launch", "grader", "tpkit")) -> str:
    """Changes when any module of `packages` changes, so a resident process never serves stale course code."""
    h = hashlib.sha256()
    for pkg in packages:
        for dirpath, _, files in sorted(os.walk(os.path.join(PKG_ROOT, pkg))):
            for f in sorted(files):
                if f.endswith(".py"):
                    st = os.stat(os.path.join(dirpath, f))
                    h.update(f"{dirpath}/{f}:{st.st_mtime_ns}:{st.st_size}".encode())
    return h.hexdigest()[:16]


def job_marker(job_id: str) -> str:
    return "cj" + job_id[:13]          # the kernel keeps 15 bytes of a process name


def set_process_name(name: str):
    import ctypes
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)   # PR_SET_NAME
    except Exception:
        pass


def _socket_prefix() -> str:
    return f"/tmp/course-zygote-{os.getuid()}-"


def socket_path(owner_pid: int | None = None) -> str:
    return f"{_socket_prefix()}{owner_pid or os.getpid()}.sock"


def reap_stale_sockets():
    """Remove this user's zygote sockets whose kernel is gone. A kernel stopped with its process group takes
    its zygote along before the zygote can remove its own socket; the next zygote to start cleans up."""
    prefix = _socket_prefix()
    for path in glob.glob(prefix + "*.sock"):
        owner = path[len(prefix):-len(".sock")]
        try:
            st = os.lstat(path)
            if not (owner.isdigit() and stat.S_ISSOCK(st.st_mode) and st.st_uid == os.getuid()):
                continue
            os.kill(int(owner), 0)
        except ProcessLookupError:          # the owner is gone
            try:
                os.unlink(path)
            except OSError:
                pass
        except OSError:                     # vanished meanwhile, or an owner we may not signal: leave it
            pass


def _serve_job(req: dict, out_fd: int):
    """In the forked job leader: become the forkrun process of this job."""
    os.setsid()
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)   # the leader waits for its ranks itself
    os.environ.clear()
    os.environ.update(req["env"])
    # /proc/PID/environ shows the zygote's exec-time environment, not COURSE_JOB_ID: mark the job
    # in the process name instead, which every process forked from here inherits
    set_process_name(job_marker(req["env"].get("COURSE_JOB_ID", "")))
    os.chdir(req["cwd"])
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    from launch.forkrun import launch_ranks
    code = 1
    try:
        code = launch_ranks(req["nproc"], req["target"], req["module"], req["args"])
    finally:
        sys.stdout.flush()
        os._exit(code)


def serve(path: str, preload: list[str]):
    import importlib
    import torch
    import torch._dynamo  # noqa: F401  DTensor and torch.compile cells import it: once, here
    import torch.fx.experimental.symbolic_shapes  # noqa: F401  backward() imports it lazily (sympy)
    torch.set_num_threads(1)
    for name in preload:
        importlib.import_module(name)
    fingerprint = code_fingerprint()
    parent = os.getppid()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)     # job leaders are reaped by the kernel
    if os.path.exists(path):
        os.unlink(path)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    os.chmod(path, 0o600)
    srv.listen(8)
    srv.settimeout(2.0)
    last = time.monotonic()
    while True:
        if os.getppid() != parent or time.monotonic() - last > IDLE_EXIT_S:
            break
        try:
            conn, _ = srv.accept()
        except socket.timeout:
            continue
        last = time.monotonic()
        with conn:
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 1)
            req = json.loads(msg.decode())
            if req.get("ping"):
                conn.sendall(json.dumps({"fingerprint": fingerprint}).encode())
                continue
            pid = os.fork()
            if pid == 0:
                srv.close()
                _serve_job(req, fds[0])
            os.close(fds[0])
            conn.sendall(json.dumps({"pid": pid}).encode())
    srv.close()
    try:
        os.unlink(path)
    except OSError:
        pass


def _request(path: str, req: dict, fd: int | None = None, timeout: float = 5.0) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.settimeout(timeout)
        c.connect(path)
        socket.send_fds(c, [json.dumps(req).encode()], [fd] if fd is not None else [])
        return json.loads(c.recv(65536).decode())


class ZygoteUnavailable(RuntimeError):
    """The resident launcher did not come up in time (a machine loaded far beyond its cores)."""


def ensure_zygote(preload: tuple[str, ...] = (), start_timeout: float = 120.0) -> str:
    """The socket of this process's zygote, started (or restarted on a code change) as needed."""
    import subprocess
    path = socket_path()
    want = code_fingerprint()
    try:
        if _request(path, {"ping": True})["fingerprint"] == want:
            return path
    except (OSError, ValueError, KeyError):
        pass
    try:
        os.unlink(path)   # a stale zygote (old code) keeps running until idle; a new one takes the name
    except OSError:
        pass
    reap_stale_sockets()
    env = dict(os.environ)
    env["PYTHONPATH"] = PKG_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    subprocess.Popen([sys.executable, "-m", "launch.zygote", path, ",".join(preload)], env=env,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + start_timeout
    while time.monotonic() < deadline:
        try:
            if _request(path, {"ping": True})["fingerprint"] == want:
                return path
        except (OSError, ValueError, KeyError):
            time.sleep(0.1)
    raise ZygoteUnavailable(f"the warm launcher did not start within {start_timeout:.0f} s")


def start_job(req: dict, out_fd: int) -> int:
    """Ask the zygote to fork a job writing to out_fd; returns the job leader's pid (its process group)."""
    path = ensure_zygote(tuple(req.pop("preload", ())))
    return int(_request(path, req, out_fd, timeout=30.0)["pid"])


if __name__ == "__main__":
    serve(sys.argv[1], [m for m in sys.argv[2].split(",") if m] if len(sys.argv) > 2 else [])
