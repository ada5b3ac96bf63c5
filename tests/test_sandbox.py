"""The sandbox around student ranks: who they run as, what they see, what they can write."""
import os
import shutil
import tempfile
import textwrap

import pytest

from grader.nbgrader_tools import ROOT
from grader.sandbox import Limits, Sandbox, course_paths_to_hide
from launch import run

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

PROBE = textwrap.dedent("""
    import os, resource
    import torch, torch.distributed as dist
    from launch.dist import init_process_group
    rank, world, _ = init_process_group()
    t = torch.ones(1); dist.all_reduce(t)          # gloo over loopback still works
    facts = {"uid": os.getuid(), "allreduce": int(t.item()), "nets": sorted(l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:]),
             "solutions": sorted(os.listdir(SOLUTIONS)) if os.path.isdir(SOLUTIONS) else None,
             "as_limit": resource.getrlimit(resource.RLIMIT_AS)[0]}
    for path in (os.path.join(REPO, "escape.txt"), "/root/escape.txt"):
        try:
            open(path, "w").write("x")
            facts["wrote " + path] = True
        except OSError:
            facts["wrote " + path] = False
    open("inside-job.txt", "w").write("ok")
    if rank == 0:
        print("FACTS", facts)
""")


def test_ranks_are_boxed():
    jobdir = tempfile.mkdtemp(prefix="grader-job-")
    try:
        script = os.path.join(jobdir, "probe.py")
        with open(script, "w") as f:
            f.write(f"SOLUTIONS = {os.path.join(ROOT, 'solutions')!r}\nREPO = {ROOT!r}\n" + PROBE)
        with Sandbox(jobdir, hide=course_paths_to_hide(ROOT), mode="on", limits=Limits()) as box:
            res = run(script, 2, module=False, wrap=box.prefix, env={**box.env, "PYTHONPATH": ROOT},
                      cwd=jobdir, timeout=120)
        assert res.ok, res.output
        facts = eval(res.rank_output(0).split("FACTS ", 1)[1].splitlines()[0])  # our own printed dict
        assert facts["uid"] == 65534                       # nobody, not the instructor
        assert facts["allreduce"] == 2
        assert facts["nets"] == ["lo"]                     # no network but loopback
        assert facts["solutions"] == []                    # solutions/ is an empty tmpfs
        assert facts["as_limit"] == Limits().memory_bytes
        assert not any(v for k, v in facts.items() if k.startswith("wrote"))
        assert os.path.exists(os.path.join(jobdir, "inside-job.txt"))
        assert not os.path.exists(os.path.join(ROOT, "escape.txt"))
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)


def test_sandbox_off_says_so():
    with Sandbox("/tmp", mode="off") as box:
        assert box.prefix == [] and "sandbox off" in box.notes[0]
