"""The course on a real JupyterHub (grader/hub/, `make hub-deps`), on a loopback port, with real accounts.

Two students and an instructor are made with useradd (removed at the end), the hub is started by
grader/hub/start.py, and everything goes through the hub's REST API with tokens and then each user's own Jupyter
server (its kernels, contents and nbgrader's Assignments-tab API), each running as that account:

- the hub's grading service (run as the instructor) grades a student's `python -m grader check`;
- the instructor releases week02 (nbgrader generate_assignment, release_assignment) from a kernel;
- each student fetches it through the Assignments tab's API; one fills the `%%writefile` cells with
  solutions/week02/tp_linear.ipynb's, the other leaves the stub; both submit;
- the instructor collects, autogrades, generates feedback and exports: 8 and 0 of the lab's 8 points;
- the stub's student cannot read the other's fetched or submitted notebook, the course's solutions/, reference/
  or gradebook, nor list the exchange's inbound, and no hub token is in its kernel's environment;
- stopping a server stops that account's check servers (the post-stop hook).

Needs root (useradd, the hub), the shared venv and configurable-http-proxy (`make hub-deps`); skips otherwise.
"""
from __future__ import annotations

import asyncio
import csv
import datetime
import glob
import io
import json
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

import pytest

from grader import ROOT

pytestmark = pytest.mark.xdist_group("hub")   # one hub, its accounts and ports, on one xdist worker
from grader.hub.start import settings  # noqa: E402

WEEK, LAB = "week02", "tp_linear.ipynb"
S = settings()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "the hub test makes accounts and starts the hub as root (run the tests as root, as CI does)"
    for tool in ("useradd", "userdel", "runuser"):
        if not shutil.which(tool):
            return f"no {tool} here"
    for path, what in ((os.path.join(S.venv, "bin", "jupyterhub"), "jupyterhub in the shared venv"),
                       (S.proxy, "configurable-http-proxy")):
        if not os.access(path, os.X_OK):
            return f"{what} is not installed ({path}): run `make hub-deps` (pip jupyterhub, npm configurable-http-proxy)"
    return None


class Hub:
    """A hub started by grader/hub/start.py; REST calls with tokens; code run in a user's kernel."""

    def __init__(self, port: int, service_token: str):
        self.url = f"http://127.0.0.1:{port}"
        self.service = service_token
        self.tokens: dict[str, str] = {}
        self.kernels: dict[str, str] = {}

    def api(self, method: str, path: str, token: str, body=None, form=None, timeout: float = 120):
        data = (json.dumps(body).encode() if body is not None else
                urllib.parse.urlencode(form).encode() if form is not None else
                b"" if method in ("POST", "PUT") else None)
        headers = {"Authorization": f"token {token}"}
        if form is not None:
            headers["Content-Type"] = "application/x-www-form-urlencoded"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                text = r.read()
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{method} {path}: HTTP {e.code}: {e.read()[:2000]!r}") from None
        return json.loads(text) if text.strip() else None

    def add_user(self, name: str):
        try:
            self.api("POST", f"/hub/api/users/{name}", self.service)
        except AssertionError as e:   # the instructor, an admin, is in the hub's database from its start
            assert "HTTP 409" in str(e), e
        self.tokens[name] = self.api("POST", f"/hub/api/users/{name}/tokens", self.service,
                                     body={"note": "tests/test_hub.py", "expires_in": 3600})["token"]

    def start_servers(self, names, seconds: float = 180):
        """POST /hub/api/users/<u>/server with each user's own token, all at once; wait until all are ready."""
        for name in names:
            self.api("POST", f"/hub/api/users/{name}/server", self.tokens[name])
        waiting, deadline = set(names), time.monotonic() + seconds
        while waiting and time.monotonic() < deadline:
            for name in list(waiting):
                server = (self.api("GET", f"/hub/api/users/{name}", self.service).get("servers") or {}).get("", {})
                if server.get("ready"):
                    waiting.discard(name)
            time.sleep(0.3)
        assert not waiting, f"servers not ready after {seconds} s: {sorted(waiting)}"

    def user(self, method: str, name: str, path: str, **kw):
        return self.api(method, f"/user/{name}/{path.lstrip('/')}", self.tokens[name], **kw)

    def run(self, name: str, code: str, seconds: float = 600) -> str:
        """Run `code` in `name`'s kernel (started on first use); return its output; fail on an error."""
        if name not in self.kernels:
            self.kernels[name] = self.user("POST", name, "api/kernels", body={"name": "python3"})["id"]
        ws_url = self.url.replace("http", "ws", 1) + f"/user/{name}/api/kernels/{self.kernels[name]}/channels"
        out, err = asyncio.run(_execute(ws_url, self.tokens[name], code, seconds))
        assert err is None, f"{name}'s kernel raised:\n{err}\n{out}"
        return out

    def sh(self, name: str, cmd: str, cwd: str = "~") -> str:
        """A shell command as `name`, from their kernel, as they would type it in a terminal."""
        out = self.run(name, "import os, subprocess\n"
                             f"r = subprocess.run({cmd!r}, shell=True, cwd=os.path.expanduser({cwd!r}), "
                             "capture_output=True, text=True)\n"
                             "print(r.stdout[-6000:]); print(r.stderr[-6000:]); print('EXIT', r.returncode)")
        assert out.rstrip().endswith("EXIT 0"), f"{name}: `{cmd}` failed:\n{out[-8000:]}"
        return out


async def _execute(ws_url: str, token: str, code: str, seconds: float):
    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect
    ws = await websocket_connect(HTTPRequest(ws_url, headers={"Authorization": f"token {token}"}))
    msg_id = uuid.uuid4().hex
    ws.write_message(json.dumps({
        "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "test", "session": uuid.uuid4().hex,
                   "version": "5.3", "date": datetime.datetime.now(datetime.timezone.utc).isoformat()},
        "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
        "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                    "allow_stdin": False, "stop_on_error": True}}))
    out, err, replied, idle = [], None, False, False
    deadline = time.monotonic() + seconds
    try:
        while not (replied and idle):
            raw = await asyncio.wait_for(ws.read_message(), max(1.0, deadline - time.monotonic()))
            if raw is None:
                raise AssertionError("the kernel's websocket closed")
            if isinstance(raw, bytes):
                continue
            msg = json.loads(raw)
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = msg["header"]["msg_type"]
            if kind == "stream":
                out.append(msg["content"]["text"])
            elif kind == "error":
                err = "\n".join(msg["content"]["traceback"])
            elif kind == "execute_reply":
                replied = True
            elif kind == "status" and msg["content"]["execution_state"] == "idle":
                idle = True
    finally:
        ws.close()
    return "".join(out), err


def _kill_user_processes(name: str):
    """SIGKILL what the test's own accounts still run, each by its pid (their servers, kernels, check servers)."""
    ps = subprocess.run(["ps", "-o", "pid=", "-u", name], capture_output=True, text=True)
    for pid in ps.stdout.split():
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError):
            pass


@pytest.fixture(scope="module")
def hub():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    sfx = secrets.token_hex(3)
    names = {"instructor": f"tpi{sfx}", "ana": f"tpa{sfx}", "ben": f"tpb{sfx}"}
    tmp = tempfile.mkdtemp(prefix="hub-")
    os.chmod(tmp, 0o755)
    made, proc = [], None
    log = open(os.path.join(tmp, "hub.log"), "w+")
    try:
        for name in names.values():
            subprocess.run(["useradd", "-m", "-s", "/bin/bash", name], check=True, capture_output=True)
            made.append(name)
        port, token = _free_port(), secrets.token_hex(32)
        env = dict(os.environ, HUB_INSTRUCTOR=names["instructor"], HUB_IP="127.0.0.1", HUB_PORT=str(port),
                   HUB_API_PORT=str(_free_port()), HUB_PROXY_API_PORT=str(_free_port()),
                   HUB_EXCHANGE=os.path.join(tmp, "exchange"), HUB_STATE=os.path.join(tmp, "state"),
                   HUB_INSTRUCTOR_CONFIG=os.path.join(tmp, "instructor"), HUB_SERVICE_TOKEN=token,
                   HUB_GROUP=f"tpg{sfx}", HUB_GRADING_DIR=os.path.join(tmp, "grading"))
        env.pop("HUB_COURSE", None)
        env.pop("PYTHONPATH", None)
        proc = subprocess.Popen([os.path.join(S.venv, "bin", "python"), os.path.join(ROOT, "grader", "hub", "start.py")],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        h = Hub(port, token)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(h.url + "/hub/api/", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise AssertionError(f"the hub did not start:\n{log.read()[-4000:]}")
                time.sleep(0.3)
        h.names, h.tmp, h.exchange, h.log = names, tmp, env["HUB_EXCHANGE"], log
        h.course = os.path.join(os.path.expanduser(f"~{names['instructor']}"), "course")
        yield h
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
        for name in made:
            _kill_user_processes(name)
            subprocess.run(["userdel", "-r", "-f", name], capture_output=True)
        subprocess.run(["groupdel", f"tpg{sfx}"], capture_output=True)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _fill_solution(nb: dict) -> int:
    """Put solutions/WEEK/LAB's %%writefile cells into the student's notebook, by nbgrader cell id."""
    with open(os.path.join(ROOT, "solutions", WEEK, LAB)) as f:
        sol = {c["metadata"]["nbgrader"]["grade_id"]: c["source"] for c in json.load(f)["cells"]
               if c.get("metadata", {}).get("nbgrader", {}).get("grade_id") and
               "".join(c["source"]).startswith("%%writefile")}
    n = 0
    for cell in nb["cells"]:
        gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
        if gid in sol:
            cell["source"], n = sol[gid], n + 1
    return n


def test_start_refuses_a_course_root_the_formgrader_cannot_serve():
    """The formgrader serves a course root only inside the instructor's Jupyter root (their home): start.py says
    so before it starts a hub whose formgrader would answer every request with an error."""
    from types import SimpleNamespace
    from grader.hub.start import check_course_placement
    me = pwd.getpwuid(os.getuid())
    check_course_placement(SimpleNamespace(instructor=me.pw_name, course=os.path.join(me.pw_dir, "course")))
    beside = os.path.join(os.path.dirname(os.path.realpath(me.pw_dir)), "elsewhere-course")
    for outside in (beside, me.pw_dir):
        with pytest.raises(SystemExit, match="not a folder inside .* home"):
            check_course_placement(SimpleNamespace(instructor=me.pw_name, course=outside))


class TestHubClass:
    """One assignment through the hub, as its three accounts would do it in the browser and a terminal."""

    def test_class_flow_grades_and_isolation(self, hub):
        start = last = [time.monotonic()]
        start = start[0]

        def lap(what):   # each step's seconds (pytest -s shows them)
            now = time.monotonic()
            print(f"hub test: {what}: {now - last[0]:.1f} s", flush=True)
            last[0] = now

        inst, ana, ben = hub.names["instructor"], hub.names["ana"], hub.names["ben"]
        for name in (inst, ana, ben):
            hub.add_user(name)
        hub.start_servers((inst, ana, ben))
        lap("servers")
        # the instructor releases week02 from the course root (a terminal's commands, here from a kernel)
        out = hub.sh(inst, f"nbgrader generate_assignment {WEEK} --force && nbgrader release_assignment {WEEK} --force",
                     cwd="~/course")
        assert "Released as" in out or "Release" in out, out
        # the formgrader: the instructor's server has it, a student's does not
        assert hub.user("GET", inst, "formgrader/api/assignments") is not None
        with pytest.raises(AssertionError, match="HTTP 404"):
            hub.user("GET", ana, "formgrader/api/assignments")

        # the students: the Assignments tab's API (fetch), the contents API (edit), submit
        for name in (ana, ben):
            listed = hub.user("GET", name, "assignments?course_id=tp-course")
            assert any(a["assignment_id"] == WEEK for a in listed["value"]), listed
            hub.user("POST", name, "assignments/fetch", form={"course_id": "tp-course", "assignment_id": WEEK})
        model = hub.user("GET", ana, f"api/contents/{WEEK}/{LAB}?content=1")
        assert _fill_solution(model["content"]) >= 2
        hub.user("PUT", ana, f"api/contents/{WEEK}/{LAB}",
                 body={"type": "notebook", "format": "json", "content": model["content"]})
        lap("release+fetch+edit")
        # a student's check: the student install has no grader, the hub's grading service (the instructor's) grades
        out = hub.sh(ana, f"python -m grader check {WEEK}/{LAB} --no-execute")
        assert "score: 8/8" in out, out[-3000:]
        lap("student check")
        for name in (ana, ben):
            listed = hub.user("POST", name, "assignments/submit", form={"course_id": "tp-course", "assignment_id": WEEK})
            assert listed.get("success", True), listed
        inbound = os.path.join(hub.exchange, "tp-course", "inbound")
        ana_submitted = glob.glob(os.path.join(inbound, f"{ana}+{WEEK}+*", LAB))
        assert ana_submitted, os.listdir(inbound)

        # the other student sees none of it, nor the course's private files, nor a hub token
        private = {
            os.path.join(os.path.expanduser(f"~{ana}"), WEEK, LAB): "file",
            ana_submitted[0]: "file",
            inbound: "dir",
            os.path.join(hub.course, "solutions", WEEK, LAB): "file",
            os.path.join(hub.course, "reference"): "dir",
            os.path.join(hub.course, "nbgrader_config.py"): "file",
            os.path.join(hub.course, "grader", "cases"): "dir",
        }
        assert not os.path.exists(os.path.join(S.venv, "course", "reference"))
        assert not os.path.exists(os.path.join(S.venv, "course", "grader", "cases"))
        for path in private:
            assert os.path.exists(path), path
        probe = ("import json, os\nres = {}\n"
                 f"for p, kind in {private!r}.items():\n"
                 "    try:\n"
                 "        os.listdir(p) if kind == 'dir' else open(p, 'rb').read(1)\n"
                 "        res[p] = 'readable'\n"
                 "    except PermissionError:\n"
                 "        res[p] = 'denied'\n"
                 "print(json.dumps({'paths': res, 'env': dict(os.environ)}))")
        seen = json.loads(hub.run(ben, probe).strip().splitlines()[-1])
        assert not [p for p, v in seen["paths"].items() if v != "denied"], seen["paths"]
        env = seen["env"]
        leaked = [k for k in env if k.startswith(("JUPYTERHUB_", "JPY_")) or "TOKEN" in k.upper()]
        assert not leaked, f"hub variables in a student's kernel: {leaked}"
        tokens = [hub.service, *hub.tokens.values()]
        assert not [k for k, v in env.items() if any(t in v for t in tokens)], "a hub token in the kernel's environment"
        assert env["PATH"].startswith(os.path.join(S.venv, "bin")), env["PATH"]

        lap("submit+isolation")
        # the instructor collects, autogrades, returns feedback and exports
        out = hub.sh(inst, f"nbgrader collect {WEEK} && nbgrader autograde {WEEK} --force && "
                           f"nbgrader generate_feedback {WEEK} --force && nbgrader export --to grades.csv "
                           "&& echo GRADES && cat grades.csv", cwd="~/course")
        grades = {r["student_id"]: r for r in csv.DictReader(io.StringIO(out.split("GRADES\n", 1)[1].split("\nEXIT")[0]
                                                                        .strip()))}
        got = {s: (float(grades[s]["score"]), float(grades[s]["max_score"])) for s in (ana, ben)}
        assert got == {ana: (8.0, 8.0), ben: (0.0, 8.0)}, (got, out[-4000:])
        gradebook = os.path.join(hub.course, "gradebook.db")
        assert os.path.exists(gradebook) and os.path.isdir(os.path.join(hub.course, "feedback"))
        seen = json.loads(hub.run(ben, probe.replace(repr(private), repr(
            {gradebook: "file", os.path.join(hub.course, "submitted", ana, WEEK, LAB): "file"}))).strip().splitlines()[-1])
        assert not [p for p, v in seen["paths"].items() if v != "denied"], seen["paths"]

        lap("collect..export")
        # a check from the instructor's terminal leaves a check server; stopping the Jupyter server stops it
        hub.sh(inst, f"python -m grader check labs/{WEEK}/{LAB} --no-execute || test $? = 1", cwd="~/course")
        socks = os.path.join("/tmp", f"course-grader-{pwd.getpwnam(inst).pw_uid}")
        deadline = time.monotonic() + 60     # it starts after the check, in the background
        while not glob.glob(os.path.join(socks, "*.sock")) and time.monotonic() < deadline:
            time.sleep(0.3)
        assert glob.glob(os.path.join(socks, "*.sock")), "no check server was left by the check"
        hub.api("DELETE", f"/hub/api/users/{inst}/server", hub.tokens[inst])
        deadline = time.monotonic() + 60
        while (hub.api("GET", f"/hub/api/users/{inst}", hub.service).get("servers") or {}) and \
                time.monotonic() < deadline:
            time.sleep(0.3)
        time.sleep(1)
        hub.log.flush()
        hub.log.seek(0)
        log = hub.log.read()
        assert f"check servers of {inst}: stopped 1" in log, f"the post-stop hook did not run:\n{log[-3000:]}"
        assert not glob.glob(os.path.join(socks, "*.sock")), "a check server outlived its Jupyter server"
        lap("check server stop")
        print(f"the class flow on the hub took {time.monotonic() - start:.1f} s")
