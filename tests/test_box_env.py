"""What of the grader's environment reaches a box, and what GRADER_SANDBOX=on does when the box lacks a part.

Grading runs two kinds of box (grader/box/sandbox.py): the kernel that executes the submitted notebook and the
grading ranks. Both start from an allowlist of variables (`clean_env`) that never passes a name that could carry a
secret (a JupyterHub token, a cloud key) or a JPY_* variable (JPY_PARENT_PID, the grader's pid, makes a boxed kernel
exit). The tests grade with such variables set to distinctive values and look for them wherever a box's output goes
(the executed notebook, the verdict, every rank's output), through probes that dump os.environ and every
/proc/*/environ the box can read. Where the box lacks a part (a cgroup controller, setpriv, root, the seccomp
filter's architecture), GRADER_SANDBOX=auto grades with a note and GRADER_SANDBOX=on refuses."""
import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest

from grader import ROOT
from grader.box import sandbox

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

# names the allowlist would pass (COURSE_*) or not, that ENV_DENY must stop, each with a value found nowhere else
SECRETS = {name: f"leak-{name.lower()}-{uuid.uuid4().hex[:10]}" for name in (
    "JPY_API_TOKEN", "JPY_SESSION_NAME", "JUPYTERHUB_API_TOKEN", "JUPYTERHUB_USER", "HF_TOKEN", "DB_PASSWORD",
    "AWS_SECRET_ACCESS_KEY", "OPENAI_API_KEY", "GOOGLE_APPLICATION_CREDENTIALS", "PROXY_AUTHORIZATION",
    "COURSE_API_TOKEN", "course_signing_key")}
DENIED_NAMES = [*SECRETS, "JPY_PARENT_PID"]

ENVIRON_SEEN = """
def _environ_seen():
    import glob, os
    seen = {"os.environ": dict(os.environ)}
    for path in glob.glob("/proc/*/environ"):
        try:
            with open(path, "rb") as f:
                seen[path] = f.read().decode("utf-8", "replace")
        except OSError:
            pass
    return repr(seen)
"""
# the module, at its import on every rank: its environment in the rank's output, then in its verdict
RANK_PROBE = ENVIRON_SEEN + """
print("RANK-ENVIRON", _environ_seen(), flush=True)
raise RuntimeError("RANK-ENVIRON " + _environ_seen())
"""


def _dead_pid() -> int:
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read()) + 1        # no process can have it


def _leaks(text: str) -> list[str]:
    return [v for v in SECRETS.values() if v in text] + [n for n in DENIED_NAMES if n in text]


def test_no_variable_that_could_carry_a_secret_passes_the_allowlist():
    env = {**SECRETS, "JPY_PARENT_PID": "12345", "PATH": "/usr/bin", "COURSE_JOB_ID": "j1", "HOME": "/root"}
    extra = {"COURSE_SESSION_TOKEN": "x", "MY_AUTH": "y", "HOME": "/box"}     # the box's own additions pass it too
    assert sandbox.clean_env(env, extra) == {"PATH": "/usr/bin", "COURSE_JOB_ID": "j1", "HOME": "/box"}


@needs_bwrap
def test_no_secret_reaches_a_grading_rank(monkeypatch):
    """Every rank of a 4-rank job dumps what it can see of any environment at its import: none of the grader's
    secrets, in any rank's output or in the verdict; a variable the box does pass (COURSE_JOB_ID) shows that the
    probe looked."""
    from grader.judge.job import run_checks
    from grader.tools.corpus import solution_modules
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("JPY_PARENT_PID", str(_dead_pid()))
    module = solution_modules("week02")["tp_linear.py"]
    rep = run_checks(["week02/column_parallel"], {"tp_linear.py": module + RANK_PROBE}, sandbox="on")
    output = "\n".join(run.output for run in rep.runs)
    for r in range(4):
        assert f"[rank {r}] RANK-ENVIRON" in output, output[-3000:]
    verdict = rep.cases["week02/column_parallel"].message()
    assert "RANK-ENVIRON" in verdict and "COURSE_JOB_ID" in output and "COURSE_JOB_ID" in verdict
    assert not _leaks(output) and not _leaks(verdict), (_leaks(output), _leaks(verdict))


@pytest.fixture(scope="module")
def graded_notebook(tmp_path_factory):
    """`python -m grader check` on the week 2 lab with a cell and a module that dump their environment, from a
    shell whose environment holds the secrets and a JPY_PARENT_PID that names a dead process (a `!` cell in
    Jupyter passes its kernel's)."""
    tmp = tmp_path_factory.mktemp("box-env")
    with open(os.path.join(ROOT, "solutions", "week02", "tp_linear.ipynb")) as f:
        nb = json.load(f)
    at = next(i for i, c in enumerate(nb["cells"]) if "".join(c["source"]).startswith("%%writefile -a tp_linear.py"))
    nb["cells"][at]["source"] = "".join(nb["cells"][at]["source"]) + "\n" + RANK_PROBE
    probe = {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
             "source": ENVIRON_SEEN + 'print("KERNEL-ENVIRON", _environ_seen())\n'}
    nb["cells"].insert(3, probe)
    (tmp / "tp_linear.ipynb").write_text(json.dumps(nb))
    env = {**os.environ, **SECRETS, "JPY_PARENT_PID": str(_dead_pid()), "GRADER_SANDBOX": "on",
           "GRADER_CHECK_SERVER": "off"}
    p = subprocess.run([sys.executable, "-m", "grader", "check", str(tmp / "tp_linear.ipynb"), "--output",
                        str(tmp / "executed.ipynb")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    executed = (tmp / "executed.ipynb").read_text() if (tmp / "executed.ipynb").exists() else ""
    return p, executed


@needs_bwrap
def test_no_secret_reaches_the_kernel_or_the_verdict(graded_notebook):
    p, executed = graded_notebook
    printed = ["".join(o.get("text", "")) for c in json.loads(executed)["cells"] for o in c.get("outputs", [])]
    kernel = [text for text in printed if "KERNEL-ENVIRON" in text]
    assert kernel and "PYTHONPATH" in kernel[0], p.stdout[-3000:] + p.stderr[-3000:]
    assert "RANK-ENVIRON" in p.stdout and "COURSE_JOB_ID" in p.stdout, p.stdout[-3000:]
    assert not _leaks(executed) and not _leaks(p.stdout + p.stderr), (_leaks(executed), _leaks(p.stdout + p.stderr))


@needs_bwrap
def test_a_jpy_parent_pid_in_the_graders_environment_does_not_stop_the_kernel(graded_notebook):
    """A kernel handed JPY_PARENT_PID decides its parent is gone (its pid namespace shows no such process) and
    exits: the notebook must still run to its end."""
    p, executed = graded_notebook
    assert "stopped early" not in p.stdout and "Kernel died" not in p.stdout + p.stderr, p.stdout[-3000:]
    code = [c for c in json.loads(executed)["cells"] if c["cell_type"] == "code"]
    assert code and all(c["execution_count"] is not None for c in code), p.stdout[-3000:]


def _no_cgroups(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox, "CGROUP_ROOT", str(tmp_path / "no-cgroups"))


def _no_setpriv(monkeypatch, tmp_path):
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **kw: None if name == "setpriv" else which(name, *a, **kw))


def _not_root(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox, "unprivileged_uid", lambda: None)


def _not_x86(monkeypatch, tmp_path):
    import platform
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")


# what the box detects it lacks: how to simulate it, which box meets it (the grading ranks' with the fork launcher,
# or one that drops privileges with setpriv: a kernel's, torchrun's), and what its note names
DEGRADED = {
    "no cgroup controller": (_no_cgroups, "fork", "the job has no pids limit"),
    "no setpriv": (_no_setpriv, "torchrun", "setpriv (util-linux) is not installed"),
    "not root, ranks not isolated": (_not_root, "fork", "so the ranks share your uid and are not isolated"),
    "not root, out/ not capped": (_not_root, "torchrun", "so the ranks' out/ folder has no total size cap"),
    "seccomp filter for another machine": (_not_x86, "fork", "the ranks' seccomp filter is written for x86-64"),
}


@needs_bwrap
@pytest.mark.parametrize("simulate, launcher, note", list(DEGRADED.values()), ids=list(DEGRADED))
def test_on_refuses_what_auto_notes(tmp_path, monkeypatch, simulate, launcher, note):
    """A job's box where a part is missing: GRADER_SANDBOX=auto grades with a note naming it, GRADER_SANDBOX=on
    refuses with that note and the way out, and leaves nothing mounted."""
    from grader.judge.attempt import Attempt
    simulate(monkeypatch, tmp_path)
    attempt = Attempt(str(tmp_path / "auto"), 0, backend="gloo", launcher=launcher, mode="auto")
    try:
        assert any(note in n for n in attempt.box.notes), attempt.box.notes
    finally:
        attempt.cancel()
    with pytest.raises(sandbox.SandboxUnavailable, match="GRADER_SANDBOX=on, and ") as refused:
        Attempt(str(tmp_path / "on"), 0, backend="gloo", launcher=launcher, mode="on")
    assert note in str(refused.value) and "set GRADER_SANDBOX=auto" in str(refused.value)
    with open("/proc/self/mountinfo") as f:
        assert str(tmp_path) not in f.read()


@needs_bwrap
def test_a_kernel_box_without_setpriv_is_refused_under_on(monkeypatch, tmp_path):
    _no_setpriv(monkeypatch, tmp_path)
    with pytest.raises(sandbox.SandboxUnavailable, match="setpriv"):
        sandbox.Sandbox(view=sandbox.KERNEL_VIEW, writable=[str(tmp_path)], setpriv=True, mode="on").__enter__()


CLI_WITHOUT_CGROUPS = ("import runpy, sys; import grader.box.sandbox as s; s.CGROUP_ROOT = '/nonexistent'; "
                       "sys.argv = ['grader', 'check', 'solutions/week02/tp_linear.ipynb', '--no-execute']; "
                       "runpy.run_module('grader', run_name='__main__')")


@needs_bwrap
@pytest.mark.parametrize("mode", ["on", "auto"])
def test_check_from_a_shell_where_the_box_lacks_cgroups(mode):
    """`python -m grader check` where no cgroup can be made: `on` is an error (exit 2, no score), `auto` grades and
    prints the note."""
    env = {**os.environ, "GRADER_SANDBOX": mode, "GRADER_CHECK_SERVER": "off"}
    p = subprocess.run([sys.executable, "-c", CLI_WITHOUT_CGROUPS], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    if mode == "on":
        assert p.returncode == 2 and "score:" not in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
        assert "error: the grader could not run: GRADER_SANDBOX=on, and the job has no pids limit" in p.stdout
    else:
        assert p.returncode == 0 and "score: 8/8" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
        assert "sandbox: the job has no pids limit" in p.stdout
