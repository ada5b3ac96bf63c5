"""Each grading rank alone in its box: no network, no file, process or IPC object it shares with a peer.

All ranks of a job are the same student's code, so they may cooperate to cheat: any channel between two
ranks other than the switchboard (a file in a shared /tmp, a loopback socket, a signal, another rank's
/proc, a lock on a file both can open) is communication the grade would not see. Run by the launcher in each
forked rank, as root and before it drops to the rank's own uid (`launch.forkrun.drop_privileges`):
- a new network namespace (not even a loopback: the switchboard's socket is inherited), IPC namespace
  (System V and POSIX message queues) and mount namespace;
- in that mount namespace: a fresh /tmp and /dev/shm, /proc showing only the rank's own processes
  (hidepid=2), and the rank's own folder `out/rank{r}` mounted over `out/`, its home and only writable place
  in the job (a size-capped tmpfs the grader mounted there: `capped_tmpfs`); the box names the rank's uid in
  its /etc/passwd (grader/box/sandbox.py), and torch.compile's caches go to the rank's own /tmp (`rank_env`);
- a pid namespace of its own (`own_pid_namespace`): no peer's pid, process count or load is visible;
- a uid of its own (`rank_uid`), so no rank can signal, trace or read another;
- a new devpts instance (a pty is not shared), and a seccomp filter refusing what would still reach a peer
  through a file both can read or through the kernel (`deny_shared_kernel_objects`): inotify, fanotify and
  dnotify watches, fcntl record locks, the kernel keyring, and every 32-bit or x32 system call (which a filter
  written for x86-64 numbers would let through). `flock` is not refused outright: the process the launcher
  forked, outside the rank's pid namespace, takes each of the rank's flock calls (seccomp user notification)
  and carries it out itself on the rank's own open file (`LockKeeper`) when that file lies on a filesystem
  only this rank can reach (its /tmp, /dev/shm, out/); on any other file it answers ECOMM. So filelock and
  torch.compile's caches work, and no lock is ever taken on a file a peer can open;
- no file descriptor of the launcher's but the ones it hands the rank (`close_inherited`).
A call the box refuses fails with an errno nothing else gives that call (`REFUSED`): the verdict names what was
refused and why (`refusal_in`, used by `describe_error` in grader/judge/compare.py).
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import re
import select
import shutil
import signal
import socket
import stat
import struct

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWPID = 0x00020000, 0x08000000, 0x40000000, 0x20000000
MS_BIND, MS_REC, MS_PRIVATE, MS_SHARED, MS_NOSUID, MS_NODEV = 0x1000, 0x4000, 0x40000, 0x100000, 0x2, 0x4
MNT_DETACH = 2
TMP_BYTES = 64 << 20

_libc = ctypes.CDLL(None, use_errno=True)

# What the box answers a refused call with: errnos Linux itself never gives these calls, so the student's traceback
# ("OSError: [Errno 70] Communication error on send") says the box refused it, and the grader can say what and why.
REFUSED = {
    errno.ECOMM: ("flock on a file other ranks can open",
                  "a lock on a file two ranks can open would carry signals between them, outside the switchboard; a "
                  "grading rank may lock only its own files: those under /tmp (tempfile's folder, where torch.compile "
                  "keeps its caches), /dev/shm and its home, out/"),
    errno.EBADRQC: ("an fcntl record lock (fcntl F_SETLK, F_SETLKW, F_GETLK, their OFD forms, fcntl.lockf)",
                    "a grading rank may lock only with flock (fcntl.flock, the filelock package), on its own files"),
    errno.ESRMNT: ("a watch on files (inotify, fanotify or fcntl F_NOTIFY)",
                   "a watch on a file another rank reads would carry signals between them; a grading rank may not "
                   "watch files"),
    errno.EADV: ("the kernel keyring (add_key, request_key, keyctl)",
                 "the keyring is shared by every process of a uid; a grading rank may not use it"),
}


def refusal_in(text: str) -> tuple[str, str] | None:
    """(what was refused, why) when `text` (a rank's traceback) shows a call the box refused, else None. Only the
    exception lines count (a traceback's source lines are indented)."""
    text = "\n".join(line for line in text.splitlines() if line and not line[0].isspace())
    for code, said in REFUSED.items():
        if re.search(rf"\[Errno {code}\] {re.escape(os.strerror(code))}", text):
            return said
    return None


class IsolationUnavailable(OSError):
    """This process may not make namespaces (not root, or a box without the capability)."""


def _check(ret: int, what: str):
    if ret != 0:
        err = ctypes.get_errno()
        raise IsolationUnavailable(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None):
    _check(_libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), ctypes.c_ulong(flags),
                       data and data.encode()), f"mount {target}")


def capped_tmpfs(path: str, size: int, files: int, mode: int):
    """A tmpfs of `size` bytes and `files` inodes over `path` (the grader, as root, over a rank's out/): a write past
    it fails with ENOSPC inside the writer, and the disk never sees it."""
    _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},nr_inodes={files},mode={mode:o}")


def share(path: str):
    """Make `path` a shared mount point: what is mounted below it later reaches a box already bound to it (a box's
    binds are its slaves), as a rank's capped out/ must reach a launcher started before the job's size was known."""
    _mount(path, path, None, MS_BIND)
    try:
        _mount(None, path, None, MS_SHARED)
    except IsolationUnavailable:
        unmount(path)
        raise


def unmount(path: str):
    """Detach what is mounted at `path` (its files go with a tmpfs)."""
    _check(_libc.umount2(path.encode(), MNT_DETACH), f"umount {path}")


def rank_uid(base: int, rank: int) -> int:
    """Rank r's own uid: below the box's unprivileged uid, one per rank."""
    return base - 1 - rank


def rank_name(rank: int) -> str:
    """Rank r's user (and group) name: what the box's /etc/passwd calls `rank_uid(base, r)`."""
    return f"rank{rank}"


def rank_env(rank: int) -> dict:
    """What an isolated rank's environment says of its identity and its caches: torch.compile's (inductor's fx graph,
    AOTAutograd and kernel caches, Triton's) in its own /tmp, where its flock locks are allowed."""
    cache = f"/tmp/torchinductor_{rank_name(rank)}"          # inductor's own default, for this user
    return {"USER": rank_name(rank), "LOGNAME": rank_name(rank), "TMPDIR": "/tmp",
            "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
            "XDG_CACHE_HOME": "/tmp/.cache", **COMPILE_ENV}


# how inductor compiles in a grading rank (and in the seed that warms its cache: grader/judge/inductor_seed.py): in the
# rank's own process, not in a pool of fresh interpreters (each importing torch again), and without the precompiled
# header (155 MB, past a rank's /tmp and its largest file; built once per machine to speed later compiles up)
COMPILE_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0"}


def seed_cache(rank: int, uid: int):
    """Start the rank's torch.compile cache as its own copy of the job's seed (COURSE_INDUCTOR_SEED, a folder only
    root reads: grader/judge/inductor_seed.py), if the job has one."""
    seed = os.environ.pop("COURSE_INDUCTOR_SEED", "")
    if not seed or not os.path.isdir(seed):
        return
    cache = rank_env(rank)["TORCHINDUCTOR_CACHE_DIR"]
    try:
        shutil.copytree(seed, cache, symlinks=True)
    except OSError:             # a cold cache: slower, never wrong
        shutil.rmtree(cache, ignore_errors=True)
        return
    for dirpath, dirs, files in os.walk(cache):
        for name in [dirpath] + [os.path.join(dirpath, n) for n in dirs + files]:
            os.lchown(name, uid, uid)


def _outermost_mounts_under(root: str) -> list[str]:
    """Mount points below `root` (the box's binds: the course, Python, the job) not inside another one."""
    with open("/proc/self/mountinfo") as f:
        points = sorted({line.split()[4].encode().decode("unicode_escape") for line in f})
    below = [p for p in points if p.startswith(root.rstrip("/") + "/")]
    return [p for p in below if not any(p.startswith(q + "/") for q in below)]


def _fresh_tmp():
    """A fresh /tmp, with what the box bound below the old one (a job folder, a checkout or venv under /tmp)
    bound again at the same paths."""
    kept = [(p, os.open(p, os.O_PATH), os.path.isdir(p)) for p in _outermost_mounts_under("/tmp")]
    try:
        _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={TMP_BYTES},mode=1777")
        for path, fd, is_dir in kept:
            os.makedirs(path if is_dir else os.path.dirname(path), mode=0o755, exist_ok=True)
            if not is_dir:
                open(path, "w").close()
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
    finally:
        for _, fd, _ in kept:
            os.close(fd)


def _own_filesystems(outdir: str) -> set[int]:
    """st_dev of the filesystems only this rank can reach: its /tmp and /dev/shm (tmpfs mounted in its own mount
    namespace) and its out/ when that is the tmpfs the grader mounted for this rank alone (uncapped, it is a folder
    of the job's filesystem: not its own)."""
    own = {os.stat("/tmp").st_dev}
    if os.path.ismount("/dev/shm"):
        own.add(os.stat("/dev/shm").st_dev)
    if os.stat(outdir).st_dev != os.stat(os.path.dirname(outdir)).st_dev:
        own.add(os.stat(outdir).st_dev)
    return own


def isolate(rank: int, outdir: str, uid: int):
    """Put this (forked, still root) rank process in namespaces of its own; see the module docstring."""
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWNET), "unshare")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)            # nothing mounted here leaks to the peers
    own = os.path.join(outdir, f"rank{rank}")
    os.makedirs(own, mode=0o700, exist_ok=True)
    os.chown(own, uid, uid)
    _fresh_tmp()
    _mount(own, outdir, None, MS_BIND)                       # out/ is now this rank's folder alone
    seed_cache(rank, uid)
    os.chdir(outdir)
    if os.path.isdir("/dev/shm"):
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={TMP_BYTES},mode=1777")
    if os.path.isdir("/dev/pts"):
        _mount("devpts", "/dev/pts", "devpts", MS_NOSUID, "newinstance,ptmxmode=0666,mode=0620")
        if os.path.exists("/dev/ptmx") and not os.path.islink("/dev/ptmx"):
            _mount("/dev/pts/ptmx", "/dev/ptmx", None, MS_BIND)
    keeper = LockKeeper(_own_filesystems(outdir))
    own_pid_namespace(keeper)
    keeper.child_side()
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV, "hidepid=2")    # the new namespace's processes only
    keeper.hand_over(deny_shared_kernel_objects(supervised=keeper.available))
    os.environ.update(rank_env(rank))


def own_pid_namespace(keeper: "LockKeeper | None" = None):
    """Continue as pid 1 of a new pid namespace. The process the launcher forked stays outside as its parent:
    it passes a stop on (as SIGKILL: pid 1 ignores signals it has no handler for), keeps the rank's flock locks
    (`keeper`, on a thread of its own) and ends with the rank's status; the rank dies with it."""
    _check(_libc.unshare(CLONE_NEWPID), "unshare pid")
    pid = os.fork()
    if pid == 0:
        _libc.prctl(1, signal.SIGKILL)                       # PR_SET_PDEATHSIG
        return
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: os.kill(pid, signal.SIGKILL))
    if keeper is not None:
        keeper.serve(pid)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status)
    if code < 0:                                             # killed by a signal: end the same way
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def close_inherited(keep: set[int]):
    """Close every descriptor the launcher had open (its selector, its other pipes) but 0-2 and `keep`."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:        # the listing's own descriptor, already gone
                pass


# seccomp user notification (linux/seccomp.h): the listener's ioctls and what they carry
_SECCOMP, _SET_MODE_FILTER, _FLAG_NEW_LISTENER = 317, 1, 1 << 3
_PIDFD_OPEN, _PIDFD_GETFD, _PIDFD_THREAD = 434, 438, os.O_EXCL
_NOTIF_RECV, _NOTIF_SEND = 0xC0502100, 0xC0182101                # _IOWR('!', 0 / 1, ...)
_NOTIF_ID_VALID = (0x40082102, 0x80082102)                      # _IOW('!', 2, u64); before Linux 5.17, _IOR
_LOCK_SH, _LOCK_EX, _LOCK_NB = 1, 2, 4


class _Notif(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("pid", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("nr", ctypes.c_int32), ("arch", ctypes.c_uint32), ("ip", ctypes.c_uint64),
                ("args", ctypes.c_uint64 * 6)]


class _Resp(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("val", ctypes.c_int64), ("error", ctypes.c_int32), ("flags", ctypes.c_uint32)]


class LockKeeper:
    """The rank's flock calls, carried out by the process the launcher forked (root, outside the rank's pid
    namespace and its seccomp filter): it takes the rank's open file itself (pidfd_getfd: the same open file, not
    the name, so what it checks is what it locks), locks it when the file lies on one of `own` (the filesystems
    only this rank reaches: `_own_filesystems`) and answers ECOMM otherwise. A flock lock belongs to the open file,
    so the rank holds it exactly as if it had taken it: it goes with the rank's last descriptor of that file. A
    blocking flock that must wait is tried again every `RETRY_S` until it succeeds or its caller gives up (at most
    `WAITING` at once; past them, ENOLCK). One thread: this process has unshared its pid namespace, so it may start
    no thread."""

    WAITING, RETRY_S = 256, 0.01

    def __init__(self, own: set[int]):
        self.own = own
        self.available = flock_keeper_available()
        self.parent, self.child = socket.socketpair()
        self.proc = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)   # pids as this process sees them (tid -> tgid)
        self.listener = -1
        self.waiting: dict[int, tuple[int, int]] = {}                 # call id -> (our descriptor, flock op)

    # -- the rank's side ------------------------------------------------------------------------------------------
    def child_side(self):
        """In the rank: nothing of the keeper's but its end of the socket (not /proc of the launcher's pids)."""
        os.close(self.proc)
        self.parent.close()

    def hand_over(self, listener: int | None):
        """In the rank, its filter installed: give the listener to the keeper, and keep no copy."""
        try:
            if listener is not None:
                socket.send_fds(self.child, [b"L"], [listener])
                os.close(listener)
            else:
                self.child.sendall(b"N")
        finally:
            self.child.close()

    # -- the keeper's side -----------------------------------------------------------------------------------------
    def serve(self, pid: int):
        """In the launcher's forked process: answer the rank's flock calls until the rank `pid` has ended."""
        self.child.close()
        try:
            _, fds, _, _ = socket.recv_fds(self.parent, 1, 1)
        except OSError:
            fds = []
        finally:
            self.parent.close()
        if not fds:                 # no listener: flock is refused by the filter itself
            return
        self.listener = fds[0]
        ended = _libc.syscall(_PIDFD_OPEN, pid, 0)       # readable once the rank has ended
        if ended < 0:
            return
        poll = select.poll()
        poll.register(ended, select.POLLIN)
        poll.register(self.listener, select.POLLIN)
        while True:
            events = dict(poll.poll(int(self.RETRY_S * 1000) if self.waiting else None))
            if events.get(ended):
                return
            if events.get(self.listener, 0) & select.POLLIN:
                notif = _Notif()
                if _libc.ioctl(self.listener, ctypes.c_ulong(_NOTIF_RECV), ctypes.byref(notif)) == 0:
                    try:
                        self._flock(notif)
                    except Exception:   # noqa: BLE001  (never leave a call unanswered)
                        self._answer(notif.id, errno.ENOLCK)
                elif ctypes.get_errno() not in (errno.EINTR, errno.ENOENT):    # ENOENT: its caller went away
                    os.close(self.listener)                  # cannot serve: closed, the rank's flock fails (ENOSYS)
                    return
            elif events.get(self.listener):                  # POLLHUP: no process of the rank is left filtered
                poll.unregister(self.listener)
            for nid, (mine, op) in list(self.waiting.items()):
                if not self._valid(nid):                     # its caller gave up (a signal) or is gone
                    err = -1
                elif _libc.flock(mine, op | _LOCK_NB) == 0:
                    err = 0
                else:
                    err = ctypes.get_errno()
                    if err == errno.EWOULDBLOCK:
                        continue
                if err >= 0:
                    self._answer(nid, err)
                os.close(mine)
                del self.waiting[nid]

    def _answer(self, nid: int, err: int):
        resp = _Resp(id=nid, val=0, error=-err if err else 0, flags=0)
        _libc.ioctl(self.listener, ctypes.c_ulong(_NOTIF_SEND), ctypes.byref(resp))   # ENOENT: the caller is gone

    def _valid(self, nid: int) -> bool:
        """The call is still waiting: its task, and so the pid and descriptor it named, are still the caller's."""
        for request in _NOTIF_ID_VALID:
            if _libc.ioctl(self.listener, ctypes.c_ulong(request), ctypes.byref(ctypes.c_uint64(nid))) == 0:
                return True
            if ctypes.get_errno() == errno.ENOENT:
                return False
        return False

    def _their_file(self, tid: int, fd: int) -> int:
        """A descriptor of ours for the caller's open file `fd` (the very same open file)."""
        pidfd = _libc.syscall(_PIDFD_OPEN, tid, _PIDFD_THREAD)
        if pidfd < 0:                # before Linux 6.9 a pidfd names a process, not a thread: the caller's process
            pidfd = _libc.syscall(_PIDFD_OPEN, self._tgid(tid), 0)
        if pidfd < 0:
            raise OSError(ctypes.get_errno(), "pidfd_open")
        try:
            got = _libc.syscall(_PIDFD_GETFD, pidfd, fd, 0)
            if got < 0:
                raise OSError(ctypes.get_errno(), "pidfd_getfd")
            return got
        finally:
            os.close(pidfd)

    def _tgid(self, tid: int) -> int:
        fd = os.open(f"{tid}/status", os.O_RDONLY, dir_fd=self.proc)
        try:
            status = os.read(fd, 4096).decode()
        finally:
            os.close(fd)
        return int(re.search(r"^Tgid:\s*(\d+)", status, re.M).group(1))

    def _flock(self, notif: _Notif):
        fd, op = ctypes.c_int32(notif.args[0] & 0xFFFFFFFF).value, ctypes.c_int32(notif.args[1] & 0xFFFFFFFF).value
        try:
            mine = self._their_file(notif.pid, fd)
        except OSError as exc:
            if self._valid(notif.id):
                self._answer(notif.id, errno.EBADF if exc.errno == errno.EBADF else errno.ENOLCK)
            return
        kept = False
        try:
            if not self._valid(notif.id):        # the caller is gone: `mine` may be another process's file
                return
            st = os.fstat(mine)
            if st.st_dev not in self.own or not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                self._answer(notif.id, errno.ECOMM)
                return
            waits = bool(op & (_LOCK_SH | _LOCK_EX)) and not op & _LOCK_NB
            if _libc.flock(mine, op | _LOCK_NB if waits else op) == 0:
                self._answer(notif.id, 0)
                return
            err = ctypes.get_errno()
            if not (waits and err == errno.EWOULDBLOCK):
                self._answer(notif.id, err)
            elif len(self.waiting) >= self.WAITING:
                self._answer(notif.id, errno.ENOLCK)
            else:
                self.waiting[notif.id] = (mine, op)
                kept = True
        finally:
            if not kept:
                os.close(mine)


def flock_keeper_available() -> bool:
    """pidfd_open and pidfd_getfd (Linux 5.6), which the LockKeeper needs (x86-64 only, as the seccomp filter)."""
    if platform.machine() != "x86_64":
        return False
    pidfd = _libc.syscall(_PIDFD_OPEN, os.getpid(), 0)
    if pidfd < 0:
        return False
    try:
        got = _libc.syscall(_PIDFD_GETFD, pidfd, 0, 0)
        if got < 0:
            return False
        os.close(got)
        return True
    finally:
        os.close(pidfd)


# seccomp: x86-64 syscall numbers and fcntl commands of the calls refused, each with its errno (REFUSED)
_DENIED = {253: ("inotify_init", errno.ESRMNT), 254: ("inotify_add_watch", errno.ESRMNT),
           294: ("inotify_init1", errno.ESRMNT), 300: ("fanotify_init", errno.ESRMNT),
           248: ("add_key", errno.EADV), 249: ("request_key", errno.EADV), 250: ("keyctl", errno.EADV)}
_FLOCK, _FCNTL = 73, 72
_FCNTL_DENIED = {5: errno.EBADRQC, 6: errno.EBADRQC, 7: errno.EBADRQC,           # F_GETLK, F_SETLK, F_SETLKW
                 36: errno.EBADRQC, 37: errno.EBADRQC, 38: errno.EBADRQC,        # their OFD forms
                 1026: errno.ESRMNT}                                             # F_NOTIFY (dnotify)
_AUDIT_ARCH_X86_64, _X32_SYSCALL_BIT = 0xC000003E, 0x40000000


def _bpf(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def _filter(flock_action: int) -> list[bytes]:
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, err = 0x7FFF0000, 0x00050000                       # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | errno
    prog = [_bpf(ld, 0, 0, 4), _bpf(jeq, 1, 0, _AUDIT_ARCH_X86_64),    # a 32-bit call (int 0x80): refused
            _bpf(ret, 0, 0, err | errno.ENOSYS), _bpf(ld, 0, 0, 0),
            _bpf(jge, 0, 1, _X32_SYSCALL_BIT), _bpf(ret, 0, 0, err | errno.ENOSYS)]   # an x32 call: refused
    for nr, (_, code) in _DENIED.items():
        prog += [_bpf(jeq, 0, 1, nr), _bpf(ret, 0, 0, err | code)]
    prog += [_bpf(jeq, 0, 1, _FLOCK), _bpf(ret, 0, 0, flock_action)]
    prog += [_bpf(jeq, 1, 0, _FCNTL), _bpf(ret, 0, 0, allow), _bpf(ld, 0, 0, 24)]   # fcntl: its command
    for cmd, code in _FCNTL_DENIED.items():
        prog += [_bpf(jeq, 0, 1, cmd), _bpf(ret, 0, 0, err | code)]
    prog += [_bpf(ret, 0, 0, allow)]
    return prog


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def deny_shared_kernel_objects(supervised: bool = False) -> int | None:
    """Install the seccomp filter (x86-64 only; elsewhere nothing: the box's notes say so). `supervised`: flock goes
    to a listener, returned (a `LockKeeper` answers it), where the kernel has user notification; else flock on any
    file is refused (ECOMM) and None is returned."""
    if platform.machine() != "x86_64":
        return None
    _check(_libc.prctl(38, 1, 0, 0, 0), "no_new_privs")                # PR_SET_NO_NEW_PRIVS
    if supervised:
        prog = _filter(0x7FC00000)                                     # SECCOMP_RET_USER_NOTIF
        buf = ctypes.create_string_buffer(b"".join(prog))
        fprog = _SockFprog(len(prog), ctypes.cast(buf, ctypes.c_void_p))
        listener = _libc.syscall(_SECCOMP, _SET_MODE_FILTER, _FLAG_NEW_LISTENER, ctypes.byref(fprog))
        if listener >= 0:
            return listener
    prog = _filter(0x00050000 | errno.ECOMM)
    buf = ctypes.create_string_buffer(b"".join(prog))
    fprog = _SockFprog(len(prog), ctypes.cast(buf, ctypes.c_void_p))
    _check(_libc.prctl(22, 2, ctypes.byref(fprog), 0, 0), "seccomp")   # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
    return None
