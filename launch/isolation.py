"""Each grading rank alone in its box: no network, no file, process or IPC object it shares with a peer.

All ranks of a job are the same student's code, so they may cooperate to cheat: any channel between two
ranks other than the switchboard (a file in a shared /tmp, a loopback socket, a signal, another rank's
/proc) is communication the grade would not see. Run by the launcher in each forked rank, as root and
before it drops to the rank's own uid (`launch.forkrun.drop_privileges`):
- a new network namespace (not even a loopback: the switchboard's socket is inherited), IPC namespace
  (System V and POSIX message queues) and mount namespace;
- in that mount namespace: a fresh /tmp and /dev/shm, /proc showing only the rank's own processes
  (hidepid=2), and the rank's own folder `out/rank{r}` mounted over `out/`, its only writable place (a
  size-capped tmpfs the grader mounted there: `capped_tmpfs`);
- a pid namespace of its own (`own_pid_namespace`): no peer's pid, process count or load is visible;
- a uid of its own (`rank_uid`), so no rank can signal, trace or read another;
- a new devpts instance (a pty is not shared), and a seccomp filter refusing what would still reach a peer
  through a file both can read or through the kernel: file locks (flock, fcntl locks), inotify and
  fanotify watches, and the kernel keyring (`deny_shared_kernel_objects`);
- no file descriptor of the launcher's but the ones it hands the rank (`close_inherited`).
"""
from __future__ import annotations

import ctypes
import os
import platform
import signal
import struct

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWPID = 0x00020000, 0x08000000, 0x40000000, 0x20000000
MS_BIND, MS_REC, MS_PRIVATE, MS_SHARED, MS_NOSUID, MS_NODEV = 0x1000, 0x4000, 0x40000, 0x100000, 0x2, 0x4
MNT_DETACH = 2
TMP_BYTES = 64 << 20

_libc = ctypes.CDLL(None, use_errno=True)


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


def isolate(rank: int, outdir: str, uid: int):
    """Put this (forked, still root) rank process in namespaces of its own; see the module docstring."""
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWNET), "unshare")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)            # nothing mounted here leaks to the peers
    own = os.path.join(outdir, f"rank{rank}")
    os.makedirs(own, mode=0o700, exist_ok=True)
    os.chown(own, uid, uid)
    _fresh_tmp()
    _mount(own, outdir, None, MS_BIND)                       # out/ is now this rank's folder alone
    os.chdir(outdir)
    if os.path.isdir("/dev/shm"):
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={TMP_BYTES},mode=1777")
    if os.path.isdir("/dev/pts"):
        _mount("devpts", "/dev/pts", "devpts", MS_NOSUID, "newinstance,ptmxmode=0666,mode=0620")
        if os.path.exists("/dev/ptmx") and not os.path.islink("/dev/ptmx"):
            _mount("/dev/pts/ptmx", "/dev/ptmx", None, MS_BIND)
    own_pid_namespace()
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV, "hidepid=2")    # the new namespace's processes only
    deny_shared_kernel_objects()


def own_pid_namespace():
    """Continue as pid 1 of a new pid namespace. The process the launcher forked stays outside as its parent:
    it passes a stop on (as SIGKILL: pid 1 ignores signals it has no handler for) and ends with the rank's
    status; the rank dies with it."""
    _check(_libc.unshare(CLONE_NEWPID), "unshare pid")
    pid = os.fork()
    if pid == 0:
        _libc.prctl(1, signal.SIGKILL)                       # PR_SET_PDEATHSIG
        return
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: os.kill(pid, signal.SIGKILL))
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


# seccomp: x86-64 syscall numbers and fcntl commands of the calls refused (EPERM)
_DENIED = {73: "flock", 248: "add_key", 249: "request_key", 250: "keyctl", 253: "inotify_init",
           254: "inotify_add_watch", 294: "inotify_init1", 300: "fanotify_init"}
_FCNTL, _FCNTL_LOCKS = 72, (5, 6, 7, 36, 37, 38)      # F_GETLK, F_SETLK, F_SETLKW and their OFD forms
_AUDIT_ARCH_X86_64 = 0xC000003E


def _bpf(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def deny_shared_kernel_objects() -> bool:
    """Install the seccomp filter (x86-64 only; elsewhere False: the box's notes say so)."""
    if platform.machine() != "x86_64":
        return False
    ld, jeq, ret = 0x20, 0x15, 0x06
    allow, deny = 0x7FFF0000, 0x00050000 | 1                  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM
    prog = [_bpf(ld, 0, 0, 4), _bpf(jeq, 1, 0, _AUDIT_ARCH_X86_64), _bpf(ret, 0, 0, allow), _bpf(ld, 0, 0, 0)]
    for nr in _DENIED:
        prog += [_bpf(jeq, 0, 1, nr), _bpf(ret, 0, 0, deny)]
    prog += [_bpf(jeq, 1, 0, _FCNTL), _bpf(ret, 0, 0, allow), _bpf(ld, 0, 0, 24)]   # fcntl: its command
    for cmd in _FCNTL_LOCKS:
        prog += [_bpf(jeq, 0, 1, cmd), _bpf(ret, 0, 0, deny)]
    prog += [_bpf(ret, 0, 0, allow)]
    buf = ctypes.create_string_buffer(b"".join(prog))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    fprog = SockFprog(len(prog), ctypes.cast(buf, ctypes.c_void_p))
    _check(_libc.prctl(38, 1, 0, 0, 0), "no_new_privs")                # PR_SET_NO_NEW_PRIVS
    _check(_libc.prctl(22, 2, ctypes.byref(fprog), 0, 0), "seccomp")   # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
    return True
