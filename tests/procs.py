"""Processes a test starts (a test file's own rank program on N ranks) or looks for in /proc: by what their command
line names, and by who started them."""
import os

from launch.runner import is_alive


def every_rank_says_ok(test_file: str, nproc: int, timeout: float):
    """Run `test_file` as a script on `nproc` local ranks (gloo, the fork launcher): each rank prints "ok" at the end
    of its checks, so a rank that failed or stopped early fails the test with every rank's output."""
    from launch import run
    res = run(os.path.abspath(test_file), nproc, module=False, launcher="fork", timeout=timeout)
    assert res.ok, res.output
    for r in range(nproc):
        assert "ok" in res.rank_output(r), res.output


def processes_naming(text: str) -> list[int]:
    """Live processes (not zombies) whose command line contains `text`."""
    return [pid for pid, args in _command_lines().items() if text.encode() in args and is_alive(pid)]


def descendants(root: int) -> dict[int, list[str]]:
    """{pid: command line} of every process `root` started, and theirs."""
    parent = {}
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent[pid] = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            pass
    found = {}
    for pid in parent:
        up = pid
        while up in parent and up not in (root, 0, 1):
            up = parent[up]
        if up == root and pid != root:
            found[pid] = os.fsdecode(_command_lines([pid]).get(pid, b"")).split("\0")
    return found


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _command_lines(pids=None) -> dict[int, bytes]:
    out = {}
    for pid in _pids() if pids is None else pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out[pid] = f.read()
        except OSError:
            pass
    return out
