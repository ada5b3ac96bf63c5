"""Boxes for student code: grading ranks and the autograded notebook's kernel see an allowlist, nothing else.

A box is a bubblewrap command prefix (`Sandbox.prefix`). What runs inside:
- sees only what is bound: the system's programs and libraries (/usr, /etc, ...), the Python
  runtime and its packages, the parts of the course the view names (a grading rank: `launch/`,
  `tpkit/`, `grader/__init__.py`, `grader/rank/`; a kernel: `launch/`, `tpkit/`), and its own
  folders. No home directory, no `notebooks/`, `solutions/`, `reference/` or cases, no `.git`,
  no gradebook, no other student's job; /tmp is an empty tmpfs;
- writes only its writable folders (a job's `out/`, a kernel's scratch copy);
- runs as a real unprivileged user (uid 65534) when the grader runs as root: file access outside
  the box is checked against that uid, not the instructor's (the ranks drop to it right after fork,
  the kernel and torchrun through `setpriv`). Run as another user, it keeps that user's identity
  and sees only the allowlist. As root, the box's /etc/passwd and /etc/group are its own (`identity_files`):
  the unprivileged user and each grading rank's uid (`launch.isolation.rank_uid`) have names and a home, the
  box's writable folder (a rank's own out/), so pwd, getpass, `~` and tempfile work as on any machine;
- reaches no network but its own loopback (a new network namespace), has its own PID, IPC and UTS
  namespaces, dies with its parent, gets a clean environment (an allowlist of variables, and never one
  whose name could carry a secret: `clean_env`);
- cannot fork-bomb the machine (pids cgroup), hog memory (RLIMIT_AS per rank, a memory cgroup per job,
  a size-capped /tmp), starve a job graded beside it (a cpu cgroup per job: equal shares, however many
  processes it starts), fill the disk (RLIMIT_FSIZE per file; a grading job's out/ is a size-capped tmpfs
  per rank, `grader.judge.attempt`) or spin forever on CPU (RLIMIT_CPU; the job wall clock comes first anyway).
Student code is never unboxed by accident: without bubblewrap the box refuses (`SandboxUnavailable`)
unless GRADER_SANDBOX=off says so explicitly (your own kernel, your own code). Where a lesser tool is
missing (setpriv, a cgroup controller, root) the box degrades and says so in `notes` (`Sandbox.degrade`);
GRADER_SANDBOX=on refuses instead.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import site
import sys
import tempfile
import uuid
from dataclasses import asdict, dataclass, field

from grader import ROOT
from launch.isolation import rank_name, rank_uid
from launch.runner import kill_until_gone

CGROUP_ROOT = "/sys/fs/cgroup"
NOBODY = 65534
# what a grading rank imports of the course; a kernel gets the teaching library and the launcher only
RANK_VIEW = ("launch", "tpkit", "grader/__init__.py", "grader/rank")
KERNEL_VIEW = ("launch", "tpkit")
SYSTEM = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt/conda")
ENV_KEEP = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TERM", "TZ", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
            "MPLBACKEND", "PYTHONUNBUFFERED", "PYTHONHASHSEED", "GRADER_DEFER_CHECKS", "CUDA_VISIBLE_DEVICES")
# never into a box, whatever allows the name: what could carry a secret of the grader's (a JupyterHub API token, a
# cloud key) or point at the grader's own processes (JPY_PARENT_PID: a kernel that cannot see that pid exits)
ENV_DENY = re.compile(r"^(JPY_|JUPYTERHUB_)|TOKEN|SECRET|PASSWORD|KEY|CREDENTIAL|AUTH", re.IGNORECASE)


class SandboxUnavailable(RuntimeError):
    """Student code would run unboxed, or (GRADER_SANDBOX=on) in a box that lacks a part: refused."""


@dataclass
class Limits:
    memory_bytes: int = 6 << 30      # address space per rank (torch's import alone maps ~2.2 GB)
    file_bytes: int = 64 << 20       # largest file a rank may write
    cpu_seconds: int = 600           # CPU time per rank
    pids: int = 1024                 # tasks (processes + threads) in the whole job: gloo groups are threads
    job_memory_bytes: int = 4 << 30  # resident memory of the whole job, its /tmp included (memory cgroup)
    tmp_bytes: int = 256 << 20       # the box's private /tmp (tmpfs: memory the machine would otherwise give)
    out_bytes: int = 128 << 20       # a grading rank's out/ folder, all its files together (a tmpfs of its own) ...
    job_out_bytes: int = 256 << 20   # ... and every rank's of a job together: a rank gets min(out_bytes, this / ranks)
    out_files: int = 1024            # files and folders in a rank's out/, or in the job's where its ranks share one
                                     # (a tmpfs's inodes cost memory beyond its size)
    # CPU: the job gets its own cpu cgroup with the default weight, so however many processes it starts, a job
    # graded beside it still gets an equal share of the cores


def cgroup_settings(limits: Limits) -> dict[str, dict[str, str]]:
    """controller -> {file: value} of one job's cgroups (cgroup v1 hierarchies under CGROUP_ROOT)."""
    return {"pids": {"pids.max": str(limits.pids)},
            "memory": {"memory.limit_in_bytes": str(limits.job_memory_bytes)},
            "cpu": {"cpu.shares": "1024"}}


def rlimits_env(limits: Limits) -> dict:
    """Read by launch.forkrun in each rank right after fork."""
    return {"COURSE_RLIMITS": json.dumps({"AS": limits.memory_bytes, "FSIZE": limits.file_bytes,
                                          "CPU": limits.cpu_seconds})}


def python_paths() -> list[str]:
    """The interpreter, its standard library and every site-packages folder this process uses."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable),
             os.path.dirname(os.path.realpath(sys.executable)), *site.getsitepackages()}
    return sorted(p for p in paths if p and os.path.exists(p))


def _outermost(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Drop a bind whose destination lies inside another's (binding a folder twice is pointless)."""
    dests = {d for _, d in pairs}
    return [(s, d) for s, d in pairs if not any(d != o and d.startswith(o.rstrip("/") + "/") for o in dests)]


def view_binds(course: tuple[str, ...], root: str = ROOT) -> list[tuple[str, str]]:
    """(source, destination) read-only binds: Python and the named parts of the course.

    Sources are real paths (a venv reached through a symlink into /tmp must not vanish under the box's
    own /tmp); each is also bound at the path this process knows it by, so sys.executable still works.
    """
    pairs = []
    for p in python_paths() + [os.path.join(root, c) for c in course]:
        real = os.path.realpath(p)
        if os.path.exists(real):
            pairs += [(real, real)] + ([(real, p)] if os.path.abspath(p) != real else [])
    return _outermost(sorted(set(pairs), key=lambda sd: (sd[1].count("/"), sd[1])))


def _ancestors(path: str) -> list[str]:
    """'/a/b/c' -> ['/a', '/a/b', '/a/b/c']."""
    parts = [p for p in path.split("/") if p]
    return ["/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1)]


RANK_NAMES = 256        # ranks of a job named in the box's /etc/passwd (a job has at most a few)


def identity_files(folder: str, uid: int, home: str) -> tuple[str, str]:
    """The box's own /etc/passwd and /etc/group, written in `folder`: root, the box's unprivileged user `uid` and each
    grading rank's own uid below it, named (rank r is `rank{r}`, its group the same), their home `home` (a rank's is
    its own out/, at that same path in each rank's mount namespace). The machine's accounts are not in them."""
    users = [("root", 0, "/root"), ("nobody" if uid == NOBODY else "grader-box", uid, home)]
    users += [(rank_name(r), rank_uid(uid, r), home) for r in range(RANK_NAMES) if rank_uid(uid, r) > 0]
    passwd, group = os.path.join(folder, "passwd"), os.path.join(folder, "group")
    with open(passwd, "w") as f:
        f.writelines(f"{name}:x:{u}:{u}:{name}:{h}:/usr/sbin/nologin\n" for name, u, h in users)
    with open(group, "w") as f:
        f.writelines(f"{'nogroup' if u == NOBODY else name}:x:{u}:\n" for name, u, _ in users)
    for path in (folder, passwd, group):
        os.chmod(path, 0o755 if path == folder else 0o644)
    return passwd, group


def unprivileged_uid() -> int | None:
    """The uid student code runs as: nobody when we are root, else None (keep our own identity)."""
    return NOBODY if os.geteuid() == 0 else None


def _procs(cgroup: str) -> list[int]:
    try:
        with open(os.path.join(cgroup, "cgroup.procs")) as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def give_to(path: str, uid: int | None):
    """Let the box's user write `path` (a folder made by the trusted process)."""
    if uid is not None:
        os.chown(path, uid, uid)


def clean_env(env: dict, extra: dict | None = None) -> dict:
    """The variables student code may see: an allowlist of `env` (no instructor paths), plus `extra`; never a name
    ENV_DENY matches, from either."""
    kept = {k: v for k, v in env.items() if k in ENV_KEEP or k.startswith("COURSE_")}
    return {k: v for k, v in {**kept, **(extra or {})}.items() if not ENV_DENY.search(k)}


@dataclass
class Sandbox:
    """A box around one grading job (view=RANK_VIEW) or one kernel (view=KERNEL_VIEW).

    writable: folders the box may write (bound read-write, owned by the box's uid).
    readable: extra files or folders bound read-only at their own paths (the job's inputs).
    setpriv: drop to the unprivileged uid with setpriv inside the box (kernels, torchrun); grading ranks
    started by the fork launcher drop themselves after fork instead (COURSE_RANK_UID), so the launcher
    that carries their collectives stays out of their reach.
    """
    writable: list[str] = field(default_factory=list)
    readable: list[str] = field(default_factory=list)
    view: tuple[str, ...] = RANK_VIEW
    chdir: str | None = None
    setpriv: bool = False
    limits: Limits = field(default_factory=Limits)
    mode: str = field(default_factory=lambda: os.environ.get("GRADER_SANDBOX", "auto"))
    prefix: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)
    uid: int | None = None
    etc: str | None = None          # the folder of the box's own /etc/passwd and /etc/group (`identity_files`)

    def __enter__(self) -> "Sandbox":
        if self.mode not in ("auto", "on", "off"):
            raise ValueError(f"GRADER_SANDBOX={self.mode!r} is unknown: use auto, on or off")
        if self.mode == "off":
            self.notes.append("sandbox off (GRADER_SANDBOX=off): student code runs with your privileges")
            return self
        try:
            return self._enter()
        except BaseException:
            self.__exit__(None, None, None)     # the cgroups made before the refusal
            raise

    def _enter(self) -> "Sandbox":
        self.env.update(rlimits_env(self.limits))
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise SandboxUnavailable(
                "bubblewrap (bwrap) is not installed, so student code would run unboxed, with your privileges, "
                "your files and the network. Install it (`make sandbox-deps`, or `apt-get install bubblewrap`), "
                "or set GRADER_SANDBOX=off to run unboxed on purpose (your own code on your own machine).")
        self.uid = unprivileged_uid()
        drop = []
        if self.uid is not None:
            for path in self.writable:
                give_to(path, self.uid)
            if self.setpriv:
                setpriv = shutil.which("setpriv")
                if setpriv is None:
                    self.degrade("setpriv (util-linux) is not installed, so the box cannot drop to an unprivileged "
                                 "user: install util-linux")
                    return self
                drop = [setpriv, f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups",
                        "--inh-caps=-all", "--bounding-set=-all"]
            else:
                self.env["COURSE_RANK_UID"] = str(self.uid)
        self._cgroup()
        self.prefix = self.prefix + self._bwrap_args(bwrap) + ["--"] + drop
        return self

    def _bwrap_args(self, bwrap: str) -> list[str]:
        """bubblewrap's arguments: new namespaces, the system read-only, a private /tmp, the view, our folders."""
        args = [bwrap, "--die-with-parent", "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
                "--new-session", "--hostname", "localhost"]
        if os.geteuid() != 0:
            args += ["--unshare-user"]          # an unprivileged bubblewrap needs its own user namespace
        for path in SYSTEM:
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        if self.uid is not None and os.path.isdir("/etc") and not os.path.islink("/etc"):   # its own accounts
            self.etc = tempfile.mkdtemp(prefix="grader-box-etc-")
            for src in identity_files(self.etc, self.uid, self.chdir or "/tmp"):
                args += ["--ro-bind", src, os.path.join("/etc", os.path.basename(src))]
        args += ["--dev", "/dev", "--proc", "/proc", "--perms", "1777", "--size", str(self.limits.tmp_bytes),
                 "--tmpfs", "/tmp"]
        for d in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"):
            if os.path.exists(d):               # NCCL ranks need their GPUs
                args += ["--dev-bind", d, d]
        binds = view_binds(self.view)
        # bubblewrap makes missing parent folders mode 0700 when run as root: the unprivileged uid could
        # not walk through them, so make every parent of a bind first, world-traversable
        parents = sorted({os.path.dirname(d) for d in [dest for _, dest in binds] + self.readable + self.writable})
        for parent in parents:
            steps = [p for p in _ancestors(parent) if p != "/tmp" and not any(
                p == d or p.startswith(d + "/") for d in SYSTEM)]
            for step in steps:
                if step not in args:
                    args += ["--perms", "0755", "--dir", step]
        for src, dest in binds:
            args += ["--ro-bind", src, dest]
        for path in self.readable:
            args += ["--ro-bind", path, path]
        for path in self.writable:
            args += ["--bind", path, path]
        if self.chdir:
            args += ["--chdir", self.chdir]
        return args

    def degrade(self, msg: str):
        """A part of the box is missing (`msg` says which, and how to add it): a note, or (GRADER_SANDBOX=on) a
        refusal."""
        if self.mode == "on":
            raise SandboxUnavailable(f"GRADER_SANDBOX=on, and {msg}. Fix that, or set GRADER_SANDBOX=auto to grade "
                                     "in a box without it (each report's sandbox notes then say what is missing).")
        self.notes.append(msg)

    def base_env(self, env: dict, extra: dict | None = None) -> dict:
        """What boxed code starts from: an allowlist of `env` plus the box's own variables and `extra`
        (`clean_env`: no secret passes, whoever names it)."""
        if not self.prefix:
            return {**env, **self.env, **(extra or {})}
        return clean_env(env, {**self.env, "HOME": self.chdir or "/tmp", **(extra or {})})

    def _cgroup(self):
        """One cgroup per controller for this job; the box's first process joins them all before exec, so
        everything the job starts is counted from its first fork. A controller that cannot be used is a note."""
        name = f"grader-{uuid.uuid4().hex[:12]}"
        for controller, files in cgroup_settings(self.limits).items():
            path = os.path.join(CGROUP_ROOT, controller, name)
            try:
                if not os.access(os.path.dirname(path), os.W_OK):
                    raise OSError(f"no writable {controller} cgroup at {os.path.dirname(path)}")
                os.mkdir(path)
                for fname, value in files.items():
                    with open(os.path.join(path, fname), "w") as f:
                        f.write(value)
            except OSError as exc:
                if os.path.isdir(path):
                    os.rmdir(path)
                self.degrade(f"the job has no {controller} limit ({exc}): run the grader as root where cgroup v1 "
                             f"hierarchies are mounted under {CGROUP_ROOT}")
                continue
            self.cgroups.append(path)
        if self.cgroups:
            join = " && ".join(f"echo $$ > {p}/cgroup.procs" for p in self.cgroups)
            self.prefix = ["/bin/sh", "-c", f'{join} && exec "$@"', "sh"]

    def __exit__(self, *exc):
        pids_group = next((p for p in self.cgroups if "/pids/" in p), None)
        if pids_group:
            kill_until_gone(lambda: _procs(pids_group), timeout=20.0)   # a fork bomb's last children too
        for path in self.cgroups:
            try:
                os.rmdir(path)
            except OSError:
                pass
        self.cgroups = []
        if self.etc:
            shutil.rmtree(self.etc, ignore_errors=True)
            self.etc = None
        return False

    def describe(self) -> dict:
        return {"prefix": self.prefix, "limits": asdict(self.limits), "notes": self.notes, "cgroups": self.cgroups,
                "uid": self.uid}
