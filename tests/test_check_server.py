"""The check server (grader/tools/check_server.py): a lab's second `python -m grader check` is served by a warm
trusted process with the verdicts a check of its own gets, and nothing of the server stays once it stops."""
import os
import re
import subprocess
import sys
import time
import uuid

import pytest

from grader.tools import check_server
from launch.runner import is_alive
from tests.procs import descendants, processes_naming

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOLUTION = "solutions/week02/tp_linear.ipynb"
STUB = "labs/week02/tp_linear.ipynb"


def _env(**extra) -> dict:
    # a variable of the grader's own set, unique to this test: a server no other check (or user) shares
    return {**os.environ, "GRADER_CHECK_SERVER": "on", "COURSE_TEST_SERVER": uuid.uuid4().hex, **extra}


def _check(notebook: str, env: dict, execute: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grader", "check", notebook, *([] if execute else ["--no-execute"])],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _verdicts(out: str) -> list[str]:
    """Each grade cell's points and the score: what must not depend on where the check ran."""
    return [line for line in out.splitlines() if re.match(r"^(\w+: [\d.]+/[\d.]+|score: )", line)]


def _held(server: int) -> tuple[list[str], list[int]]:
    """What `server` holds for the next check: its launchers' job folders and its kernels' processes."""
    mine = descendants(server)
    return _held_jobs_of(mine), sorted(p for p, args in mine.items() if any("ipykernel_launcher" in a for a in args))


def _held_jobs_of(procs: dict) -> list[str]:
    """The job folders of these processes' launchers (a launcher's command line names its attempt folder)."""
    return sorted({os.path.dirname(a) for args in procs.values() for a in args
                   if re.search(r"/grader-job-\w+/attempt0$", a)})


def _alive(pids) -> list[int]:
    return [p for p in pids if is_alive(p)]


def _until(cond, timeout: float):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.2)
    return cond()


# `check-server --stop` stops every server of this user: the tests that start one run on one worker, one by one
@pytest.mark.xdist_group("check_server")
def test_a_second_check_is_served_warm_with_the_same_verdicts_and_nothing_stays():
    env = _env()
    sock = check_server.address(env)
    cold = _check(SOLUTION, env)
    assert cold.returncode == 0 and "starts cold" in cold.stdout, cold.stdout + cold.stderr
    try:
        assert _until(lambda: os.path.exists(sock) and processes_naming(sock), 60), "no server came up"
        [server] = processes_naming(f"--socket\0{sock}")
        assert _until(lambda: all(_held(server)), 60), "the server started nothing for the next check"
        [job], kernels = _held(server)
        warm = _check(SOLUTION, env, execute=True)
        assert warm.returncode == 0 and "starts cold" not in warm.stdout, warm.stdout + warm.stderr
        assert _verdicts(warm.stdout) == _verdicts(cold.stdout) and _verdicts(cold.stdout)[-1] == "score: 8/8"
        assert _until(lambda: not os.path.exists(job) and not _alive(kernels), 10), "held job or kernel not used"
        # the stub: another notebook of the same lab, served with the verdicts and messages a local check prints
        served = _check(STUB, env)
        local = _check(STUB, {**env, "GRADER_CHECK_SERVER": "off"})
        assert served.returncode == local.returncode == 1 and "starts cold" not in served.stdout
        assert _verdicts(served.stdout) == _verdicts(local.stdout)
        assert "NotImplementedError" in served.stdout
        assert _until(lambda: all(_held(server)), 60)
        left = descendants(server)
    finally:
        stop = subprocess.run([sys.executable, "-m", "grader", "check-server", "--stop"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
    assert stop.returncode == 0 and "stopped" in stop.stdout
    assert _until(lambda: not _alive([server]) and not os.path.exists(sock), 30), "the server is still up"
    assert _until(lambda: not _alive(left), 10), f"left running: {[left[p] for p in _alive(left)]}"
    assert not any(os.path.exists(job) for job in _held_jobs_of(left))


@pytest.mark.xdist_group("check_server")
def test_an_idle_server_exits_and_gives_back_what_it_held():
    env = _env()
    sock = check_server.address(env)
    server = subprocess.Popen([sys.executable, "-m", "grader", "check-server", "--socket", sock, "--notebook",
                               os.path.join(ROOT, SOLUTION), "--idle", "3"], cwd=ROOT, env=env)
    try:
        assert _until(lambda: all(_held(server.pid)), 60), "the server started nothing for the next check"
        left = descendants(server.pid)
        assert server.wait(timeout=60) == 0
    finally:
        server.kill()
    assert not os.path.exists(sock)
    assert _until(lambda: not _alive(left), 10), f"left running: {[left[p] for p in _alive(left)]}"
    assert not any(os.path.exists(job) for job in _held_jobs_of(left))


def test_each_environment_has_its_own_server_and_a_bad_setting_is_named(monkeypatch):
    monkeypatch.setenv("GRADER_SANDBOX", "auto")
    one = check_server.address()
    monkeypatch.setenv("GRADER_SANDBOX", "off")
    assert check_server.address() != one
    monkeypatch.setenv("TERM", "something-else")      # not read by the grader: the same server
    monkeypatch.setenv("GRADER_SANDBOX", "auto")
    assert check_server.address() == one
    bad = _check(SOLUTION, {**os.environ, "GRADER_CHECK_SERVER": "maybe"})
    assert bad.returncode == 2 and "GRADER_CHECK_SERVER='maybe' is unknown: use on (the default) or off" in bad.stdout
