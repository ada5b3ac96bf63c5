"""The box around student ranks: who they run as, what they see, what they can write and reach."""
import os
import shutil
import tempfile
import textwrap

import pytest

from grader.box.sandbox import ROOT, RANK_VIEW, Limits, Sandbox, give_to, python_paths
from grader.tools import check_server
from launch import run

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

PROBE = textwrap.dedent("""
    import os, resource
    import torch, torch.distributed as dist
    from launch.dist import init_process_group
    rank, world, _ = init_process_group()
    t = torch.ones(1); dist.all_reduce(t)          # gloo over loopback still works
    def seen(p):
        try:
            return sorted(os.listdir(p)) if os.path.isdir(p) else open(p).read()[:20]
        except OSError as e:
            return type(e).__name__
    facts = {"uid": os.getuid(), "allreduce": int(t.item()),
             "nets": sorted(l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:]),
             "as_limit": resource.getrlimit(resource.RLIMIT_AS)[0], "secret_env": os.environ.get("COURSE_TEST_SECRET_TOKEN"),
             "home_token": os.environ.get("GH_TOKEN")}
    for p in SEEN:
        facts["seen " + p] = seen(p)
    for path in (os.path.join(REPO, "escape.txt"), os.path.join(JOB, "escape.txt"), "/root/escape.txt"):
        try:
            open(path, "w").write("x")
            facts["wrote " + path] = True
        except OSError:
            facts["wrote " + path] = False
    open("inside-out.txt", "w").write("ok")
    open("/tmp/scratch.txt", "w").write("ok")      # a private /tmp is writable
    if rank == 0:
        print("FACTS", facts)
""")


@pytest.fixture()
def planted():
    """A private file in the grading user's home, as an instructor's token would be."""
    home = os.path.expanduser("~")
    path = os.path.join(home, f".grader-test-secret-{os.getpid()}")
    with open(path, "w") as f:
        f.write("instructor secret")
    os.chmod(path, 0o600)
    yield path
    os.unlink(path)


def test_ranks_see_only_the_allowlist(planted, monkeypatch):
    monkeypatch.setenv("GH_TOKEN", "not for students")
    jobdir = tempfile.mkdtemp(prefix="grader-job-")
    out = os.path.join(jobdir, "out")
    os.makedirs(out)
    try:
        hidden = [planted, os.path.join(ROOT, "solutions"), os.path.join(ROOT, "notebooks"),
                  os.path.join(ROOT, "reference"), os.path.join(ROOT, "grader", "cases"),
                  os.path.join(ROOT, "grader", "job.py"), os.path.join(ROOT, ".git"), "/home",
                  check_server.folder()]      # the check servers' sockets
        seen = hidden + [os.path.dirname(planted)]
        script = os.path.join(jobdir, "probe.py")
        with open(script, "w") as f:
            f.write(f"SEEN = {seen!r}\nREPO = {ROOT!r}\nJOB = {jobdir!r}\n" + PROBE)
        with Sandbox(readable=[jobdir], writable=[out], chdir=out, mode="on", limits=Limits()) as box:
            give_to(jobdir, box.uid)
            res = run(script, 2, module=False, wrap=box.prefix, base_env=box.base_env(os.environ),
                      env={**box.env, "PYTHONPATH": ROOT}, cwd=out, timeout=120)
        assert res.ok, res.output
        facts = eval(res.rank_output(0).split("FACTS ", 1)[1].splitlines()[0])  # our own printed dict
        if os.geteuid() == 0:
            assert facts["uid"] == 65534                   # a real unprivileged uid, not root in disguise
        assert facts["allreduce"] == 2
        assert facts["nets"] == ["lo"]                     # no network but loopback
        assert facts["as_limit"] == Limits().memory_bytes
        assert facts["home_token"] is None                 # a clean environment
        for p in hidden:
            assert facts["seen " + p] == "FileNotFoundError", (p, facts["seen " + p])
        # the home folder holds at most the way to the Python runtime (e.g. ~/.pyenv), never its files
        home = facts["seen " + os.path.dirname(planted)]
        runtime = [p for p in python_paths() if p.startswith(os.path.dirname(planted) + "/")]
        assert home == "FileNotFoundError" or all(any(r.split("/")[len(os.path.dirname(planted).split("/"))] == h
                                                      for r in runtime) for h in home), home
        assert not any(v for k, v in facts.items() if k.startswith("wrote"))
        assert os.path.exists(os.path.join(out, "inside-out.txt"))
        assert not os.path.exists(os.path.join(ROOT, "escape.txt"))
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)


def test_rank_view_is_what_a_rank_needs():
    """The course parts a grading rank sees hold no case, reference, comparison or lecture code.
    (tpkit/selfcheck.py runs the trusted harness from the student's own kernel; inside a box there is
    no harness to import, and an autograded kernel defers the self-check.)"""
    for part in RANK_VIEW:
        for dirpath, _, files in os.walk(os.path.join(ROOT, part)):
            for f in (x for x in files if x.endswith(".py") and x != "selfcheck.py"):
                text = open(os.path.join(dirpath, f)).read()
                for banned in ("from reference", "import reference", "grader.cases", "grader.judge", "grader.box",
                               "grader.autograde", "grader.tools"):
                    assert banned not in text, f"{os.path.join(dirpath, f)} mentions {banned!r}"


def test_sandbox_off_says_so():
    with Sandbox(mode="off") as box:
        assert box.prefix == [] and "sandbox off" in box.notes[0]


def test_grading_from_a_symlinked_venv_and_a_checkout_under_tmp():
    """A venv reached through a symlink into /tmp and a checkout under /tmp (a CI clone) still grade: the
    box binds real paths, and a grader that could not start its ranks would say so, never score 0."""
    import subprocess
    import sys
    tmp = tempfile.mkdtemp(prefix="grader-clone-")
    try:
        clone = os.path.join(tmp, "course")
        subprocess.run(["git", "clone", "-q", ROOT, clone], check=True)
        venv = os.path.join(tmp, "venv-link")
        os.symlink(sys.prefix, venv)
        py = os.path.join(venv, "bin", "python")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        p = subprocess.run([py, "-m", "grader", "check", "solutions/week02/tp_linear.ipynb", "--no-execute"],
                           cwd=clone, env={**env, "GRADER_SANDBOX": "on"}, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0 and "score: 8/8" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


LEAVE_BEHIND = textwrap.dedent("""
    import os, time
    open("/tmp/left-by-job-a", "w").write("A")          # the box's /tmp
    open("left-by-job-a", "w").write("A")               # the job's out/ folder
    os.environ["JOB_A_MARKER"] = "A"
    if os.fork() == 0:                                  # a process that tries to outlive its job
        os.setsid()
        import ctypes
        ctypes.CDLL(None).prctl(15, b"job-a-sleeper", 0, 0, 0)    # PR_SET_NAME: its name in /proc/PID/comm
        time.sleep(120)
        os._exit(0)
""")
LOOK_BACK = textwrap.dedent("""
    import glob, os
    _seen = [p for p in glob.glob("/tmp/*") + glob.glob("*") + glob.glob("../../*/*") + glob.glob("../../*/*/*")
             if "left-by-job-a" in p]      # not "job-a": a job folder /tmp/grader-job-a1b2... is the second job's own
    for _pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            if open(f"/proc/{_pid}/comm").read().strip() == "job-a-sleeper":
                _seen.append(f"process {_pid}")
        except OSError:
            pass
    if _seen or os.environ.get("JOB_A_MARKER"):
        raise RuntimeError(f"this job sees the previous one: {_seen} {os.environ.get('JOB_A_MARKER')}")
""")


def _marked_processes() -> list[int]:
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "job-a-sleeper":
                    found.append(int(pid))
        except OSError:
            continue
    return found


def test_a_job_sees_nothing_of_the_previous_one():
    """Two submissions graded one after the other by one grading process (as a class autograde worker does):
    files, environment and processes the first job leaves are gone, and the second job cannot see them."""
    from grader.judge.job import run_checks
    from launch.runner import job_processes
    from grader.tools.corpus import solution_modules
    module = solution_modules("week02")["tp_linear.py"]
    first = run_checks(["week02/column_parallel"], {"tp_linear.py": LEAVE_BEHIND + module}, sandbox="on")
    assert first.passed, first.cases["week02/column_parallel"].message()
    assert not [p for run in first.runs for p in job_processes(run.job_id)], "the first job left processes"
    assert not _marked_processes(), "a process of the first job outlived it"
    second = run_checks(["week02/column_parallel"], {"tp_linear.py": LOOK_BACK + module}, sandbox="on")
    assert second.passed, second.cases["week02/column_parallel"].message()


def test_first_launch_held_while_the_grader_imports():
    """run_trusted's first launch is started (held) before the trusted process has torch, then released with
    the job; a held launch the job does not agree with is given up, leaving nothing behind."""
    from grader.judge.attempt import hold_first_attempt
    from grader.judge.job import run_checks
    from launch.runner import job_processes
    from grader.tools.corpus import solution_modules
    src = solution_modules("week02")
    names = ["week02/column_parallel"]
    assert hold_first_attempt(["../etc/column_parallel"]) is None      # a name no week has: no launch
    held = hold_first_attempt(names, sandbox="on")
    rep = run_checks(names, src, sandbox="on", first=held)
    assert rep.passed, rep.cases[names[0]].message()
    assert "--hold" in rep.runs[0].command and not job_processes(rep.runs[0].job_id)
    held = hold_first_attempt(names, sandbox="on")
    rep = run_checks(names, src, sandbox="off", first=held)           # the job decides otherwise
    assert rep.passed and "--hold" not in rep.runs[0].command
    assert held.launch.proc.returncode is not None and not job_processes(held.launch.job_id)
    assert not os.path.exists(held.here)


def test_a_boxed_kernel_gets_only_the_font_list_of_the_users_matplotlib_cache(tmp_path, monkeypatch):
    from grader.box.kernel_box import _seed_font_list
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "fontlist-v390.json").write_text('{"ttflist": []}')
    (cache / "tex.cache").write_text("not for the box")
    monkeypatch.setenv("MPLCONFIGDIR", str(cache))
    _seed_font_list(str(tmp_path / "home" / ".matplotlib"))
    assert os.listdir(tmp_path / "home" / ".matplotlib") == ["fontlist-v390.json"]


def test_a_first_attempt_that_cannot_be_held_leaves_no_job_folder(tmp_path, monkeypatch):
    from grader.judge.attempt import hold_first_attempt
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(ValueError, match="GRADER_SANDBOX='bogus' is unknown"):
        hold_first_attempt(["week02/column_parallel"], sandbox="bogus")
    assert os.listdir(tmp_path) == []
