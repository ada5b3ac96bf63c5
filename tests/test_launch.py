"""launch: ranks start with torchrun's environment, output is prefixed, failures and hangs
are reported with the root cause first, and nothing is left running."""
import os
import textwrap

import pytest

from launch import run
from launch.backend import default_launcher, pick_backend
from tests.procs import processes_naming

SCRIPT = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed as dist
    from launch.dist import init_process_group
    rank, world, _ = init_process_group()
    t = torch.ones(2) * rank
    dist.all_reduce(t)
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID"]
    print("env", all(k in os.environ for k in keys), "sum", int(t[0]))
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "crash" and rank == 1:
        raise ValueError("rank one is broken")
    if mode == "hang" and rank == 0:
        time.sleep(600)
    if mode == "daemon" and rank == 0:
        if os.fork() == 0:
            os.setsid()
            time.sleep(600)
    dist.barrier()
""")


@pytest.fixture()
def script(tmp_path):
    p = tmp_path / "job.py"
    p.write_text(SCRIPT)
    return str(p)


def test_backend_and_launcher_choice():
    assert pick_backend(4, "gloo") == "gloo"
    assert default_launcher("gloo") == "fork"
    assert default_launcher("gloo", interactive=True) == "warm"
    assert default_launcher("nccl") == "torchrun"
    with pytest.raises(ValueError, match="unknown"):
        pick_backend(2, "mpi")
    with pytest.raises(ValueError, match="fork launcher cannot start NCCL"):
        default_launcher("nccl", "fork")
    if pick_backend(2) == "gloo":  # no GPUs here
        with pytest.raises(RuntimeError, match="one GPU per rank"):
            pick_backend(2, "nccl")


@pytest.mark.parametrize("launcher", ["warm", "fork", "torchrun"])
def test_ranks_run_with_torchrun_environment(script, launcher):
    res = run(script, 3, module=False, launcher=launcher, timeout=60)
    assert res.ok, res.output
    for r in range(3):
        assert "env True sum 3" in res.rank_output(r)
    assert sorted(res.exitcodes) == [0, 1, 2]


def test_torchrun_ranks_destroy_their_group_before_interpreter_teardown(tmp_path):
    """A script that never calls destroy_process_group() still leaves in order: gloo's threads alive at
    interpreter teardown can abort a rank whose work is done (pytorch/pytorch#190489), so
    launch.dist.init_process_group registers the destroy at exit. An exit hook registered before it runs
    after it (LIFO) and sees the group gone."""
    p = tmp_path / "job.py"
    p.write_text(textwrap.dedent("""
        import atexit
        import torch.distributed as dist
        atexit.register(lambda: print("group alive at teardown:", dist.is_initialized(), flush=True))
        from launch.dist import init_process_group
        init_process_group()
        dist.barrier()
    """))
    res = run(str(p), 2, module=False, launcher="torchrun", timeout=60)
    assert res.ok, res.output
    for r in range(2):
        assert "group alive at teardown: False" in res.rank_output(r), res.output


def test_a_warm_launcher_that_cannot_start_falls_back_to_fork(script, monkeypatch, capsys):
    """On a machine too loaded for the resident launcher to come up in time, the job still runs (and says so),
    its clock starting only once its ranks can start."""
    import launch.zygote as zygote

    def never(*a, **k):
        raise zygote.ZygoteUnavailable("the warm launcher did not start within 0 s")
    monkeypatch.setattr(zygote, "ensure_zygote", never)
    res = run(script, 2, module=False, launcher="warm", timeout=60)
    assert res.ok and res.launcher == "fork", res.output
    assert "starts its own (fork) launcher" in capsys.readouterr().err


def test_a_zygote_socket_whose_kernel_is_gone_is_removed():
    """A kernel stopped with its process group takes its zygote along, socket left behind: the next zygote to
    start removes it, and leaves a live kernel's socket alone."""
    import socket
    import subprocess
    import launch.zygote as zygote
    gone, live = subprocess.Popen(["true"]), subprocess.Popen(["sleep", "60"])
    gone.wait()
    paths = {pid: zygote.socket_path(pid) for pid in (gone.pid, live.pid)}
    socks = []
    for path in paths.values():
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)
        socks.append(s)
    try:
        zygote.reap_stale_sockets()
        assert not os.path.exists(paths[gone.pid])
        assert os.path.exists(paths[live.pid])
    finally:
        live.kill()
        live.wait()
        for s in socks:
            s.close()
        for path in paths.values():
            if os.path.exists(path):
                os.unlink(path)


@pytest.mark.parametrize("launcher", ["warm", "fork"])
def test_crash_names_the_root_cause_rank(script, launcher):
    res = run(script, 3, ["crash"], module=False, timeout=60, launcher=launcher)
    assert not res.ok and res.first_failure == 1
    cause = res.root_cause()
    assert cause.startswith("rank 1 failed first") and "ValueError: rank one is broken" in cause
    assert "forkrun" not in cause  # the launcher's own frames are not the student's problem
    assert not processes_naming(script)


@pytest.mark.parametrize("launcher", ["warm", "fork"])
def test_hang_is_killed_at_the_wall_clock(script, launcher):
    res = run(script, 2, ["hang"], module=False, timeout=8, kill_grace=1, launcher=launcher)
    assert res.timed_out and res.returncode == 124
    assert "wall clock" in res.root_cause()
    assert not processes_naming(script)


@pytest.mark.parametrize("launcher", ["warm", "fork"])
def test_escaped_daemon_is_killed(script, launcher):
    res = run(script, 2, ["daemon"], module=False, timeout=30, launcher=launcher)
    assert res.ok
    assert res.leftovers_killed >= 1
    assert not processes_naming(script)


def test_magic_streams_and_raises(tmp_path):
    from launch.magic import RankFailure, run_cell
    lines = []
    os.chdir(tmp_path)
    run_cell("-n 2", "print('hello from', rank, 'of', world_size)", print_fn=lines.append)
    assert sorted(lines) == ["[rank 0] hello from 0 of 2", "[rank 1] hello from 1 of 2"]
    with pytest.raises(RankFailure, match="ZeroDivisionError"):
        run_cell("-n 2", "x = 1 / (rank - 1)", print_fn=lines.append)
    with pytest.raises(ValueError, match="unknown option"):
        run_cell("--bogus", "pass")


def test_every_launcher_gives_the_same_verdict():
    """warm, fork and torchrun run the same ranks: identical tensors, identical ledgers."""
    from grader.judge.job import run_checks
    from grader.judge.sources import module_sources
    from grader.tools.corpus import build
    src = module_sources(build("week02", {"base": "solution"}))
    tables = {}
    for launcher in ("warm", "fork", "torchrun"):
        rep = run_checks(["week02/mlp"], src, launcher=launcher, sandbox="off", fresh_seed=False)
        assert rep.passed, rep.cases["week02/mlp"].message()
        tables[launcher] = [(it.t, it.max_err, it.comm) for it in rep.cases["week02/mlp"].items]
    assert tables["warm"] == tables["fork"] == tables["torchrun"]


def test_held_launcher_runs_the_job_it_is_released_with(script):
    """A held fork launcher imports first and forks only on release; its timeout counts from the release."""
    import time
    from launch.runner import start
    held = start(script, None, module=False, launcher="fork", timeout=0.0)
    time.sleep(1.0)                               # the caller prepares the job meanwhile
    held.release(3, timeout=60)
    res = held.wait()
    assert res.ok, res.output
    assert [("env True sum 3" in res.rank_output(r)) for r in range(3)] == [True] * 3
    assert "--hold" in res.command
    with pytest.raises(ValueError, match="only the fork launcher can hold"):
        start(script, None, module=False, launcher="warm")


def test_held_launcher_given_up_leaves_nothing(script):
    from launch.runner import job_processes, start
    held = start(script, None, module=False, launcher="fork")
    with pytest.raises(RuntimeError, match="held"):
        held.wait()
    held.cancel()
    assert held.proc.returncode is not None
    assert not job_processes(held.job_id) and not processes_naming(script)
