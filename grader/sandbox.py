"""Run student ranks boxed in: bubblewrap namespaces, a pids cgroup, and per-rank rlimits.

What a rank can do inside (checked by tests/test_sandbox.py and the bad-submission corpus):
- run as `nobody` with no capabilities, in its own user namespace;
- see the filesystem read-only, except its job folder; /tmp is an empty tmpfs;
- not see solutions/, the nbgrader course (gradebook.db, submitted/, autograded/, source/);
- reach no network but loopback (gloo on 127.0.0.1 still works);
- not outlive the job: the sandbox has its own PID namespace, so killing bubblewrap (its pid 1)
  kills every process a rank started, daemons included;
- not fork-bomb the machine (pids cgroup), hog memory (RLIMIT_AS per rank), fill the disk
  (RLIMIT_FSIZE) or spin forever on CPU (RLIMIT_CPU; the job wall clock comes first anyway).
Where a tool is missing the sandbox degrades and says so in `notes`; GRADER_SANDBOX=off disables it.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
import uuid
from dataclasses import asdict, dataclass, field

PIDS_ROOT = "/sys/fs/cgroup/pids"


@dataclass
class Limits:
    memory_bytes: int = 6 << 30      # address space per rank (torch's import alone maps ~2.2 GB)
    file_bytes: int = 64 << 20       # largest file a rank may write
    cpu_seconds: int = 600           # CPU time per rank
    pids: int = 1024                 # tasks (processes + threads) in the whole job: gloo groups are threads


def rlimits_env(limits: Limits) -> dict:
    """Read by launch.forkrun in each rank right after fork."""
    return {"COURSE_RLIMITS": json.dumps({"AS": limits.memory_bytes, "FSIZE": limits.file_bytes,
                                          "CPU": limits.cpu_seconds})}


def course_paths_to_hide(root: str, cwd: str | None = None) -> list[str]:
    """Folders and files a student rank must not read: solutions, and the nbgrader course it runs in."""
    out = [os.path.join(root, "solutions")]
    cwd = cwd or os.getcwd()
    for name in ("solutions", "source", "submitted", "autograded", "feedback", "gradebook.db", "release"):
        p = os.path.join(cwd, name)
        if os.path.exists(p) and p not in out:
            out.append(p)
    return [p for p in out if os.path.exists(p)]


def needed_paths() -> list[str]:
    """The course packages, the virtual environment and the Python it was made from."""
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = {root, sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    # keep only outermost paths: binding a folder and then one inside it again is pointless
    return sorted(p for p in paths if not any(p != q and p.startswith(q + os.sep) for q in paths))


@dataclass
class Sandbox:
    jobdir: str
    hide: list[str] = field(default_factory=list)
    limits: Limits = field(default_factory=Limits)
    mode: str = field(default_factory=lambda: os.environ.get("GRADER_SANDBOX", "auto"))
    prefix: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    cgroup: str | None = None

    def __enter__(self) -> "Sandbox":
        if self.mode == "off":
            self.notes.append("sandbox off (GRADER_SANDBOX=off): student ranks run with your privileges")
            return self
        self.env.update(rlimits_env(self.limits))
        self._cgroup()
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            msg = "bubblewrap (bwrap) is not installed: ranks are not isolated (apt-get install bubblewrap)"
            if self.mode == "on":
                raise RuntimeError(msg)
            self.notes.append(msg)
            return self
        # nobody, with no capabilities, in its own user namespace: not the instructor's privileges
        args = [bwrap, "--die-with-parent", "--unshare-user", "--uid", "65534", "--gid", "65534", "--cap-drop", "ALL",
                "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
                "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
        # what the ranks run from must stay visible even when it lives under /tmp (a CI clone, a venv)
        for path in needed_paths():
            if path == "/tmp" or path.startswith("/tmp/"):
                args += ["--ro-bind", path, path]
        args += ["--bind", self.jobdir, self.jobdir]
        for path in self.hide:
            if os.path.isdir(path):
                args += ["--tmpfs", path]
            elif os.path.exists(path):
                args += ["--ro-bind", "/dev/null", path]
        args += ["--chdir", self.jobdir, "--"]
        self.prefix = self.prefix + args
        return self

    def _cgroup(self):
        if not os.access(PIDS_ROOT, os.W_OK):
            self.notes.append(f"no writable pids cgroup at {PIDS_ROOT}: a fork bomb is bounded by the wall clock only")
            return
        path = os.path.join(PIDS_ROOT, f"grader-{uuid.uuid4().hex[:12]}")
        try:
            os.mkdir(path)
            with open(os.path.join(path, "pids.max"), "w") as f:
                f.write(str(self.limits.pids))
        except OSError as exc:
            self.notes.append(f"could not create a pids cgroup ({exc}): a fork bomb is bounded by the wall clock only")
            return
        self.cgroup = path
        # join the cgroup before exec, so everything the job starts is counted from its first fork
        self.prefix = ["/bin/sh", "-c", f'echo $$ > {path}/cgroup.procs && exec "$@"', "sh"]

    def __exit__(self, *exc):
        if self.cgroup:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:   # a fork bomb's last children may still be forking
                try:
                    pids = [int(p) for p in open(os.path.join(self.cgroup, "cgroup.procs")).read().split()]
                except OSError:
                    break
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.05)
            try:
                os.rmdir(self.cgroup)
            except OSError:
                pass
        return False

    def describe(self) -> dict:
        return {"prefix": self.prefix, "limits": asdict(self.limits), "notes": self.notes, "cgroup": self.cgroup}
