"""Warm local launcher: import torch once, then fork N ranks with torchrun's environment.

torchrun starts an agent and N fresh interpreters, each importing torch (about 1.5 s
of CPU apiece, 12 s for 4 ranks on 2 cores). Forking from one process that has
already imported torch makes a rank cost a fork. Each rank sees the same variables
torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...), so `init_process_group()`
with env:// rendezvous behaves the same. CPU/gloo only: CUDA does not survive fork.

    python -m launch.forkrun --nproc 4 (-m MODULE | SCRIPT) [ARGS...]
    python -m launch.forkrun --hold ...   # imports first, then reads {"nproc": N, "env": {...}} on stdin

--hold lets a caller start the launcher (torch and the preloads, ~2 s) before it knows the job: the
grader starts it while its own process imports torch and makes the job's inputs, then releases it.
The last line it prints, "@@status {json}", gives each rank's exit status.
"""
import argparse
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import time
import uuid


RANK_OUTPUT_CAP = 1 << 20   # bytes of output kept per rank; the rest is read and dropped


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(rank: int, nproc: int, port: int, run_id: str) -> dict:
    """The variables torchrun --standalone gives a worker on one node."""
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "ROLE_NAME": "default", "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
        "ROLE_WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "False",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }


def print_user_traceback(exc: BaseException):
    """The traceback as torchrun would show it: without this launcher's and runpy's frames."""
    import traceback
    te = traceback.TracebackException.from_exception(exc)
    te.stack = traceback.StackSummary.from_list(
        [f for f in te.stack if not (f.filename == __file__ or "runpy" in f.filename)])
    print("".join(te.format()), end="", file=sys.stderr)


def apply_rlimits():
    """Limits the grader's sandbox asks for (COURSE_RLIMITS), set in each rank after fork."""
    spec = os.environ.get("COURSE_RLIMITS")
    if not spec:
        return
    import resource
    for name, value in json.loads(spec).items():
        which = getattr(resource, f"RLIMIT_{name}")
        _, hard = resource.getrlimit(which)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))


def drop_privileges():
    """Become the unprivileged user the grader's sandbox names (COURSE_RANK_UID), for good, before any
    student code runs: file access is then checked against that uid, and this launcher (which relays the
    ranks' declarations) stays out of the ranks' reach."""
    uid = os.environ.pop("COURSE_RANK_UID", None)
    if uid is None:
        return
    uid = int(uid)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def open_own_inputs(rank: int):
    """Open this rank's own input file (COURSE_RANK_INPUTS, a path with {rank}) while the launcher's identity
    can still read it, and hand the rank the descriptor (COURSE_INPUT_FD): after the privilege drop no rank
    can open another rank's file (the grader keeps the folder to itself)."""
    template = os.environ.pop("COURSE_RANK_INPUTS", None)
    if template:
        os.environ["COURSE_INPUT_FD"] = str(os.open(template.format(rank=rank), os.O_RDONLY))


def _rank_main(rank, nproc, port, run_id, target, is_module, args, write_fd, result_fd):
    apply_rlimits()
    open_own_inputs(rank)
    drop_privileges()
    os.dup2(write_fd, 1)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    null = os.open(os.devnull, os.O_RDONLY)   # not the launcher's stdin (a held launcher's job channel)
    os.dup2(null, 0)
    os.close(null)
    os.environ.update(torchrun_env(rank, nproc, port, run_id))
    # a private channel to this launcher: what a rank declares here cannot come from another rank
    os.environ["COURSE_RESULT_FD"] = str(result_fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    import warnings  # the module was preloaded before fork on purpose; runpy need not say so
    warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package.*")
    code = 0
    try:
        if is_module:
            sys.argv = [target, *args]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *args]
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException as e:
        print_user_traceback(e)
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.forkrun")
    p.add_argument("--nproc", type=int)
    p.add_argument("--hold", action="store_true", help="after the imports, read the job on stdin: one JSON line "
                   '{"nproc": N, "env": {...}}; end of input instead: leave without running anything')

    p.add_argument("--preload", default="", help="comma-separated modules to import before forking (what the "
                   "ranks need beyond torch, e.g. torch._dynamo for DTensor: ~2 s, paid once, not once per rank)")
    p.add_argument("-m", dest="module", action="store_true", help="target is a module")
    p.add_argument("target")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)

    import torch  # the whole point: paid once, shared by every rank via fork
    torch.set_num_threads(1)
    for name in filter(None, a.preload.split(",")):
        importlib.import_module(name)
    nproc = a.nproc
    if a.hold:
        line = sys.stdin.readline()
        if not line:        # the caller gave the job up
            return 0
        job = json.loads(line)
        nproc = job["nproc"]
        os.environ.update(job.get("env", {}))
    if not nproc or nproc < 1:
        p.error("give --nproc N (N >= 1), or --hold and the job on stdin")
    return launch_ranks(nproc, a.target, a.module, a.args)


def launch_ranks(nproc: int, target: str, is_module: bool, args: list[str]) -> int:
    """Fork `nproc` ranks of `target` from this (torch-importing) process; relay their output."""
    if is_module is False and os.path.dirname(os.path.abspath(target)) not in sys.path:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    if is_module and "" not in sys.path:
        sys.path.insert(0, "")

    port, run_id = free_port(), uuid.uuid4().hex[:8]
    sel = selectors.DefaultSelector()
    pids, bufs = {}, {}
    printed: dict[int, int] = {}
    declared: dict[int, bytes] = {}   # rank -> last "file sha256" line from its result channel
    result_bufs: dict[int, tuple[int, bytes]] = {}
    for rank in range(nproc):
        r, w = os.pipe()
        rr, rw = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.close(rr)
            for other in list(bufs) + list(result_bufs):
                os.close(other)
            _rank_main(rank, nproc, port, run_id, target, is_module, args, w, rw)
        os.close(w)
        os.close(rw)
        pids[pid] = rank
        bufs[r] = (rank, b"")
        result_bufs[rr] = (rank, b"")
        sel.register(r, selectors.EVENT_READ)
        sel.register(rr, selectors.EVENT_READ)

    exitcodes, order = {}, []

    def stop_all(sig):
        for pid, rank in pids.items():
            if rank not in exitcodes:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    out = sys.stdout.buffer

    def stopped(*_):
        """Stopped at the job's wall clock: the ranks go, but what they declared still reaches the grader
        (a result written before a hang is not a forgery)."""
        stop_all(signal.SIGKILL)
        for rank, line in sorted(declared.items()):
            out.write(b"@@result %d " % rank + line + b"\n")
        out.flush()
        os._exit(143)

    signal.signal(signal.SIGTERM, stopped)
    kill_at, term_sent = None, False
    stop_grace = float(os.environ["COURSE_STOP_GRACE"]) if os.environ.get("COURSE_STOP_GRACE") else None
    # the job's wall clock, kept here too: a signal from outside may not reach this process (a sandbox in
    # its own session), and only this process can still relay what the ranks declared
    deadline = float(os.environ["COURSE_DEADLINE"]) if os.environ.get("COURSE_DEADLINE") else None
    wall_clock_hit = False
    drain_until = None
    while True:
        if deadline is not None and not wall_clock_hit and time.monotonic() > deadline:
            wall_clock_hit = True
            stop_all(signal.SIGKILL)
        if len(exitcodes) == nproc:
            # every rank is gone; a daemon a rank left behind may hold its pipe open forever
            drain_until = drain_until or time.monotonic() + 0.3
            if not sel.get_map() or time.monotonic() > drain_until:
                break
        for key, _ in sel.select(timeout=0.05):
            fd = key.fd
            if fd in result_bufs:
                rank, buf = result_bufs[fd]
                chunk = os.read(fd, 4096)
                if not chunk:
                    sel.unregister(fd)
                    os.close(fd)
                    continue
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines[-1:]:
                    declared[rank] = line[:200]
                result_bufs[fd] = (rank, buf)
                continue
            rank, buf = bufs[fd]
            chunk = os.read(fd, 65536)
            if not chunk:
                sel.unregister(fd)
                os.close(fd)
                if buf:
                    out.write(b"[rank %d] " % rank + buf + b"\n")
                continue
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                printed[rank] = printed.get(rank, 0) + len(line) + 1
                if printed[rank] <= RANK_OUTPUT_CAP:
                    out.write(b"[rank %d] " % rank + line + b"\n")
                elif printed[rank] - len(line) - 1 <= RANK_OUTPUT_CAP:
                    out.write(b"[rank %d] ... more output dropped (over %d bytes)\n" % (rank, RANK_OUTPUT_CAP))
            if len(buf) > RANK_OUTPUT_CAP:   # one endless line
                buf = buf[-RANK_OUTPUT_CAP:]
            bufs[fd] = (rank, buf)
            out.flush()
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid not in pids:
                continue
            rank = pids[pid]
            code = os.waitstatus_to_exitcode(status)
            exitcodes[rank] = code
            order.append(rank)
            if code != 0 and kill_at is None:
                kill_at = time.monotonic() + 0.5  # like torchrun: one failed rank stops the job
            elif stop_grace is not None and kill_at is None and len(exitcodes) < nproc:
                # a job whose ranks all finish together (grading): one that left early was cut short
                kill_at = time.monotonic() + stop_grace
        if kill_at is not None and time.monotonic() > kill_at:
            # TERM first so ranks can flush; KILL whoever ignores it
            stop_all(signal.SIGTERM if not term_sent else signal.SIGKILL)
            term_sent, kill_at = True, time.monotonic() + 2.0
    for rank, line in sorted(declared.items()):
        # unprefixed, so no rank can print one: every rank line above carries "[rank r]"
        out.write(b"@@result %d " % rank + line + b"\n")
    out.flush()
    first = next((r for r in order if exitcodes[r] != 0), None)
    # on stdout, not in a file: the status must not be writable by the ranks (the sandbox's /tmp is
    # private and the job folder is theirs), and unprefixed lines can only come from this launcher
    out.write(b"@@status " + json.dumps({"exitcodes": exitcodes, "order": order, "first_failure": first,
                                         "timed_out": wall_clock_hit}).encode() + b"\n")
    out.flush()
    return 0 if first is None else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # the status is out and the ranks are reaped: skip tearing down torch (~0.5 s the caller would wait for)
    os._exit(code)
