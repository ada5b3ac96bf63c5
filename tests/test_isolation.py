"""The ranks of one graded job may talk only through the switchboard (launch.isolation, launch.switchboard).

All ranks run the same student's code, so they can cooperate: rank 0 tries to hand rank 1 a secret over
every channel two processes on one machine share (files, sockets, /proc, signals, IPC objects, kernel objects
inherited or global), rank 1 looks for it for a few seconds and raises "CHANNEL <name> worked" if it arrives.
A correct solution carrying such a probe must still pass. Unboxed, the same probe does get through (so the
probe is not vacuous), and a rank that edits what it records in its own process still gets the communication
the switchboard saw.
"""
import os
import shutil
import textwrap
import uuid

import pytest

from grader.box.sandbox import NOBODY
from grader.tools.corpus import solution_modules

needs_box = pytest.mark.skipif(shutil.which("bwrap") is None or os.geteuid() != 0,
                               reason="needs bubblewrap and root (make test installs it; CI runs as root)")

CASE = "week02/column_parallel"

# Runs at import in every rank. Rank 0 opens each wanted channel and keeps it open ~3.5 s ("SENT name" on
# its output when the channel could be opened at all); rank 1 polls each for 2.5 s, then raises naming every
# channel the secret came through. @TAG@ (a fresh hex tag) and @WANT@ (channel names) are filled in per job.
PROBE = textwrap.dedent(r'''
    import ctypes as _ct, errno as _errno, fcntl as _fcntl, os as _os, select as _select, socket as _sk
    import threading as _th, time as _time
    _RANK, _TAG, _WANT = int(_os.environ["RANK"]), "@TAG@", @WANT@
    _SECRET = ("secret-" + _TAG).encode()
    _PORT = 20000 + int(_TAG[:6], 16) % 20000
    _KEY = int(_TAG[:7], 16)
    _LIBC = _ct.CDLL(None, use_errno=True)
    _LIBC.shmat.restype = _ct.c_void_p
    _KEEP = []                                   # what rank 0 holds open while rank 1 looks
    _DIRS = {"tmp-file": "/tmp", "dev-shm-file": "/dev/shm", "var-tmp-file": "/var/tmp", "out-file": ".",
             "attempt-file": "..", "job-file": "../..", "student-file": "../../student"}
    _UNIX = {"abstract-unix": "\0iso-" + _TAG, "unix-file": "/tmp/iso-" + _TAG + ".sock"}

    def _later(seconds, fn):
        t = _th.Timer(seconds, fn)
        t.daemon = True
        t.start()

    def _serve(sock):
        sock.listen()
        _KEEP.append(sock)
        def answer():
            while True:
                c, _ = sock.accept()
                c.sendall(_SECRET)
                c.close()
        _th.Thread(target=answer, daemon=True).start()

    def _fetch(family, addr):
        with _sk.socket(family, _sk.SOCK_STREAM) as c:
            c.settimeout(0.2)
            c.connect(addr)
            return c.recv(64) == _SECRET

    def _epoll_fd():
        return next(int(fd) for fd in _os.listdir("/proc/self/fd")
                    if _os.readlink("/proc/self/fd/" + fd) == "anon_inode:[eventpoll]")

    def _others():
        """pids of processes this rank did not start (its own threads excluded)."""
        own = {int(t) for t in _os.listdir("/proc/self/task")}
        try:
            last = int(open("/proc/sys/kernel/ns_last_pid").read())
        except OSError:
            last = 4096
        return [p for p in range(1, last + 64) if p not in own]

    def _last_pid():
        return int(open("/proc/sys/kernel/ns_last_pid").read())

    # -- rank 0's side ----------------------------------------------------------------------------------
    def _send_file(name):
        with open(_os.path.join(_DIRS[name], "iso-" + _TAG), "wb") as f:
            f.write(_SECRET)

    def _send_tcp(name):
        s = _sk.socket()
        s.bind(("127.0.0.1", _PORT))
        _serve(s)

    def _send_udp(name):
        s = _sk.socket(_sk.AF_INET, _sk.SOCK_DGRAM)
        s.sendto(b"", ("127.0.0.1", _PORT + 1))            # raises here if there is no loopback at all
        def spray():
            end = _time.monotonic() + 3.5
            while _time.monotonic() < end:
                try:
                    s.sendto(_SECRET, ("127.0.0.1", _PORT + 1))
                except OSError:
                    pass
                _time.sleep(0.05)
        _th.Thread(target=spray, daemon=True).start()

    def _send_unix(name):
        s = _sk.socket(_sk.AF_UNIX, _sk.SOCK_STREAM)
        s.bind(_UNIX[name])
        _serve(s)

    def _send_posix_shm(name):
        import _posixshmem        # what multiprocessing.shared_memory stands on, without its tracker process
        fd = _posixshmem.shm_open("/iso-shm-" + _TAG, _os.O_CREAT | _os.O_RDWR, 0o666)
        _os.pwrite(fd, _SECRET, 0)

    def _send_sysv_shm(name):
        sid = _LIBC.shmget(_KEY, 64, 0o1000 | 0o666)        # IPC_CREAT
        addr = _LIBC.shmat(sid, None, 0) if sid >= 0 else None
        if addr in (None, _ct.c_void_p(-1).value):
            raise OSError(_ct.get_errno(), "shmget/shmat")
        _ct.memmove(addr, _SECRET, len(_SECRET))

    def _send_mq(name):
        q = _LIBC.mq_open(("/iso-" + _TAG).encode(), _os.O_CREAT | _os.O_WRONLY, 0o666, None)
        if q < 0 or _LIBC.mq_send(q, _SECRET, len(_SECRET), 0) != 0:
            raise OSError(_ct.get_errno(), "mq_open/mq_send")

    def _send_epoll(name):
        ep = _select.epoll.fromfd(_os.dup(_epoll_fd()))      # the same epoll instance the launcher selects on
        _, w = _os.pipe()
        fd = 900 + int(_TAG[:2], 16) % 99                    # the fd number is what a peer's poll reports
        _os.dup2(w, fd)
        ep.register(fd, _select.EPOLLOUT)
        _KEEP.append(ep)
        _later(3.5, lambda: ep.unregister(fd))               # level-triggered: stop the launcher's spin

    def _send_pty(name):
        _KEEP.extend(_os.openpty() for _ in range(3))

    def _send_flock(name):
        import tpkit
        f = open(tpkit.__file__, "rb")                       # read-only and shared by every rank
        _fcntl.flock(f, _fcntl.LOCK_EX)
        _KEEP.append(f)
        _later(3.5, lambda: _fcntl.flock(f, _fcntl.LOCK_UN))

    def _send_keyring(name):
        serial = _LIBC.syscall(248, b"user", ("iso-" + _TAG).encode(), _SECRET, len(_SECRET), -2)   # add_key
        if serial < 0 or _LIBC.syscall(250, 5, serial, 0x3f3f3f3f) != 0:                            # SETPERM
            raise OSError(_ct.get_errno(), "add_key/keyctl")

    def _send_pid_counter(name):
        _last_pid()
        def burn():                                          # ~100 pids every 0.1 s: the shared pid counter moves
            end = _time.monotonic() + 3.5
            while _time.monotonic() < end:
                for _ in range(100):
                    t = _th.Thread(target=int)
                    t.start()
                    t.join()
                _time.sleep(0.1)
        _th.Thread(target=burn, daemon=True).start()

    # -- rank 1's side: True when the secret (or rank 0's doing) is seen --------------------------------------
    def _recv_file(name, state):
        with open(_os.path.join(_DIRS[name], "iso-" + _TAG), "rb") as f:
            return f.read() == _SECRET

    def _recv_tcp(name, state):
        return _fetch(_sk.AF_INET, ("127.0.0.1", _PORT))

    def _recv_udp(name, state):
        if "sock" not in state:
            state["sock"] = _sk.socket(_sk.AF_INET, _sk.SOCK_DGRAM)
            state["sock"].bind(("127.0.0.1", _PORT + 1))
            state["sock"].setblocking(False)
        return state["sock"].recv(64) == _SECRET

    def _recv_unix(name, state):
        return _fetch(_sk.AF_UNIX, _UNIX[name])

    def _recv_proc(name, state):
        for pid in _others():
            for what in ("environ", "stat", "cmdline"):
                try:
                    with open(f"/proc/{pid}/{what}", "rb") as f:
                        if f.read(1):
                            return True
                except OSError:
                    pass
            try:
                _os.close(_os.open(f"/proc/{pid}/mem", _os.O_RDONLY))
                return True
            except OSError:
                pass
        return any(d.isdigit() and int(d) != _os.getpid() for d in _os.listdir("/proc"))

    def _recv_signal(name, state):
        for pid in _others():
            try:
                _os.kill(pid, 0)
                return True
            except OSError:
                pass
        return False

    def _recv_posix_shm(name, state):
        import _posixshmem
        fd = _posixshmem.shm_open("/iso-shm-" + _TAG, _os.O_RDONLY, 0)
        try:
            return _os.pread(fd, len(_SECRET), 0) == _SECRET
        finally:
            _os.close(fd)

    def _recv_sysv_shm(name, state):
        sid = _LIBC.shmget(_KEY, 0, 0)
        addr = _LIBC.shmat(sid, None, 0o10000) if sid >= 0 else None          # SHM_RDONLY
        return addr not in (None, _ct.c_void_p(-1).value) and _ct.string_at(addr, len(_SECRET)) == _SECRET

    def _recv_mq(name, state):
        q = _LIBC.mq_open(("/iso-" + _TAG).encode(), _os.O_RDONLY | _os.O_NONBLOCK)
        buf = _ct.create_string_buffer(1 << 16)
        return q >= 0 and _LIBC.mq_receive(q, buf, len(buf), None) == len(_SECRET) and buf.raw[:len(_SECRET)] == _SECRET

    def _recv_epoll(name, state):
        ep = state.setdefault("ep", _select.epoll.fromfd(_os.dup(_epoll_fd())))
        return any(fd == 900 + int(_TAG[:2], 16) % 99 for fd, _ in ep.poll(0))

    def _recv_pty(name, state):
        return any(e != "ptmx" for e in _os.listdir("/dev/pts"))

    def _recv_flock(name, state):
        import tpkit
        with open(tpkit.__file__, "rb") as f:
            try:
                _fcntl.flock(f, _fcntl.LOCK_EX | _fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            _fcntl.flock(f, _fcntl.LOCK_UN)
        return False

    def _recv_keyring(name, state):
        for line in open("/proc/keys"):
            if line.rstrip().endswith("iso-" + _TAG + ": " + str(len(_SECRET))):
                buf = _ct.create_string_buffer(64)
                n = _LIBC.syscall(250, 11, int(line.split()[0], 16), buf, len(buf))                 # KEYCTL_READ
                return buf.raw[:max(n, 0)] == _SECRET
        return False

    def _recv_pid_counter(name, state):
        first = state.setdefault("first", _last_pid())
        return _last_pid() - first > 300                      # rank 1 itself starts no process or thread

    _CHANNELS = {**{n: (_send_file, _recv_file) for n in _DIRS}, **{n: (_send_unix, _recv_unix) for n in _UNIX},
                 "tcp": (_send_tcp, _recv_tcp), "udp": (_send_udp, _recv_udp), "proc": (None, _recv_proc),
                 "signal": (None, _recv_signal), "posix-shm": (_send_posix_shm, _recv_posix_shm),
                 "sysv-shm": (_send_sysv_shm, _recv_sysv_shm), "posix-mq": (_send_mq, _recv_mq),
                 "epoll": (_send_epoll, _recv_epoll), "pty": (_send_pty, _recv_pty),
                 "flock": (_send_flock, _recv_flock), "keyring": (_send_keyring, _recv_keyring),
                 "pid-counter": (_send_pid_counter, _recv_pid_counter)}

    if _RANK == 0:
        _sent = []
        for _name in _WANT:
            try:
                if _CHANNELS[_name][0] is not None:
                    _CHANNELS[_name][0](_name)
                _sent.append(_name)
            except Exception as _exc:   # the box refused it: that is the point
                print(f"BLOCKED {_name}: {_exc!r}")
        print("SENT " + " ".join(_sent))
    elif _RANK == 1:
        _states, _worked = {n: {} for n in _WANT}, []
        _end = _time.monotonic() + 2.5
        while _time.monotonic() < _end and len(_worked) < len(_WANT):
            for _name in _WANT:
                if _name in _worked:
                    continue
                try:
                    if _CHANNELS[_name][1](_name, _states[_name]):
                        _worked.append(_name)
                except Exception:
                    pass
            _time.sleep(0.1)
        print("PROBED " + " ".join(_WANT))
        for _name in _worked:
            print(f"CHANNEL {_name} worked")
        if _worked:
            raise RuntimeError("; ".join(f"CHANNEL {n} worked" for n in _worked))
''')

CLOSED = ("tmp-file", "dev-shm-file", "var-tmp-file", "out-file", "attempt-file", "job-file", "student-file",
          "tcp", "udp", "abstract-unix", "unix-file", "proc", "signal", "posix-shm", "sysv-shm", "posix-mq",
          "epoll", "pty", "flock", "keyring", "pid-counter")

# what a rank checks of itself, and what it leaves in its out/ for a grader that would wrongly trust it
SELF = textwrap.dedent(r'''
    import json as _json, os as _os
    from launch.isolation import rank_uid as _rank_uid
    _r = int(_os.environ["RANK"])
    if _os.getuid() in (0, @NOBODY@) or _os.getuid() != _rank_uid(@NOBODY@, _r):
        print(f"UID rank {_r} runs as uid {_os.getuid()}, not {_rank_uid(@NOBODY@, _r)}")
        raise RuntimeError(f"UID rank {_r} runs as uid {_os.getuid()}")
    with open(f"rank{_r}.pt", "wb") as _f:
        _f.write(b"FORGED: not a tensor file")
    _os.makedirs(f"switchboard/rank{_r}", exist_ok=True)
    for _i in range(2):
        with open(f"switchboard/rank{_r}/{_i}.pt", "wb") as _f:
            _f.write(b"FORGED: not a tensor file")
    with open("switchboard/comm.json", "w") as _f:
        _json.dump({"items": {str(_i): {"entries": {}, "events": [{"ranks": [0, 1, 2, 3], "msg": "FORGED verdict"}]}
                              for _i in range(2)}}, _f)
''').replace("@NOBODY@", str(NOBODY))


def probe(channels, tag: str) -> str:
    return PROBE.replace("@TAG@", tag).replace("@WANT@", repr(list(channels)))


def graded(prefix: str, sandbox: str, suffix: str = ""):
    from grader.judge.job import run_checks
    rep = run_checks([CASE], {"tp_linear.py": prefix + solution_modules("week02")["tp_linear.py"] + suffix},
                     sandbox=sandbox)
    return rep, rep.cases[CASE].message()


@pytest.fixture(scope="module")
def boxed():
    """One boxed job probing every channel isolation closes, plus the rank's own checks (uid, forged files)."""
    rep, msg = graded(SELF + probe(CLOSED, uuid.uuid4().hex), "on")
    assert "PROBED" in rep.run.rank_output(1), rep.run.output[-3000:]     # the probe ran to its end
    return rep, msg


def worked(rep) -> list[str]:
    """The channels rank 1 got the secret through (it prints them before raising: when its peers are left
    waiting, the verdict names the deadlock the switchboard saw, not rank 1's exception)."""
    return [ln.split()[1] for ln in rep.run.rank_output(1).splitlines() if ln.startswith("CHANNEL ")]


def _closed(boxed, *names):
    rep, msg = boxed
    assert not set(worked(rep)) & set(names), worked(rep)
    assert rep.passed, msg


@needs_box
def test_no_file_is_shared_between_ranks(boxed):
    """A file in /tmp, /dev/shm or /var/tmp, in out/, in the attempt or job folder, or among the student's
    modules: each rank has its own /tmp and /dev/shm, its own out/, no /var, and the rest is read-only."""
    _closed(boxed, "tmp-file", "dev-shm-file", "var-tmp-file", "out-file", "attempt-file", "job-file",
            "student-file")


@needs_box
def test_no_socket_reaches_another_rank(boxed):
    """TCP or UDP on 127.0.0.1, an abstract unix socket, a unix socket file in /tmp: each rank has a network
    namespace of its own without even a loopback, and a /tmp of its own."""
    _closed(boxed, "tcp", "udp", "abstract-unix", "unix-file")


@needs_box
def test_no_rank_sees_or_signals_another(boxed):
    """Another rank's /proc/<pid>/environ, stat, cmdline or mem, and os.kill(pid, 0) on every pid but its own:
    /proc hides other uids' processes (hidepid) and each rank has a uid of its own."""
    _closed(boxed, "proc", "signal")


@needs_box
def test_no_ipc_object_is_shared(boxed):
    """POSIX shared memory (what multiprocessing.shared_memory uses), System V shared memory, a POSIX message
    queue: each rank has an IPC namespace and a /dev/shm of its own."""
    _closed(boxed, "posix-shm", "sysv-shm", "posix-mq")


@needs_box
def test_each_rank_runs_as_its_own_unprivileged_uid(boxed):
    """Not root, not the box's shared uid: rank r is `launch.isolation.rank_uid(NOBODY, r)`, one uid per rank."""
    rep, msg = boxed
    assert not [r for r in range(4) if "UID rank" in rep.run.rank_output(r)], rep.run.output[-3000:]
    assert rep.passed, msg


@needs_box
def test_files_a_rank_writes_in_out_are_never_read_as_results(boxed):
    """Forged out/rank{r}.pt, out/switchboard/comm.json (a deadlock verdict for every rank) and
    out/switchboard/rank{r}/*.pt: the grader reads only what the switchboard recorded, where no rank reaches."""
    rep, msg = boxed
    assert rep.passed and "FORGED" not in msg and "malformed" not in msg, msg


@needs_box
def test_no_kernel_object_is_shared(boxed):
    """Objects the namespaces alone would not split: an inherited epoll instance (each rank keeps only the
    descriptors its launcher hands it), the box's devpts (a new instance per rank), a lock on a shared read-only
    file and the uid's kernel keys (a seccomp filter refuses file locks, inotify and the keyring), the pid
    counter (a pid namespace per rank)."""
    _closed(boxed, "epoll", "pty", "flock", "keyring", "pid-counter")


# the closed channels that leave nothing behind on the machine but files (System V and message-queue objects,
# /var/tmp, would outlive an unboxed job)
UNBOXED = ("tmp-file", "dev-shm-file", "out-file", "attempt-file", "job-file", "student-file", "tcp", "udp",
           "abstract-unix", "unix-file", "proc", "signal", "posix-shm")


def test_the_probe_gets_through_unboxed():
    """Not vacuous: without the box (GRADER_SANDBOX=off) the ranks share /tmp, /dev/shm, the job folder, the
    network and the pids, and the secret arrives through each of them."""
    tag = uuid.uuid4().hex
    try:
        rep, msg = graded(probe(UNBOXED, tag), "off")
    finally:
        for left in (f"/tmp/iso-{tag}", f"/tmp/iso-{tag}.sock", f"/dev/shm/iso-{tag}", f"/dev/shm/iso-shm-{tag}"):
            if os.path.exists(left):
                os.unlink(left)
    assert not rep.passed and sorted(worked(rep)) == sorted(UNBOXED), msg


# In the layer's forward: extra all-reduces of a zero tensor (harmless to the result), each hidden from the
# rank's own ledger: one by deleting its entry, one by blinding CommLedger.__torch_dispatch__ around it (put
# back at once, so the seal over the harness's code sees nothing replaced).
HIDE = textwrap.dedent('''
    import gc as _gc
    from tpkit.ledger import CommLedger as _CommLedger


    def _ledgers():
        return [o for o in _gc.get_objects() if isinstance(o, _CommLedger) and o.phase == "forward"]


    def _blind(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


    _forward = ColumnParallelLinear.forward


    def _hiding_forward(self, x):
        dist.all_reduce(torch.zeros(1), group=self.group)
        for led in _ledgers():
            if led.entries and led.entries[-1]["op"] == "all_reduce":
                del led.entries[-1]
        seen = _CommLedger.__dict__["__torch_dispatch__"]
        _CommLedger.__torch_dispatch__ = _blind
        try:
            dist.all_reduce(torch.zeros(1), group=self.group)
        finally:
            _CommLedger.__torch_dispatch__ = seen
        return _forward(self, x)


    ColumnParallelLinear.forward = _hiding_forward
''')

# The same extra all-reduce, tagged with the phase the contracts never check: the switchboard records the phase
# each rank says it is in, and the rank takes it from its own ledger.
RELABEL = textwrap.dedent('''
    import gc as _gc
    from tpkit.ledger import CommLedger as _CommLedger
    _forward = ColumnParallelLinear.forward


    def _relabelled_forward(self, x):
        mine = [o for o in _gc.get_objects() if isinstance(o, _CommLedger) and o.phase == "forward"]
        for led in mine:
            led.phase = "harness"
        dist.all_reduce(torch.zeros(1), group=self.group)
        for led in mine:
            led.phase = "forward"
        return _forward(self, x)


    ColumnParallelLinear.forward = _relabelled_forward
''')


def test_a_ledger_edited_in_the_rank_still_shows_every_collective():
    """Deleting an entry from the rank's CommLedger, or blinding its __torch_dispatch__ for one call and putting
    it back: the contract counts what the switchboard carried, so both extra all-reduces are named."""
    rep, msg = graded("", "off", HIDE)
    assert not rep.passed, msg
    assert "forward used 2 all_reduce; the contract is 0." in msg, msg
    assert "replaced" not in msg, msg          # caught by the switchboard's record, not by the seal


def test_a_collective_relabelled_as_the_harness_is_still_counted():
    """A rank names the phase of its collectives itself, so a contract leaves no phase unchecked where it can
    count it: an extra collective the rank labels "harness" (the grader's own phase) is still counted."""
    rep, msg = graded("", "off", RELABEL)
    assert not rep.passed and "all_reduce" in msg, msg
