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


def _close_other_arenas(own: int):
    """Close every other rank's arena: its descriptor and the duplicate its mmap keeps (Python's mmap holds one)."""
    mine = os.fstat(own).st_ino
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:rank") and os.fstat(fd).st_ino != mine:
                os.close(fd)
        except OSError:             # the listing's own descriptor, gone
            pass


def _rank_main(rank, nproc, port, run_id, target, is_module, args, write_fd, board_fd, arena_fd):
    apply_rlimits()
    if board_fd is not None:     # the switchboard carries this rank's collectives; it holds the inputs too
        os.environ.update(COURSE_SWITCHBOARD_FD=str(board_fd), COURSE_ARENA_FD=str(arena_fd))
        if os.environ.pop("COURSE_ISOLATE", None):     # each rank alone (the grader's box, as root)
            from launch.isolation import close_inherited, isolate, rank_uid
            close_inherited({write_fd, board_fd, arena_fd})
            uid = rank_uid(int(os.environ["COURSE_RANK_UID"]), rank)
            isolate(rank, os.getcwd(), uid)
            os.environ.update(COURSE_RANK_UID=str(uid), USER=f"rank{rank}")
    drop_privileges()
    os.dup2(write_fd, 1)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    null = os.open(os.devnull, os.O_RDONLY)   # not the launcher's stdin (a held launcher's job channel)
    os.dup2(null, 0)
    os.close(null)
    os.environ.update(torchrun_env(rank, nproc, port, run_id))
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


class Ranks:
    """The ranks this launcher forked: their output pipes and switchboard, their exit statuses, stopping them."""

    def __init__(self, nproc: int, out):
        self.nproc, self.out = nproc, out
        self.sel = selectors.DefaultSelector()
        self.board = None                                       # launch.switchboard.Switchboard, if any
        self.pids: dict[int, int] = {}                          # pid -> rank
        self.bufs: dict[int, tuple[int, bytes]] = {}            # output fd -> (rank, partial line)
        self.printed: dict[int, int] = {}
        self.exitcodes: dict[int, int] = {}
        self.order: list[int] = []

    def start_switchboard(self, record_dir: str):
        """COURSE_SWITCHBOARD=record_dir: this launcher carries the ranks' collectives (launch.switchboard), hands
        them their inputs (COURSE_RANK_INPUTS, a path with {rank}) item by item (COURSE_ITEMS, a JSON list of each
        item's id and the job ranks that run it)."""
        from launch.switchboard import Switchboard, load_inputs
        template = os.environ.pop("COURSE_RANK_INPUTS", "")
        items = json.loads(os.environ.pop("COURSE_ITEMS", "[]"))     # the job's items, in order
        self.board = Switchboard(self.sel, load_inputs(template, self.nproc) if template else {}, items, record_dir)

    def fork_all(self, target: str, is_module: bool, args: list[str]):
        from launch.wire import Arena
        port, run_id = free_port(), uuid.uuid4().hex[:8]
        for rank in range(self.nproc):
            r, w = os.pipe()
            mine, theirs = socket.socketpair() if self.board else (None, None)
            arena = Arena.create(f"rank{rank}") if self.board else None
            pid = os.fork()
            if pid == 0:
                os.close(r)
                for other in self.bufs:                                  # no rank holds another's pipe
                    os.close(other)
                board_fd = arena_fd = None
                if self.board:                 # ... nor another's link or arena (nor its mapping: Arena.create)
                    for fd in list(self.board.conns):
                        os.close(fd)
                    _close_other_arenas(arena.fd)
                    mine.close()
                    board_fd, arena_fd = theirs.detach(), arena.fd
                _rank_main(rank, self.nproc, port, run_id, target, is_module, args, w, board_fd, arena_fd)
            os.close(w)
            if self.board:
                theirs.close()
                self.board.attach(rank, mine, arena)
            self.pids[pid] = rank
            self.bufs[r] = (rank, b"")
            self.sel.register(r, selectors.EVENT_READ)

    def output_open(self) -> bool:
        return bool(self.bufs.keys() & self.sel.get_map().keys())

    def stop_all(self, sig):
        for pid, rank in self.pids.items():
            if rank not in self.exitcodes:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    def relay(self, timeout: float):
        """Copy what the ranks printed (prefixed, capped); serve the switchboard's sockets."""
        for key, events in self.sel.select(timeout=timeout):
            fd = key.fd
            if self.board and self.board.owns(fd):
                self.board.on_ready(fd, events)
                continue
            rank, buf = self.bufs[fd]
            chunk = os.read(fd, 65536)
            if not chunk:
                self.sel.unregister(fd)
                os.close(fd)
                if buf:
                    self.out.write(b"[rank %d] " % rank + buf + b"\n")
                continue
            *lines, buf = (buf + chunk).split(b"\n")
            for line in lines:
                self._print(rank, line)
            self.bufs[fd] = (rank, buf[-RANK_OUTPUT_CAP:])      # one endless line
        self.out.flush()

    def _print(self, rank: int, line: bytes):
        self.printed[rank] = self.printed.get(rank, 0) + len(line) + 1
        if self.printed[rank] <= RANK_OUTPUT_CAP:
            self.out.write(b"[rank %d] " % rank + line + b"\n")
        elif self.printed[rank] - len(line) - 1 <= RANK_OUTPUT_CAP:
            self.out.write(b"[rank %d] ... more output dropped (over %d bytes)\n" % (rank, RANK_OUTPUT_CAP))

    def reap(self) -> list[int]:
        """Exit statuses of ranks that ended since the last call; returns their codes."""
        codes = []
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in self.pids:
                rank = self.pids[pid]
                self.exitcodes[rank] = os.waitstatus_to_exitcode(status)
                self.order.append(rank)
                codes.append(self.exitcodes[rank])
        return codes

    def write_record(self):
        if self.board:
            self.board.write_record()

    def report(self, timed_out: bool) -> int:
        """The switchboard's record, then the status line: on stdout, not in a file, because the status must not
        be writable by the ranks, and unprefixed lines can only come from this launcher (every rank line
        carries "[rank r]")."""
        self.write_record()
        first = next((r for r in self.order if self.exitcodes[r] != 0), None)
        self.out.write(b"@@status " + json.dumps({"exitcodes": self.exitcodes, "order": self.order,
                                                  "first_failure": first, "timed_out": timed_out}).encode() + b"\n")
        self.out.flush()
        return 0 if first is None else 1


def launch_ranks(nproc: int, target: str, is_module: bool, args: list[str]) -> int:
    """Fork `nproc` ranks of `target` from this (torch-importing) process; relay their output."""
    if is_module is False and os.path.dirname(os.path.abspath(target)) not in sys.path:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    if is_module and "" not in sys.path:
        sys.path.insert(0, "")
    ranks = Ranks(nproc, sys.stdout.buffer)
    if os.environ.get("COURSE_SWITCHBOARD"):
        ranks.start_switchboard(os.environ.pop("COURSE_SWITCHBOARD"))
    ranks.fork_all(target, is_module, args)

    def stopped(*_):
        """Stopped at the job's wall clock: the ranks go, but what the switchboard recorded still reaches the
        grader (a result handed over before a hang is not a forgery)."""
        ranks.stop_all(signal.SIGKILL)
        ranks.write_record()
        os._exit(143)
    signal.signal(signal.SIGTERM, stopped)
    stop_grace = float(os.environ["COURSE_STOP_GRACE"]) if os.environ.get("COURSE_STOP_GRACE") else None
    # the job's wall clock, kept here too: a signal from outside may not reach this process (a sandbox in
    # its own session), and only this process can still write what its switchboard recorded
    deadline = float(os.environ["COURSE_DEADLINE"]) if os.environ.get("COURSE_DEADLINE") else None
    kill_at, term_sent, wall_clock_hit, drain_until = None, False, False, None
    while True:
        if deadline is not None and not wall_clock_hit and time.monotonic() > deadline:
            wall_clock_hit = True
            ranks.stop_all(signal.SIGKILL)
        if len(ranks.exitcodes) == nproc:
            # every rank is gone; a daemon a rank left behind may hold its pipe open forever
            drain_until = drain_until or time.monotonic() + 0.3
            if not ranks.output_open() or time.monotonic() > drain_until:
                break
        ranks.relay(timeout=0.05)
        for code in ranks.reap():
            if code != 0 and kill_at is None:
                kill_at = time.monotonic() + 0.5  # like torchrun: one failed rank stops the job
            elif stop_grace is not None and kill_at is None and len(ranks.exitcodes) < nproc:
                # a job whose ranks all finish together (grading): one that left early was cut short
                kill_at = time.monotonic() + stop_grace
        if kill_at is not None and time.monotonic() > kill_at:
            # TERM first so ranks can flush; KILL whoever ignores it
            ranks.stop_all(signal.SIGTERM if not term_sent else signal.SIGKILL)
            term_sent, kill_at = True, time.monotonic() + 2.0
    return ranks.report(wall_clock_hit)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # the status is out and the ranks are reaped: skip tearing down torch (~0.5 s the caller would wait for)
    os._exit(code)
