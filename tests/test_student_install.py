"""A class's students hold a student install (no answer in it) and are graded by the trusted grading service
(grader/tools/grading_service.py): `python -m grader check` and `check()` there send the notebook or the modules to
its socket and print its answer."""
import glob
import grp
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time

import pytest

from grader.tools.grading_service import NEVER, student_install

# one worker runs them all: the services are started once, and the last test counts what the services left
pytestmark = pytest.mark.xdist_group("student_install")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOLUTION = os.path.join(ROOT, "solutions/week02/tp_linear.ipynb")
STUB = os.path.join(ROOT, "labs/week02/tp_linear.ipynb")


def _norm(text: str) -> list[str]:
    """The lines that carry code: stripped, no blanks, comments, imports or decorators."""
    return [ln.strip() for ln in text.splitlines()
            if ln.strip() and not ln.strip().startswith(("#", "import ", "from ", "@"))]


def _windows(lines: list[str], n: int) -> set[str]:
    return {"\n".join(lines[i:i + n]) for i in range(len(lines) - n + 1)}


def _text(path: str) -> str:
    with open(path, errors="replace") as f:
        text = f.read()
    if path.endswith(".ipynb"):
        text = "\n".join("".join(c["source"]) for c in json.loads(text)["cells"])
    return "\n".join(_norm(text))


def _solution_blocks() -> list[tuple[str, str, list[str]]]:
    """(notebook, the %%writefile module's text, each SOLUTION block's code lines) of every lab's solution."""
    out = []
    for nb in sorted(glob.glob(os.path.join(ROOT, "solutions/*/*.ipynb"))):
        with open(nb) as f:
            cells = json.load(f)["cells"]
        for cell in cells:
            src = "".join(cell["source"])
            if src.startswith("%%writefile"):
                for m in re.finditer(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", src, re.S):
                    out.append((os.path.relpath(nb, ROOT), src.split("\n", 1)[1], _norm(m.group(1))))
    return out


@pytest.fixture(scope="module")
def install(tmp_path_factory) -> str:
    dest = str(tmp_path_factory.mktemp("student") / "course")
    r = subprocess.run([sys.executable, "-m", "grader", "student-install", dest], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "wrote a student install" in r.stdout, r.stdout + r.stderr
    with pytest.raises(ValueError, match="not empty"):
        student_install(dest)
    return dest


def _student_env(install: str, **extra) -> dict:
    """A student's python: the install and the installed packages (torch), not the course root. `-S` drops the
    venv's .pth files, whose editable finder would map `grader` to the course root."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COURSE_", "GRADER_"))}
    env["PYTHONPATH"] = os.pathsep.join([install, sysconfig.get_paths()["purelib"]])
    return {**env, **extra}


def _student(install: str, args: list[str], cwd: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-S", *args], cwd=cwd, env=_student_env(install, **env),
                          capture_output=True, text=True, timeout=120)


def test_the_install_holds_no_answer(install):
    for rel in NEVER:
        assert not os.path.exists(os.path.join(install, rel)), rel
    assert sorted(os.listdir(os.path.join(install, "grader"))) == ["__init__.py", "__main__.py", "rank"]
    assert not glob.glob(os.path.join(install, "grader/rank/week*.py"))     # week06.py holds week 5's answer
    files = {os.path.relpath(os.path.join(top, f), install): os.path.join(top, f)
             for top, _, fs in os.walk(install) for f in fs}
    assert "labs/week02/tp_linear.ipynb" in files and "tpkit/selfcheck.py" in files
    texts = {rel: _text(path) for rel, path in files.items()}
    released = "\n\n".join(_text(p) for p in glob.glob(os.path.join(ROOT, "labs/*/*.ipynb")))
    found = set()
    for nb, module, lines in _solution_blocks():
        assert not any(module.strip() in open(p, errors="replace").read() for p in files.values()), nb
        # three code lines in a row of a solution that the released lab does not give away
        for w in _windows(lines, 3) | ({"\n".join(lines)} if 0 < len(lines) < 3 else set()):
            if w not in released:
                found |= {(rel, nb) for rel, text in texts.items() if w in text}
    assert not found, f"a lab's answer in the student install: {sorted(found)}"
    for path in glob.glob(os.path.join(ROOT, "reference/**/*.py"), recursive=True):
        with open(path) as f:
            ref = {w for w in _windows(_norm(f.read()), 4) if w not in released}
        hits = [(rel, w) for w in ref for rel, text in texts.items() if w in text]
        assert not hits, f"{os.path.relpath(path, ROOT)}'s code in the student install: {hits[:3]}"


def test_without_a_service_the_student_install_says_how_to_get_one(install, tmp_path):
    shutil.copy(STUB, tmp_path / "tp_linear.ipynb")
    r = _student(install, ["-m", "grader", "check", "tp_linear.ipynb"], cwd=str(tmp_path))
    assert r.returncode == 2 and "COURSE_GRADING_SERVICE" in r.stderr and "instructor" in r.stderr, r.stdout + r.stderr
    (tmp_path / "tp_linear.py").write_text("x = 1\n")
    r = _student(install, ["-c", "from tpkit import check; check('week02/column_parallel')"], cwd=str(tmp_path))
    assert r.returncode == 1 and "RuntimeError" in r.stderr and "COURSE_GRADING_SERVICE" in r.stderr, r.stderr


def _start_service(where, name: str, *args) -> tuple[subprocess.Popen, str, str]:
    sock, log = str(where / f"{name}.sock"), str(where / f"{name}.log")
    if os.environ.get("GRADER_SANDBOX") == "off":    # a machine without bubblewrap, unboxed on purpose
        args = (*args, "--allow-unboxed")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "grader", "grading-service", "--socket", sock, *args],
                                cwd=ROOT, stdout=out, stderr=out, start_new_session=True)
    return proc, sock, log


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    """The class's service, and one whose checks may take 2 s (started together: their imports overlap)."""
    where = tmp_path_factory.mktemp("service")
    os.chmod(where, 0o750)
    group = grp.getgrgid(os.getgid()).gr_name
    started = [_start_service(where, "grading", "--max-checks", "2", "--group", group),
               _start_service(where, "short", "--timeout", "2")]
    try:
        deadline = time.monotonic() + 90
        for proc, sock, log in started:
            while not os.path.exists(sock) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert os.path.exists(sock), open(log).read()
        yield [(sock, log) for _, sock, log in started]
    finally:
        for proc, _, _ in started:
            proc.terminate()
        for proc, _, _ in started:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
    assert not any(os.path.exists(sock) for _, sock, _ in started)


@pytest.fixture(scope="module")
def service(services):
    return services[0]


def _raw(sock: str, data: bytes) -> list[dict]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.settimeout(30)
        c.connect(sock)
        try:
            c.sendall(data)
        except OSError:
            pass
        return [json.loads(line) for line in c.makefile("rb")]


def test_the_service_socket_is_the_groups_and_refuses_paths_and_malformed_requests(service):
    sock, log = service
    st = os.stat(sock)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == os.getgid()
    [answer] = _raw(sock, json.dumps({"notebook": SOLUTION}).encode() + b"\n")
    assert "reads none of your files" in answer["error"], answer
    [answer] = _raw(sock, json.dumps({"notebook": {"cells": []}, "cwd": "/home/ana"}).encode() + b"\n")
    assert "not a path" in answer["error"], answer
    [answer] = _raw(sock, b"{not json\n")
    assert "not JSON" in answer["error"], answer
    [answer] = _raw(sock, json.dumps({"checks": "week02/column_parallel"}).encode() + b"\n")
    assert '"checks" must be a list' in answer["error"], answer
    [answer] = _raw(sock, json.dumps({"notebook": {"cells": []}, "name": "../x.ipynb"}).encode() + b"\n")
    assert "plain notebook file name" in answer["error"], answer
    [answer] = _raw(sock, b"x" * ((4 << 20) + 10))
    assert "larger than 4 MiB" in answer["error"], answer
    # one check at a time per uid: a connection that has not sent its request yet holds this uid's turn
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as first:
        first.connect(sock)
        first.sendall(b'{"checks": ')
        time.sleep(0.3)
        [answer] = _raw(sock, json.dumps({"checks": ["week02/column_parallel"], "modules": {}}).encode() + b"\n")
        assert "one at a time" in answer["error"], answer
    # a kernel's check() may name the released labs' checks only: a hidden one is not run for it
    answer = _raw(sock, json.dumps({"checks": ["week02/column_parallel_hidden"], "modules": {"tp_linear.py": ""}})
                  .encode() + b"\n")
    assert answer[-1] == {"exit": 2, "score": None} and "no check named" in answer[0]["text"], answer
    assert "week02/column_parallel," in answer[0]["text"] and "_hidden" not in answer[0]["text"].split("Known")[1]
    with open(log) as f:
        assert re.search(rf"uid {os.getuid()}\b.*refused: the grading service reads none", f.read())


def test_a_student_install_is_graded_by_the_service(install, service, tmp_path):
    sock, log = service
    home = tmp_path / "ana"
    home.mkdir()
    shutil.copy(SOLUTION, home / "solution.ipynb")
    shutil.copy(STUB, home / "tp_linear.ipynb")
    r = _student(install, ["-c", "import torch, tpkit, launch, grader.rank.exchange\nimport grader.judge"],
                 cwd=str(home))
    assert "No module named 'grader.judge'" in r.stderr, r.stderr
    t0 = time.monotonic()
    good = _student(install, ["-m", "grader", "check", "solution.ipynb", "--no-execute"], cwd=str(home),
                    COURSE_GRADING_SERVICE=sock)
    served_s = time.monotonic() - t0
    assert good.returncode == 0 and good.stdout.rstrip().endswith("score: 8/8"), good.stdout + good.stderr
    bad = _student(install, ["-m", "grader", "check", "tp_linear.ipynb", "--no-execute"], cwd=str(home),
                   COURSE_GRADING_SERVICE=sock)
    assert bad.returncode == 1 and bad.stdout.rstrip().endswith("score: 0/8"), bad.stdout + bad.stderr
    assert "NotImplementedError" in bad.stdout
    # a kernel's check(): the modules its %%writefile cells wrote go to the service
    with open(SOLUTION) as f:
        cell = next("".join(c["source"]) for c in json.load(f)["cells"]
                    if "".join(c["source"]).startswith("%%writefile tp_linear.py"))
    (home / "tp_linear.py").write_text(cell.split("\n", 1)[1])
    r = _student(install, ["-c", "from tpkit import check; check('week02/column_parallel')"], cwd=str(home),
                 COURSE_GRADING_SERVICE=sock)
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr
    print(f"served check (week02 solution, --no-execute): {served_s:.1f} s")
    with open(log) as f:
        assert re.search(rf"uid {os.getuid()}\b.*solution\.ipynb: exit 0, score 8/8", f.read())


def test_a_check_past_its_time_is_stopped_and_leaves_nothing(install, services, tmp_path):
    sock, log = services[1]
    shutil.copy(SOLUTION, tmp_path / "tp_linear.ipynb")
    r = _student(install, ["-m", "grader", "check", "tp_linear.ipynb"], cwd=str(tmp_path), COURSE_GRADING_SERVICE=sock)
    assert r.returncode == 2 and "ran past the grading service's 2 s limit" in r.stderr, r.stdout + r.stderr
    with open(log) as f:
        assert re.search(r"tp_linear\.ipynb: stopped after 2 s", f.read())
    server = int(re.search(r"grading-service\[(\d+)\] serving", open(log).read()).group(1))

    def left() -> list[str]:
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split()[4] for line in f if "/grading-service-" in line]
        children = [p for p in os.listdir("/proc") if p.isdigit() and _parent(p) == server]
        return mounts + children + glob.glob(os.path.join(tempfile.gettempdir(), "grading-service-*"))

    deadline = time.monotonic() + 10
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left()


def _parent(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
