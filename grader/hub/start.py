"""Start the course's JupyterHub on this machine, and install what it needs (run as root).

    python grader/hub/start.py                   start the hub (`make hub`): grader/hub/jupyterhub_config.py
    python grader/hub/start.py --install-config  (`make hub-deps`) the shared venv's Jupyter and nbgrader config
    python grader/hub/start.py --install-course  (`make hub-deps`) the student install of the course

The hub (PAM accounts, LocalProcessSpawner) starts each user's Jupyter server from the **shared venv**
`$HUB_PREFIX/venv`, built by `make hub-deps` with a system Python every account can run (`/usr/bin/python3`; a
venv on a Python under /root would be unreadable to students). In that venv:

- `course/`, on its `sys.path` through a `.pth` file: the student install (`labs/`, `tpkit/`, `launch/`,
  `grader/`), never `reference/`, `solutions/` or a gradebook;
- `etc/jupyter/nbgrader_config.py`: nbgrader's `Exchange.root` for every user (`$COURSE_EXCHANGE_ROOT`, which the
  hub sets from `HUB_EXCHANGE`; nbgrader 0.9.6's own default is /usr/local/share/nbgrader/exchange);
  and `ExchangeFactory.submit` (`grader/hub/exchange.py`, installed as `tp_course_exchange`: a submission readable by the instructor's group only);
- `etc/jupyter/jupyter_server_config.d/nbgrader.json`: the Assignments tab (assignment_list, course_list,
  validate_assignment) on, the formgrader off; the instructor's server turns it on from `$HUB_PREFIX/instructor`;
- `etc/jupyter/jupyter_server_config.py`: terminals start `bash -i` (not a login shell, which would reset `PATH`
  from /etc/profile) without the hub's tokens in their environment;
- `share/jupyter/kernels/python3`: the kernel, started without any `JUPYTERHUB_*`/`JPY_*` variable or one whose
  name holds `TOKEN` (the user's server has its hub API token in its environment; a kernel does not need it).

On start, the instructor's course root (`HUB_COURSE`, default `~instructor/course`) is made from this repository
when it does not exist yet, owned by the instructor, in a home of mode 0700: only the instructor (and root) can
read `solutions/`, `reference/`, `submitted/` and `gradebook.db`. The exchange is made mode 1777 (nbgrader's
inbound folder then keeps one student's submission from another).

Settings (environment, defaults in brackets): HUB_PREFIX [/opt/tp-course], HUB_INSTRUCTOR [instructor],
HUB_COURSE [~instructor/course], HUB_EXCHANGE [/usr/local/share/nbgrader/exchange], HUB_IP [all interfaces],
HUB_PORT [8000], HUB_API_PORT [8081, the hub's own], HUB_PROXY_API_PORT [8001], HUB_STATE [$HUB_PREFIX/state: the
hub's database and cookie secret], HUB_GROUP [tp-course: every hub account joins it on its first server start; the grading service's socket is
0660 in that group], HUB_GRADING_DIR [$HUB_PREFIX/grading: the grading service's socket folder, the instructor's],
HUB_INSTRUCTOR_CONFIG [$HUB_PREFIX/instructor: the instructor's extra Jupyter config folder], HUB_IDLE_S [3600: a user's server shuts itself down after this long idle, and
its check servers are stopped with it], HUB_SERVICE_TOKEN [none: when set, a `course-admin` service with this
token may manage users, servers and tokens through the REST API; tests/test_hub.py uses it].
"""
from __future__ import annotations

import json
import os
import pwd
import shutil
import sys
import sysconfig
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
CONFIG = os.path.join(HERE, "jupyterhub_config.py")
DEFAULT_EXCHANGE = "/usr/local/share/nbgrader/exchange"      # nbgrader 0.9.6's Exchange.root default
SECRET_PREFIXES = ("JUPYTERHUB_", "JPY_")
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "CREDENTIAL")
# the kernel: its environment without the hub's variables, then ipykernel as usual
KERNEL_BOOT = ("import os, runpy, sys\n"
               "for k in list(os.environ):\n"
               f"    if k.startswith({SECRET_PREFIXES!r}) or any(w in k.upper() for w in {SECRET_WORDS!r}):\n"
               "        del os.environ[k]\n"
               "sys.argv = ['ipykernel_launcher'] + sys.argv[1:]\n"
               "runpy.run_module('ipykernel_launcher', run_name='__main__', alter_sys=True)\n")
HUB_ENV_UNSET = ("JUPYTERHUB_API_TOKEN", "JPY_API_TOKEN", "JUPYTERHUB_OAUTH_ACCESS_SCOPES")


def settings() -> SimpleNamespace:
    """The hub's settings, from the environment (see the module docstring)."""
    env = os.environ.get
    prefix = env("HUB_PREFIX", "/opt/tp-course")
    instructor = env("HUB_INSTRUCTOR", "instructor")
    try:
        home = pwd.getpwnam(instructor).pw_dir
    except KeyError:
        home = f"/home/{instructor}"
    venv = os.path.join(prefix, "venv")
    return SimpleNamespace(
        prefix=prefix, venv=venv, instructor=instructor,
        course=env("HUB_COURSE", os.path.join(home, "course")),
        exchange=env("HUB_EXCHANGE", DEFAULT_EXCHANGE),
        ip=env("HUB_IP", ""), port=int(env("HUB_PORT", "8000")),
        hub_port=int(env("HUB_API_PORT", "8081")), proxy_api_port=int(env("HUB_PROXY_API_PORT", "8001")),
        state=env("HUB_STATE", os.path.join(prefix, "state")),
        idle_s=int(env("HUB_IDLE_S", "3600")),
        service_token=env("HUB_SERVICE_TOKEN", ""),
        proxy=os.path.join(prefix, "proxy", "node_modules", ".bin", "configurable-http-proxy"),
        instructor_config=env("HUB_INSTRUCTOR_CONFIG", os.path.join(prefix, "instructor")),
        path=f"{venv}/bin:/usr/local/bin:/usr/bin:/bin",
        group=env("HUB_GROUP", "tp-course"),
        grading_socket=os.path.join(env("HUB_GRADING_DIR", os.path.join(prefix, "grading")), "grading.sock"),
    )


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o644)


def install_config(s: SimpleNamespace) -> None:
    """Write the shared venv's config (run with the shared venv's python, by `make hub-deps`)."""
    etc = os.path.join(sys.prefix, "etc", "jupyter")
    _write(os.path.join(etc, "nbgrader_config.py"),
           '"""Every user of the hub: the course\'s nbgrader exchange (written by grader/hub/start.py)."""\n'
           "import os\n\nc = get_config()  # noqa: F821\n"
           f'c.Exchange.root = os.environ.get("COURSE_EXCHANGE_ROOT", "{DEFAULT_EXCHANGE}")\n'
           'c.CourseDirectory.course_id = "tp-course"\n'
           "# a submission readable by the instructor's group only, not by every account that knows its name\n"
           'c.ExchangeFactory.submit = "tp_course_exchange.PrivateSubmit"\n')
    _write(os.path.join(etc, "jupyter_server_config.d", "nbgrader.json"), json.dumps({"ServerApp": {
        "jpserver_extensions": {"nbgrader.server_extensions.formgrader": False,
                                "nbgrader.server_extensions.assignment_list": True,
                                "nbgrader.server_extensions.course_list": True,
                                "nbgrader.server_extensions.validate_assignment": True}}}, indent=2) + "\n")
    unset = [a for k in HUB_ENV_UNSET for a in ("-u", k)]
    _write(os.path.join(etc, "jupyter_server_config.py"),
           '"""The hub\'s users (grader/hub/start.py): terminals keep the spawner\'s PATH and get no hub token."""\n'
           "c = get_config()  # noqa: F821\n"
           f"c.ServerApp.terminado_settings = {{'shell_command': {['/usr/bin/env', *unset, '/bin/bash', '-i']!r}}}\n")
    kernel = os.path.join(sys.prefix, "share", "jupyter", "kernels", "python3")
    _write(os.path.join(kernel, "kernel.json"), json.dumps({
        "argv": [os.path.join(sys.prefix, "bin", "python"), "-c", KERNEL_BOOT, "-f", "{connection_file}"],
        "display_name": "Python 3 (course)", "language": "python",
        "env": {"PATH": f"{sys.prefix}/bin:/usr/local/bin:/usr/bin:/bin"},
        "metadata": {"debugger": True}}, indent=2) + "\n")
    # the labextension's formgrader and create-assignment menus: off for everyone, on for the instructor (below)
    for page in ("labconfig", ):
        _write(os.path.join(etc, page, "page_config.json"), json.dumps({"disabledExtensions": {
            "@jupyter/nbgrader:formgrader": True, "@jupyter/nbgrader:create-assignment": True}}, indent=2) + "\n")
    print(f"wrote the shared config under {etc} and the kernel {kernel}")


def install_course(s: SimpleNamespace) -> None:
    """Copy the student install into the shared venv and put it on the venv's path."""
    dest = os.path.join(sys.prefix, "course")
    sys.path.insert(0, REPO)
    from grader.tools.grading_service import student_install   # labs, tpkit, launch, the rank entry; no answer
    student_install(dest, force=True)
    # grader/hub/exchange.py as a top-level module: a student install has no grader/hub
    shutil.copy(os.path.join(HERE, "exchange.py"), os.path.join(dest, "tp_course_exchange.py"))
    _write(os.path.join(sysconfig.get_path("purelib"), "tp_course_student.pth"), dest + "\n")
    for d, dirs, files in os.walk(dest):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)
    print(f"student install: {dest} ({', '.join(sorted(os.listdir(dest)))})")


def instructor_config(s: SimpleNamespace) -> None:
    """The instructor's extra config folder (JUPYTER_CONFIG_PATH of their server): formgrader on, this course."""
    d = s.instructor_config
    _write(os.path.join(d, "jupyter_server_config.d", "formgrader.json"), json.dumps({"ServerApp": {
        "jpserver_extensions": {"nbgrader.server_extensions.formgrader": True}}}, indent=2) + "\n")
    _write(os.path.join(d, "labconfig", "page_config.json"), json.dumps({"disabledExtensions": {
        "@jupyter/nbgrader:formgrader": False, "@jupyter/nbgrader:create-assignment": False}}, indent=2) + "\n")
    _write(os.path.join(d, "nbgrader_config.py"),
           '"""The instructor\'s server (formgrader): the course\'s own nbgrader config."""\n'
           f"load_subconfig({os.path.join(s.course, 'nbgrader_config.py')!r})  # noqa: F821\n")
    os.chmod(d, 0o755)


def check_course_placement(s: SimpleNamespace) -> None:
    """The formgrader serves a course root only inside the Jupyter server's root (`c.Spawner.notebook_dir`: the
    instructor's home): outside it, nbgrader logs "The course directory root is not a subdirectory of the notebook
    server root" and answers every formgrader request with an error."""
    home = os.path.realpath(pwd.getpwnam(s.instructor).pw_dir)
    course = os.path.realpath(s.course)
    if course == home or os.path.commonpath([home, course]) != home:
        sys.exit(f"start.py: HUB_COURSE={s.course} is not a folder inside {s.instructor}'s home {home}, the "
                 f"root of their Jupyter server: the formgrader would answer every request with an error. Put the "
                 f"course inside it (default {os.path.join(home, 'course')}) or unset HUB_COURSE.")


def make_course(s: SimpleNamespace) -> None:
    """The instructor's course root, copied from this repository if it is not there yet; private to them."""
    pw = pwd.getpwnam(s.instructor)
    os.chmod(pw.pw_dir, 0o700)
    if not os.path.exists(s.course):
        shutil.copytree(REPO, s.course, symlinks=True, ignore=shutil.ignore_patterns(
            ".venv", ".git", "build", "__pycache__", "*.egg-info", ".pytest_cache", "submitted", "autograded",
            "feedback", "gradebook.db", ".ipynb_checkpoints"))
        for d, dirs, files in os.walk(s.course):
            for name in [d, *(os.path.join(d, f) for f in files)]:
                os.lchown(name, pw.pw_uid, pw.pw_gid)
        print(f"course root for {s.instructor}: {s.course}")


def grading_service_folder(s: SimpleNamespace) -> None:
    """The class's group (every account that uses the hub joins it on its first start, the instructor now) and the
    grading service's socket folder: the instructor's, writable by them only (the service refuses any other)."""
    import grp
    import subprocess
    try:
        grp.getgrnam(s.group)
    except KeyError:
        subprocess.run(["groupadd", s.group], check=True)
    subprocess.run(["gpasswd", "-a", s.instructor, s.group], check=True, capture_output=True)
    pw = pwd.getpwnam(s.instructor)
    folder = os.path.dirname(s.grading_socket)
    os.makedirs(folder, exist_ok=True)
    os.chown(folder, pw.pw_uid, grp.getgrnam(s.group).gr_gid)
    os.chmod(folder, 0o750)       # the class reaches the socket; no one but the instructor can replace it


def main(argv: list[str]) -> None:
    s = settings()
    if "--install-config" in argv:
        return install_config(s)
    if "--install-course" in argv:
        return install_course(s)
    if os.geteuid() != 0:
        sys.exit("start.py: run the hub as root (it starts each user's server as that user)")
    hub = os.path.join(s.venv, "bin", "jupyterhub")
    for need in (hub, s.proxy):
        if not os.access(need, os.X_OK):
            sys.exit(f"start.py: {need} is missing: run `make hub-deps`")
    try:
        pwd.getpwnam(s.instructor)
    except KeyError:
        sys.exit(f"start.py: no account {s.instructor!r} (HUB_INSTRUCTOR): useradd -m {s.instructor}")
    check_course_placement(s)
    os.makedirs(s.exchange, exist_ok=True)
    os.chmod(s.exchange, 0o1777)
    os.makedirs(s.state, mode=0o700, exist_ok=True)
    os.chmod(s.state, 0o700)
    make_course(s)
    instructor_config(s)
    grading_service_folder(s)
    os.chdir(s.state)
    os.execv(hub, [hub, "-f", CONFIG])


if __name__ == "__main__":
    main(sys.argv[1:])
