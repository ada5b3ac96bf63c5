"""`run()`: N local ranks, output prefixed `[rank r]`, a wall clock, nothing left behind.

The job runs in its own process session. On timeout the whole group gets SIGTERM
(torchrun's agent then stops its workers), then SIGKILL after `kill_grace`.
Every process of the job carries COURSE_JOB_ID in its environment, so a rank that
escaped the group with setsid() is found in /proc and killed too.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Sequence

from launch.backend import default_launcher, pick_backend
from launch.launchers import LAUNCHERS
from launch.relay import Relay

_RANK_PREFIX = re.compile(r"^\[rank (\d+)\] ?")


@dataclass
class RunResult:
    returncode: int
    exitcodes: dict[int, int]        # rank -> exit status (negative: killed by that signal)
    output: str                      # every line, prefixed `[rank r]`
    timed_out: bool
    seconds: float
    nproc: int
    backend: str
    launcher: str
    first_failure: int | None = None
    leftovers_killed: int = 0
    command: list = field(default_factory=list)
    declared: dict = field(default_factory=dict)   # rank -> "file sha256" a torchrun rank printed
    job_id: str = ""                               # COURSE_JOB_ID in every process of the job
    order: list = field(default_factory=list)      # ranks in the order their processes ended (fork, warm)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def rank_output(self, rank: int) -> str:
        lines = []
        for line in self.output.splitlines():
            m = _RANK_PREFIX.match(line)
            if m and int(m.group(1)) == rank:
                lines.append(line[m.end():])
        return "\n".join(lines)

    def root_cause(self) -> str:
        """The failing rank's traceback, the first rank to fail first."""
        if self.timed_out:
            return f"the job did not finish within its wall clock ({self.seconds:.0f} s): a rank hung or deadlocked"
        rank = self.first_failure
        if rank is None:
            bad = [r for r, c in sorted(self.exitcodes.items()) if c != 0]
            rank = bad[0] if bad else None
        if rank is None:
            return "" if self.ok else self.output[-4000:]
        text = self.rank_output(rank)
        i = text.rfind("Traceback (most recent call last)")
        code = self.exitcodes.get(rank)
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
        return f"rank {rank} failed first ({how}):\n" + (text[i:] if i >= 0 else text[-4000:])


def rank_env(backend: str, pg_timeout: float | None = None) -> dict:
    env = {"COURSE_BACKEND": backend, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if pg_timeout is not None:
        env["COURSE_PG_TIMEOUT"] = str(pg_timeout)
    return env


def job_processes(job_id: str) -> list[int]:
    """Processes still alive that belong to the job: COURSE_JOB_ID=job_id in their environment, or
    (warm launcher, whose processes are forks of a resident one) the job's mark as process name."""
    needle = f"COURSE_JOB_ID={job_id}".encode()
    marker = "cj" + job_id[:13]
    alive = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                with open(f"/proc/{pid}/comm") as f:
                    mine = f.read().strip() == marker
                if not mine:
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        mine = needle in f.read().split(b"\0")
                if mine and is_alive(int(pid)):
                    alive.append(int(pid))
            except OSError:
                continue
    return alive


def is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"   # a zombie is dead, only unreaped
    except OSError:
        return False


def kill_job_processes(job_id: str) -> int:
    """Kill every process whose environment carries COURSE_JOB_ID=job_id; wait until they are gone."""
    return kill_until_gone(lambda: job_processes(job_id))


def kill_until_gone(find: Callable[[], list[int]], timeout: float = 15.0) -> int:
    """SIGKILL what `find()` lists until it lists nothing alive (a process may still be forking when its parent
    goes); returns how many processes were killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [p for p in find() if is_alive(p)]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed |= set(pids)
        time.sleep(0.05)
    return len(killed)


def _killpg(pgid: int, sig: int):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run(target: str, nproc: int, args: Sequence[str] = (), **options) -> RunResult:
    """Run `target` (a module with module=True, else a script path) on `nproc` local ranks and wait for it to
    end; `options` are `start`'s."""
    if nproc is None or nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    return start(target, nproc, args, **options).wait()


def start(target: str, nproc: int | None, args: Sequence[str] = (), *, module: bool = True,
          backend: str | None = None, launcher: str | None = None, timeout: float = 120.0,
          kill_grace: float = 3.0, env: dict | None = None, cwd: str | None = None,
          stream: Callable[[str], None] | None = None, preload: Sequence[str] = (),
          wrap: Sequence[str] = (), pg_timeout: float | None = None, interactive: bool = False,
          base_env: dict | None = None) -> "Launch":
    """Start `target` on `nproc` local ranks; `.wait()` gives its RunResult.

    wrap: a command prefix (e.g. a sandbox) placed before the Python interpreter.
    base_env: the environment the ranks start from (default: this process's); `env` is added on top.
    nproc=None holds the job (fork launcher only): the launcher starts now and imports torch and
    `preload`, but forks no rank until `.release(nproc, timeout)`; `timeout` then counts from the release.
    """
    held = nproc is None
    backend = "gloo" if held else pick_backend(nproc, backend)
    launcher = default_launcher(backend, launcher, interactive=interactive and not wrap)
    if held and launcher != "fork":
        raise ValueError(f"only the fork launcher can hold a job (this one is {launcher!r})")
    if launcher == "warm" and not wrap:
        from launch.zygote import ZygoteUnavailable, ensure_zygote
        try:       # up first, so that the job's clock starts when its ranks can
            ensure_zygote(tuple(preload))
        except ZygoteUnavailable as exc:
            print(f"note: {exc}; this job starts its own (fork) launcher", file=sys.stderr, flush=True)
            launcher = "fork"
    job_id = uuid.uuid4().hex
    full_env = dict(os.environ if base_env is None else base_env)
    full_env.update(rank_env(backend, pg_timeout))
    full_env["COURSE_JOB_ID"] = job_id
    if not held:
        full_env["COURSE_DEADLINE"] = _deadline(timeout)
    full_env.update(env or {})
    proc, cmd = LAUNCHERS[launcher].spawn(target, module, args, nproc, preload, wrap, full_env, cwd)
    return Launch(proc=proc, cmd=cmd, nproc=nproc, backend=backend, launcher=launcher, job_id=job_id,
                  timeout=timeout, kill_grace=kill_grace, stream=stream)


def _deadline(timeout: float) -> str:
    # the fork/warm launcher stops itself at this moment (CLOCK_MONOTONIC is one clock for the whole machine),
    # a little before this process would, so that it can still write what its switchboard recorded
    return str(time.monotonic() + max(1.0, timeout - 2.0))


@dataclass
class Launch:
    """A started job (see `start`)."""
    proc: object
    cmd: list
    nproc: int | None
    backend: str
    launcher: str
    job_id: str
    timeout: float
    kill_grace: float
    stream: Callable[[str], None] | None = None
    t0: float = field(default_factory=time.monotonic)

    def release(self, nproc: int, timeout: float, env: dict | None = None):
        """Give a held launcher its job: fork `nproc` ranks now, stop them `timeout` seconds from now; `env`: what
        the job adds to the launcher's environment now that it is known."""
        if nproc < 1:
            raise ValueError(f"nproc must be at least 1, got {nproc}")
        self.nproc, self.timeout, self.t0 = nproc, timeout, time.monotonic()
        job = {"nproc": nproc, "env": {**(env or {}), "COURSE_DEADLINE": _deadline(timeout)}}
        try:
            self.proc.stdin.write(json.dumps(job).encode() + b"\n")
            self.proc.stdin.close()
        except BrokenPipeError:     # the launcher is already gone: wait() reports how it ended
            pass

    def cancel(self):
        """Give up a held job: the launcher is stopped before it forks anything; nothing of it is left running."""
        _killpg(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        self.proc.wait()
        self.proc.stdout.close()
        kill_job_processes(self.job_id)

    def wait(self) -> RunResult:
        """Relay the job's output until it ends (or its timeout, then stop it); nothing is left running."""
        if self.nproc is None:
            raise RuntimeError("this launch is held: release(nproc, timeout) it before wait()")
        kind = LAUNCHERS[self.launcher]
        relay = Relay(self.stream)
        timed_out = self._relay_until_done(relay)
        leftovers = self._stop(relay, timed_out)
        seconds = time.monotonic() - self.t0
        out = kind.outcome(self.proc, relay, self.nproc)
        timed_out = timed_out or out.timed_out
        returncode = 124 if timed_out else (out.returncode if out.returncode is not None else self.proc.returncode)
        return RunResult(returncode=returncode, exitcodes=out.exitcodes, output="\n".join(relay.lines),
                         timed_out=timed_out, seconds=seconds, nproc=self.nproc, backend=self.backend,
                         launcher=self.launcher, first_failure=out.first_failure, leftovers_killed=leftovers,
                         command=self.cmd, declared=relay.declared, job_id=self.job_id, order=out.order)

    def _relay_until_done(self, relay: Relay) -> bool:
        """Feed the launcher's output to `relay` until the launcher is done; True if the wall clock ran out."""
        import selectors
        out = self.proc.stdout
        os.set_blocking(out.fileno(), False)
        deadline = self.t0 + self.timeout
        with selectors.DefaultSelector() as sel:
            sel.register(out, selectors.EVENT_READ)
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return True
                for _ in sel.select(timeout=min(remaining, 0.1)):
                    try:
                        chunk = out.read(65536)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        relay.flush()
                        return False
                    relay.feed(chunk)
                if self.proc.poll() is not None and not sel.select(timeout=0):
                    try:                     # the launcher exited: what is left in the pipe
                        relay.feed(out.read() or b"")
                    except BlockingIOError:
                        pass
                    relay.flush()
                    return False

    def _stop(self, relay: Relay, timed_out: bool) -> int:
        """The launcher's group TERM then KILL (at once if the clock ran out), every process of the job found and
        killed, the pipe closed. Returns how many processes had to be killed."""
        proc, grace = self.proc, self.kill_grace
        if timed_out:
            _killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
            _killpg(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            _killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _killpg(proc.pid, signal.SIGKILL)  # ranks the launcher left behind
        leftovers = kill_job_processes(self.job_id)
        if timed_out:   # what the launcher said on its way out (the ranks' declarations)
            try:
                relay.feed(proc.stdout.read() or b"")
            except (BlockingIOError, OSError, ValueError):
                pass
            relay.flush()
        proc.stdout.close()
        return leftovers
