"""JupyterHub for the course on one machine (started as root by grader/hub/start.py, `make hub`).

PAM accounts log in; LocalProcessSpawner starts each one's Jupyter server as that account from the shared venv
(`$HUB_PREFIX/venv`, `make hub-deps`), with that venv first on PATH (kernels and terminals), nbgrader's exchange
from HUB_EXCHANGE, and a home of mode 0700. The instructor's server also gets the course root on PYTHONPATH and
the formgrader; a student's has the Assignments tab only. When a server stops (by hand, or its own idle limit),
that account's check servers are stopped with it (`python -m grader check-server --stop`). The hub also runs
the class's grading service as the instructor (a managed service): students' checks are graded there. See start.py for the
settings and docs/instructor.md (JupyterHub) for the whole setup.
"""
import os
import pwd
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from start import settings  # noqa: E402

S = settings()
c = get_config()  # noqa: F821

c.JupyterHub.ip = S.ip
c.JupyterHub.port = S.port
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = S.hub_port
c.ConfigurableHTTPProxy.command = [S.proxy]
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{S.proxy_api_port}"
c.JupyterHub.db_url = f"sqlite:///{os.path.join(S.state, 'jupyterhub.sqlite')}"
c.JupyterHub.cookie_secret_file = os.path.join(S.state, "jupyterhub_cookie_secret")

c.JupyterHub.authenticator_class = "pam"
c.Authenticator.allow_all = True                 # every local (PAM) account of this machine may log in
c.Authenticator.admin_users = {S.instructor}
c.PAMAuthenticator.open_sessions = False

c.JupyterHub.spawner_class = "localprocess"
c.Spawner.cmd = [os.path.join(S.venv, "bin", "jupyterhub-singleuser")]
c.Spawner.default_url = "/lab"
c.Spawner.notebook_dir = "~"
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120
c.Spawner.env_keep = ["LANG", "LC_ALL"]           # not the hub's PATH, PYTHONPATH or VIRTUAL_ENV (root's)
c.Spawner.environment = {
    "PATH": S.path,                              # the shared venv first: jupyter, nbgrader, python -m grader
    "COURSE_EXCHANGE_ROOT": S.exchange,          # read by the shared venv's etc/jupyter/nbgrader_config.py
    "OMP_NUM_THREADS": "1",
    "MPLBACKEND": "module://matplotlib_inline.backend_inline",
}
# the server's own idle limit: idle kernels are culled, then the server exits (and post_stop_hook runs)
c.Spawner.args = [
    f"--ServerApp.shutdown_no_activity_timeout={S.idle_s}",
    f"--MappingKernelManager.cull_idle_timeout={S.idle_s}",
    "--MappingKernelManager.cull_interval=300",
]


def pre_spawn_hook(spawner):
    """A private home; for the instructor, the course on PYTHONPATH and the formgrader's config folder."""
    name = spawner.user.name
    os.chmod(pwd.getpwnam(name).pw_dir, 0o700)   # no account reads another's fetched or edited labs
    # the class's group: may connect to the grading service's socket (its new server starts with the group)
    subprocess.run(["gpasswd", "-a", name, S.group], capture_output=True)
    if name == S.instructor:
        spawner.environment.update(PYTHONPATH=S.course, JUPYTER_CONFIG_PATH=S.instructor_config)
    else:   # the student install has no grader: check() and `python -m grader check` ask the grading service
        spawner.environment["COURSE_GRADING_SERVICE"] = S.grading_socket


def post_stop_hook(spawner):
    """Stop the account's check servers (grader/tools/check_server.py) with its Jupyter server."""
    name = spawner.user.name
    env = {"PATH": S.path, "HOME": pwd.getpwnam(name).pw_dir, "LANG": "C.UTF-8"}
    if name == S.instructor:
        env["PYTHONPATH"] = S.course
    try:
        out = subprocess.run([shutil.which("runuser") or "/usr/sbin/runuser", "-u", name, "--", os.path.join(S.venv, "bin", "python"), "-m", "grader",
                              "check-server", "--stop"], env=env, cwd="/", capture_output=True, text=True, timeout=30)
        spawner.log.info("check servers of %s: %s", name, (out.stdout + out.stderr).strip()[-300:])
    except (OSError, subprocess.SubprocessError) as e:
        spawner.log.warning("could not stop the check servers of %s: %s", name, e)


c.Spawner.pre_spawn_hook = pre_spawn_hook
c.Spawner.post_stop_hook = post_stop_hook

# the class's trusted grading service (grader/tools/grading_service.py), as the instructor, from the course root:
# it grades students' check() and `python -m grader check` sent to its socket
c.JupyterHub.services = [{
    "name": "grading", "user": S.instructor, "cwd": S.course,
    "command": [os.path.join(S.venv, "bin", "python"), "-m", "grader", "grading-service",
                "--socket", S.grading_socket, "--group", S.group],
    "environment": {"PATH": S.path, "PYTHONPATH": S.course, "OMP_NUM_THREADS": "1", "LANG": "C.UTF-8"},
}]

if S.service_token:   # scripts and tests/test_hub.py drive the hub through its REST API with this service
    c.JupyterHub.services.append({"name": "course-admin", "api_token": S.service_token})
    c.JupyterHub.load_roles = [{"name": "course-admin", "services": ["course-admin"], "scopes": [
        "admin:users", "admin:servers", "tokens", "list:users", "read:users"]}]
