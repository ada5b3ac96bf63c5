"""A box honest code does not notice, and no channel between ranks reopened for it (launch/isolation.py,
grader/box/sandbox.py, grader/judge/inductor_seed.py).

Honest code in a grading rank (GRADER_SANDBOX=on, as root with bubblewrap: each rank alone) looks like code on any
machine: its uid has a name and a home (pwd, grp, getpass, `~`, tempfile), its own files take flock locks (filelock,
torch.compile's caches), and torch.compile with its default backend (inductor) compiles and gives the eager answer.
What the box still refuses fails with an errno that says so, and the verdict names it. And the ranks still cannot
meet: rank 0 tries to hand rank 1 a signal through every lock, watch and identity the box now has or refuses (a lock
on a file both can open, its own /tmp, /dev/shm and out/ paths, /proc/locks, the box's /etc/passwd, /dev/null,
record and OFD locks, inotify, dnotify, and flock through the 32-bit and x32 system call tables), and rank 1 raises
"CHANNEL <name> worked" if it arrives; unboxed, the same probe gets through (it is not vacuous).
"""
import json
import os
import shutil
import textwrap
import uuid

import pytest

from grader.tools.corpus import solution_modules

needs_box = pytest.mark.skipif(shutil.which("bwrap") is None or os.geteuid() != 0,
                               reason="needs bubblewrap and root (make test installs it; CI runs as root)")

CASE = "week02/column_parallel"

# Runs at import on every rank: what honest code asks of the machine, as one JSON line per rank. Ranks 0 and 1
# also compile with inductor (a matmul and two pointwise ops: a C++ kernel, so the CPU probe and the compiler run).
HONEST = textwrap.dedent(r'''
    import fcntl as _fcntl, getpass as _getpass, grp as _grp, json as _json, os as _os, pwd as _pwd
    import resource as _res, tempfile as _tempfile, threading as _th, time as _time
    _r = int(_os.environ["RANK"])
    _facts = {}

    def _fact(name, fn):
        try:
            _facts[name] = fn()
        except BaseException as e:     # noqa: BLE001  (every answer is a fact)
            _facts[name] = f"{type(e).__name__}: {e}"

    def _writes(folder):
        path = _os.path.join(folder, f"honest-{_r}.txt")
        with open(path, "w") as f:
            f.write("mine")
        return open(path).read() == "mine"

    def _lock_own(folder):
        """Two open files of one path: exclusive against each other, and a blocking lock waits for the release."""
        path = _os.path.join(folder, "honest.lock")
        a, b = open(path, "w"), open(path, "w")
        _fcntl.flock(a, _fcntl.LOCK_EX | _fcntl.LOCK_NB)
        try:
            _fcntl.flock(b, _fcntl.LOCK_EX | _fcntl.LOCK_NB)
            return "not exclusive"
        except BlockingIOError:
            pass
        _th.Timer(0.3, lambda: _fcntl.flock(a, _fcntl.LOCK_UN)).start()
        t0 = _time.monotonic()
        _fcntl.flock(b, _fcntl.LOCK_EX)                    # waits for a's release
        waited = _time.monotonic() - t0
        _fcntl.flock(b, _fcntl.LOCK_UN)
        a.close(), b.close()
        return "ok" if 0.2 < waited < 10 else f"waited {waited:.2f} s"

    def _filelock():
        import filelock
        lock = filelock.FileLock(_os.path.join(_tempfile.gettempdir(), "honest.filelock"), timeout=5)
        with lock:
            held = lock.is_locked
        return held and not lock.is_locked

    def _shared_lock():
        import tpkit
        with open(tpkit.__file__, "rb") as f:
            _fcntl.flock(f, _fcntl.LOCK_SH | _fcntl.LOCK_NB)
        return "locked a file every rank can open"

    def _record_lock():
        with open(_os.path.join(_tempfile.gettempdir(), "honest.lockf"), "w") as f:
            _fcntl.lockf(f, _fcntl.LOCK_EX | _fcntl.LOCK_NB)
        return "took a record lock"

    def _cpu():
        s, c = _res.getrusage(_res.RUSAGE_SELF), _res.getrusage(_res.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime

    def _compile():
        import torch
        t0, c0 = _time.perf_counter(), _cpu()
        f = torch.compile(lambda x, w: torch.relu(x @ w) * 2.0 + 1.0)
        x, w = torch.randn(8, 16), torch.randn(16, 4)
        y = f(x, w)
        first, cpu = _time.perf_counter() - t0, _cpu() - c0
        t1 = _time.perf_counter()
        y2 = f(x + 1, w)                                   # same shapes: the compiled code again, no compile
        again = _time.perf_counter() - t1
        cache = _os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
        return {"matches": bool(torch.allclose(y, torch.relu(x @ w) * 2.0 + 1.0, atol=1e-6)
                                and torch.allclose(y2, torch.relu((x + 1) @ w) * 2.0 + 1.0, atol=1e-6)),
                "first_s": round(first, 2), "first_cpu_s": round(cpu, 2), "again_s": round(again, 4), "cache": cache,
                "cached_files": sum(len(fs) for _, _, fs in _os.walk(cache))}

    def _arena():
        from launch.course_pg import link
        a = link().arena
        a.bytes[:4] = 7
        mapped = sorted({ln.split()[-2] for ln in open("/proc/self/maps") if "memfd:" in ln})
        return {"bytes": a.size, "wrote": int(a.bytes[3]), "mapped": mapped}

    _fact("uid", _os.getuid)
    _fact("arena", _arena)
    _fact("pw_name", lambda: _pwd.getpwuid(_os.getuid()).pw_name)
    _fact("pw_dir", lambda: _pwd.getpwuid(_os.getuid()).pw_dir)
    _fact("by_name", lambda: _pwd.getpwnam(f"rank{_r}").pw_uid)
    _fact("gr_name", lambda: _grp.getgrgid(_os.getgid()).gr_name)
    _fact("getuser", _getpass.getuser)
    _fact("home", lambda: _os.path.expanduser("~"))
    _fact("HOME", lambda: _os.environ.get("HOME"))
    _fact("cwd", _os.getcwd)
    _fact("tempdir", _tempfile.gettempdir)
    _fact("writes home", lambda: _writes(_os.path.expanduser("~")))
    _fact("writes tempdir", lambda: _writes(_tempfile.gettempdir()))
    for _name, _folder in (("tmp", "/tmp"), ("dev-shm", "/dev/shm"), ("home", _os.path.expanduser("~"))):
        _fact("lock " + _name, lambda: _lock_own(_folder))
    _fact("filelock", _filelock)
    _fact("job's seed", lambda: _os.listdir("../../inductor-seed"))      # the launcher's copy: root's, not a rank's
    _fact("lock shared", _shared_lock)
    _fact("record lock", _record_lock)
    if _r in (0, 1):
        _fact("compile", _compile)
    print("HONEST " + _json.dumps(_facts), flush=True)
''')

# Rank 0 opens each channel and keeps it ~3.5 s ("SENT ..."); rank 1 looks for 2.5 s and raises naming each one that
# carried rank 0's doing. @TAG@ and @WANT@ are filled in per job.
PROBE = textwrap.dedent(r'''
    import ctypes as _ct, fcntl as _fcntl, mmap as _mmap, os as _os, signal as _signal, struct as _struct
    import threading as _th, time as _time
    _RANK, _TAG, _WANT = int(_os.environ["RANK"]), "@TAG@", @WANT@
    _LIBC = _ct.CDLL(None, use_errno=True)
    _KEEP = []
    _ME = __file__                                              # the student's module: both ranks can read it
    _OWN = ["/tmp", "/dev/shm", "."]                            # a rank's own /tmp, /dev/shm and out/ when boxed

    def _shared():
        import tpkit
        return tpkit.__file__

    def _i386_flock():
        """flock through the 32-bit system call table (int 0x80): push rbx; eax=143; ebx=fd; ecx=op; int 0x80."""
        code = bytes([0x53, 0xB8, 0x8F, 0, 0, 0, 0x89, 0xFB, 0x89, 0xF1, 0xCD, 0x80, 0x5B, 0xC3])
        m = _mmap.mmap(-1, 4096, prot=_mmap.PROT_READ | _mmap.PROT_WRITE | _mmap.PROT_EXEC)
        m.write(code)
        _KEEP.append(m)
        call = _ct.CFUNCTYPE(_ct.c_int, _ct.c_int, _ct.c_int)(_ct.addressof(_ct.c_char.from_buffer(m)))
        pid = _os.fork()                                       # a kernel without 32-bit calls kills the caller
        if pid == 0:
            call(-1, 0)
            _os._exit(0)
        if _os.waitpid(pid, 0)[1] != 0:
            raise OSError(38, "this kernel runs no 32-bit system call")
        return call

    def _flock_with(name):
        if name == "flock-i386":
            call = _i386_flock()
            return lambda fd, op: call(fd, op)
        if name == "flock-x32":
            return lambda fd, op: _LIBC.syscall(0x40000000 | 73, fd, op) and -_ct.get_errno()
        return lambda fd, op: _fcntl.flock(fd, op) or 0

    def _path(name):
        """A file every rank can open, one per channel of a kind (flock and record locks never meet on Linux)."""
        import grader, launch
        return {"flock-passwd": "/etc/passwd", "flock-devnull": "/dev/null", "flock-i386": launch.__file__,
                "flock-x32": grader.__file__, "ofd-lock": launch.__file__}.get(name) or _shared()

    _FL = "hhqqi4x"                                              # struct flock on x86-64

    # -- rank 0's side ----------------------------------------------------------------------------------------
    def _send_flock(name):
        lock = _flock_with(name)
        f = open(_path(name), "r+b" if name == "flock-devnull" else "rb")
        ret = lock(f.fileno(), _fcntl.LOCK_EX | _fcntl.LOCK_NB)
        if ret:
            raise OSError(-ret, _os.strerror(-ret))
        _KEEP.append(f)

    def _send_record(name):
        f = open(_path(name), "rb")
        _fcntl.fcntl(f, 37 if name == "ofd-lock" else _fcntl.F_SETLK, _struct.pack(_FL, _fcntl.F_RDLCK, 0, 0, 0, 0))
        _KEEP.append(f)

    def _send_reads(name):
        def read():
            end = _time.monotonic() + 3.5
            while _time.monotonic() < end:
                with open(_ME, "rb") as f:
                    f.read(64)
                _time.sleep(0.02)
        _th.Thread(target=read, daemon=True).start()

    def _send_proc_locks(name):
        files = [open(f"/tmp/iso-many-{_TAG}-{i}", "w") for i in range(30)]
        _fcntl.flock(files[0], _fcntl.LOCK_EX)                  # raises here if the box refuses even these
        _fcntl.flock(files[0], _fcntl.LOCK_UN)
        def toggle():                                          # 30 more locks from +1 s to +2 s
            _time.sleep(1.0)
            for f in files:
                _fcntl.flock(f, _fcntl.LOCK_EX)
            _time.sleep(1.0)
            for f in files:
                _fcntl.flock(f, _fcntl.LOCK_UN)
        _th.Thread(target=toggle, daemon=True).start()
        _KEEP.extend(files)

    def _send_own(name):
        for folder in _OWN:
            f = open(_os.path.join(folder, f"iso-own-{_TAG}.lock"), "w")
            _fcntl.flock(f, _fcntl.LOCK_EX | _fcntl.LOCK_NB)
            _KEEP.append(f)

    # -- rank 1's side: True when rank 0's doing is seen -------------------------------------------------------
    def _recv_flock(name, state):
        lock = state.setdefault("lock", _flock_with(name))
        with open(_path(name), "r+b" if name == "flock-devnull" else "rb") as f:
            ret = lock(f.fileno(), _fcntl.LOCK_EX | _fcntl.LOCK_NB)
            if ret == 0:
                lock(f.fileno(), _fcntl.LOCK_UN)
            return ret == -11                                  # EWOULDBLOCK: rank 0 holds it

    def _recv_flock_py(name, state):                           # fcntl.flock raises BlockingIOError instead
        try:
            return _recv_flock(name, state)
        except BlockingIOError:
            return True

    def _recv_record(name, state):
        with open(_path(name), "rb") as f:
            got = _fcntl.fcntl(f, 36 if name == "ofd-lock" else _fcntl.F_GETLK,
                               _struct.pack(_FL, _fcntl.F_WRLCK, 0, 0, 0, 0))
        return _struct.unpack(_FL, got)[0] != _fcntl.F_UNLCK

    def _recv_inotify(name, state):
        if "fd" not in state:
            fd = _LIBC.inotify_init1(0o4000)                   # IN_NONBLOCK
            if fd < 0 or _LIBC.inotify_add_watch(fd, _ME.encode(), 1) < 0:     # IN_ACCESS
                raise OSError(_ct.get_errno(), "inotify")
            state["fd"] = fd
        try:
            return len(_os.read(state["fd"], 4096)) > 0
        except BlockingIOError:
            return False

    def _recv_dnotify(name, state):
        if "seen" not in state:
            state["seen"] = []
            _signal.signal(_signal.SIGIO, lambda *_: state["seen"].append(1))
            fd = _os.open(_os.path.dirname(_ME), _os.O_RDONLY)
            _fcntl.fcntl(fd, 1026, 1 | -0x80000000)             # F_NOTIFY, DN_ACCESS | DN_MULTISHOT
            state["fd"] = fd
        return bool(state["seen"])

    def _recv_proc_locks(name, state):
        seen = state.setdefault("seen", [])
        seen.append(sum(1 for _ in open("/proc/locks")))
        return max(seen) - min(seen) >= 20

    def _recv_own(name, state):
        for folder in _OWN:
            with open(_os.path.join(folder, f"iso-own-{_TAG}.lock"), "w") as f:
                try:
                    _fcntl.flock(f, _fcntl.LOCK_EX | _fcntl.LOCK_NB)
                except BlockingIOError:
                    return True
        return False

    _CHANNELS = {"flock-shared": (_send_flock, _recv_flock_py), "flock-passwd": (_send_flock, _recv_flock_py),
                 "flock-devnull": (_send_flock, _recv_flock_py), "flock-i386": (_send_flock, _recv_flock),
                 "flock-x32": (_send_flock, _recv_flock), "posix-lock": (_send_record, _recv_record),
                 "ofd-lock": (_send_record, _recv_record), "inotify": (_send_reads, _recv_inotify),
                 "dnotify": (_send_reads, _recv_dnotify), "proc-locks": (_send_proc_locks, _recv_proc_locks),
                 "own-lock-paths": (_send_own, _recv_own)}

    if _RANK == 0:
        _sent = []
        for _name in _WANT:
            try:
                _CHANNELS[_name][0](_name)
                _sent.append(_name)
            except Exception as _exc:   # the box refused it: that is the point
                print(f"BLOCKED {_name}: {_exc!r}")
        print("SENT " + " ".join(_sent))
        _time.sleep(0.2)               # everything held before rank 1 stops looking
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
                except Exception as _exc:
                    if not _states[_name].get("said"):
                        print(f"REFUSED {_name}: {_exc!r}")
                    _states[_name]["said"] = True
            _time.sleep(0.1)
        print("PROBED " + " ".join(_WANT))
        for _name in _worked:
            print(f"CHANNEL {_name} worked")
        if _worked:
            raise RuntimeError("; ".join(f"CHANNEL {n} worked" for n in _worked))
''')

CLOSED = ("flock-shared", "flock-passwd", "flock-devnull", "flock-i386", "flock-x32", "posix-lock", "ofd-lock",
          "inotify", "dnotify", "proc-locks", "own-lock-paths")
# what the probe gets through without a box: every channel but x32's system calls (most kernels have none), and the
# 32-bit ones only where the kernel runs them
UNBOXED = tuple(c for c in CLOSED if c != "flock-x32")


def graded(prefix: str, sandbox: str):
    from grader.judge.job import run_checks
    rep = run_checks([CASE], {"tp_linear.py": prefix + solution_modules("week02")["tp_linear.py"]}, sandbox=sandbox)
    return rep, rep.cases[CASE].message()


def probe(channels, tag: str) -> str:
    return PROBE.replace("@TAG@", tag).replace("@WANT@", repr(list(channels)))


def worked(rep) -> list[str]:
    return [ln.split()[1] for ln in rep.run.rank_output(1).splitlines() if ln.startswith("CHANNEL ")]


@pytest.fixture(scope="module")
def honest():
    """One boxed job whose module, at import on every rank, asks what honest code asks; {rank: facts}."""
    rep, msg = graded(HONEST, "on")
    facts = {}
    for r in range(4):
        line = next((ln for ln in rep.run.rank_output(r).splitlines() if ln.startswith("HONEST ")), None)
        assert line, rep.run.output[-3000:]
        facts[r] = json.loads(line[len("HONEST "):])
    return rep, msg, facts


@needs_box
def test_a_rank_has_a_name_and_a_home_of_its_own(honest):
    """pwd, grp, getpass, `~`, HOME and tempfile answer as on any machine, and point into the rank's own space: its
    out/ (home and working folder, a tmpfs of its own) and its own /tmp."""
    from grader.box.sandbox import NOBODY
    from launch.isolation import rank_uid
    rep, msg, facts = honest
    assert rep.passed, msg
    for r, f in facts.items():
        assert f["uid"] == rank_uid(NOBODY, r) and f["by_name"] == f["uid"], f
        assert f["pw_name"] == f["getuser"] == f["gr_name"] == f"rank{r}", f
        assert f["pw_dir"] == f["home"] == f["HOME"] == f["cwd"], f
        assert f["cwd"].endswith("/out") and f["tempdir"] == "/tmp", f
        assert f["writes home"] is True and f["writes tempdir"] is True, f


@needs_box
def test_a_rank_maps_its_own_arena_and_no_other(honest):
    """The shared memory a rank's large payloads go through (launch.wire.Arena) maps and takes writes in the box;
    no other rank's is mapped there."""
    from launch.wire import ARENA_BYTES
    rep, msg, facts = honest
    for r, f in facts.items():
        assert f["arena"] == {"bytes": ARENA_BYTES, "wrote": 7, "mapped": [f"/memfd:rank{r}"]}, f


@needs_box
def test_a_rank_locks_its_own_files(honest):
    """flock on a rank's own files (its /tmp, /dev/shm, home): exclusive, and a blocking lock waits for the release;
    filelock (what torch.compile's caches use) takes and releases its lock."""
    rep, msg, facts = honest
    for f in facts.values():
        assert [f["lock tmp"], f["lock dev-shm"], f["lock home"], f["filelock"]] == ["ok", "ok", "ok", True], f


@needs_box
def test_what_the_box_refuses_says_so(honest):
    """A lock on a file every rank can open, and any record lock: refused with an errno nothing else gives these
    calls (launch.isolation.REFUSED), so the traceback shows that the box refused it."""
    rep, msg, facts = honest
    for f in facts.values():
        assert f["lock shared"] == "OSError: [Errno 70] Communication error on send", f
        assert f["record lock"] == "OSError: [Errno 56] Invalid request code", f


@needs_box
def test_torch_compile_runs_in_a_rank_and_matches_eager(honest):
    """torch.compile with inductor (a C++ kernel: the CPU probe, the compiler, the fx graph and kernel caches behind
    flock) compiles in a rank, in the rank's own /tmp, and gives the eager answer; the second call compiles nothing."""
    rep, msg, facts = honest
    for r in (0, 1):
        got = facts[r]["compile"]
        assert isinstance(got, dict) and got["matches"], got
        assert got["cache"] == f"/tmp/torchinductor_rank{r}" and got["cached_files"] > 0, got
        assert got["again_s"] < 0.5, got
        assert facts[r]["job's seed"].startswith("PermissionError"), facts[r]      # each rank has its own copy
        print(f"rank {r}: first compile {got['first_s']} s ({got['first_cpu_s']} s of CPU), then {got['again_s']} s")


@needs_box
def test_the_verdict_names_what_the_box_refused():
    """A module that locks a file every rank can open: the verdict says the grading box refused it, and why."""
    rep, msg = graded("import fcntl, tpkit\nfcntl.flock(open(tpkit.__file__), fcntl.LOCK_EX)\n", "on")
    assert not rep.passed
    assert "the grading box refused flock on a file other ranks can open" in msg, msg
    assert "a grading rank may lock only its own files" in msg and "[Errno 70]" in msg, msg


@needs_box
def test_no_lock_watch_or_name_carries_a_signal_between_ranks():
    """Every lock, watch and identity the box has or refuses: nothing rank 0 does reaches rank 1, and a correct
    solution carrying the probe still passes."""
    rep, msg = graded(probe(CLOSED, uuid.uuid4().hex), "on")
    assert "PROBED" in rep.run.rank_output(1), rep.run.output[-3000:]
    assert not worked(rep), worked(rep)
    assert rep.passed, msg
    said = {ln.split()[1].rstrip(":"): ln for r in (0, 1) for ln in rep.run.rank_output(r).splitlines()
            if ln.startswith(("BLOCKED ", "REFUSED "))}
    errnos = {"flock-shared": 70, "flock-passwd": 70, "flock-devnull": 70, "posix-lock": 56, "ofd-lock": 56,
              "inotify": 69, "dnotify": 69, "flock-i386": 38, "flock-x32": 38}    # 38: ENOSYS, not x86-64's table
    for name, code in errnos.items():                      # each refused by the box, with the errno that says so
        assert f"({code}," in said.get(name, ""), (name, said)
    sent = next(ln for ln in rep.run.rank_output(0).splitlines() if ln.startswith("SENT")).split()[1:]
    assert {"own-lock-paths", "proc-locks"} <= set(sent) and not {"own-lock-paths", "proc-locks"} & set(said), said


def test_the_lock_probe_gets_through_unboxed():
    """Not vacuous: without the box the ranks share the files, the locks and the watches, and rank 0's signal
    reaches rank 1 through each of them."""
    tag = uuid.uuid4().hex
    try:
        rep, msg = graded(probe(UNBOXED, tag), "off")
    finally:
        for folder in ("/tmp", "/dev/shm"):
            for name in os.listdir(folder):
                if tag in name:
                    os.unlink(os.path.join(folder, name))
    sent = next(ln for ln in rep.run.rank_output(0).splitlines() if ln.startswith("SENT")).split()[1:]
    assert set(sent) >= set(UNBOXED) - {"flock-i386"}, rep.run.rank_output(0)    # a kernel may run no 32-bit call
    assert not rep.passed and sorted(worked(rep)) == sorted(sent), (worked(rep), rep.run.output[-3000:])
