"""A grade rests on evidence the student's process cannot forge: each rank holds only its own inputs, what a
box leaves behind is read without blocking or trusting its types, and nothing runs unboxed by accident."""
import os
import shutil
import textwrap

import pytest
import torch

from grader.judge.attempt import RESULT_LIMIT, _load_rank_file
from grader.rank.exchange import records_from_saved
from grader.tools.corpus import solution_modules

needs_box = pytest.mark.skipif(shutil.which("bwrap") is None or os.geteuid() != 0,
                               reason="needs bubblewrap and root (make test installs it; CI runs as root)")

PEEK = textwrap.dedent("""
    import json as _json, os as _os
    _spec = _json.load(open(_os.path.join("..", "spec.json")))
    _mine = int(_os.environ["RANK"])
    _read = []
    for _r in range(4):
        try:
            open(_spec["inputs"].format(rank=_r), "rb").read(1)
            _read.append(_r)
        except OSError:
            pass
    if _read:
        raise RuntimeError(f"PEEKED rank {_mine} read the input files of ranks {_read}")
""")


@needs_box
def test_a_rank_cannot_open_another_ranks_inputs():
    """The fork launcher opens rank r's input file for rank r before dropping to the box's uid: afterwards no
    rank, whatever it runs, can open any rank's file (its own comes as an open descriptor)."""
    from grader.judge.job import run_checks
    module = solution_modules("week02")["tp_linear.py"]
    rep = run_checks(["week02/column_parallel"], {"tp_linear.py": PEEK + module}, sandbox="on")
    assert rep.passed, rep.cases["week02/column_parallel"].message()


def test_week02_ranks_receive_only_their_blocks():
    """What a rank receives has every other rank's block of a dense weight poisoned (NaN) and its
    activations sharded as a real rank's are; the full tensors stay with the trusted process."""
    from grader.judge.job import draw_seeds, plan_items, rank_views
    from grader.judge.case import get_case
    items = [it for it in plan_items(["week02/column_parallel_local", "week02/row_parallel_input_parallel"])
             if it.t == 2]
    seeds = draw_seeds(items)
    inputs = {it.id: get_case(it.case).make_inputs(it.config, torch.Generator().manual_seed(seeds[it.id]))
              for it in items}
    views = rank_views(items, inputs)
    col, row = (it.id for it in items)
    for r in range(2):
        w = views[r][col]["W"]
        assert torch.isnan(w).sum() == w.numel() // 2 and not torch.isnan(w.chunk(2, 0)[r]).any()
        assert views[r][col]["dy"].shape[-1] == inputs[col]["dy"].shape[-1] // 2
        assert torch.equal(views[r][row]["x"], inputs[row]["x"].chunk(2, -1)[r])
        assert not torch.isnan(views[r][row]["W"].chunk(2, 1)[r]).any() and torch.isnan(views[r][row]["W"]).any()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_odd_files_in_out_become_verdicts_not_hangs(tmp_path):
    """A FIFO, a symlink or an oversized file where a rank's results belong is a verdict at once."""
    fifo = tmp_path / "rank0.pt"
    os.mkfifo(fifo)
    res, why = _load_rank_file(str(fifo), 0, None)
    assert res == {} and "not a regular file" in why
    link = tmp_path / "rank1.pt"
    link.symlink_to("/etc/passwd")
    assert "not a regular file" in _load_rank_file(str(link), 1, None)[1]
    big = tmp_path / "rank2.pt"
    with open(big, "wb") as f:
        f.truncate(RESULT_LIMIT + 1)
    assert "over the" in _load_rank_file(str(big), 2, None)[1]


@pytest.mark.parametrize("bad,why", [
    ({"i@t2": {"params": [1, 2]}}, "`params` is a list"),
    ({"i@t2": {"seconds": "0.1"}}, "`seconds` is a str"),
    ({"i@t2": {"tensors": {"y": [1.0]}}}, "other than tensors"),
    ({"i@t2": {"ledger": [{"op": {"x": 1}}]}}, "plain records"),
    ({"i@t2": {"verdict": "pass"}}, "unknown field"),
    ({"i@t2": {"group": [1, 0]}}, "unknown field `group`"),      # which group a rank ran in is not its to say
    ([1, 2], "not a dict"),
])
def test_results_of_the_wrong_type_are_named(tmp_path, bad, why):
    with pytest.raises(ValueError, match=why.replace("`", ".")):
        records_from_saved(bad)
    path = tmp_path / "rank0.pt"
    torch.save(bad, path)
    res, msg = _load_rank_file(str(path), 0, None)
    assert res == {} and "malformed" in msg and why in msg


def test_good_results_pass_the_type_check():
    assert records_from_saved({"i@t2": {"tensors": {"y": torch.ones(2), "db": None},
                                       "params": {"weight": [4, 8]}, "ledger": [{"op": "all_reduce", "bytes": 8,
                                                                                 "shape": [2], "phase": "forward"}],
                                       "error": "", "seconds": 0.1},
                              "j@t2": {"skipped": "week02/x"}})["j@t2"].skipped == "week02/x"


def test_no_bubblewrap_refuses_to_grade(monkeypatch):
    """Without bubblewrap grading refuses, naming the fix, unless GRADER_SANDBOX=off says so explicitly."""
    from grader.box import sandbox
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    with pytest.raises(sandbox.SandboxUnavailable, match="GRADER_SANDBOX=off"):
        sandbox.Sandbox(mode="auto").__enter__()
    with sandbox.Sandbox(mode="off") as box:
        assert box.prefix == [] and "sandbox off" in box.notes[0]


SHADOW = textwrap.dedent("""
    import sys as _sys
    _stat = _sys.modules.get("statistics")
    if _stat is not None and not getattr(_stat, "__file__", "").startswith(_sys.base_prefix):
        raise RuntimeError("SHADOWED statistics came from " + _stat.__file__)
    import statistics as _s2
    if not _s2.__file__.startswith(_sys.base_prefix):
        raise RuntimeError("SHADOWED statistics came from " + _s2.__file__)
""")


def test_a_submission_cannot_shadow_the_standard_library():
    """An extra `%%writefile statistics.py` (or torch.py, tpkit.py) is never imported in place of the real
    one: the student's folder is last on sys.path and the graded module is imported by its path."""
    from grader.judge.job import run_checks
    module = solution_modules("week02")["tp_linear.py"]
    src = {"tp_linear.py": SHADOW + module, "statistics.py": "raise SystemExit('SHADOWED at import')\n",
           "tpkit.py": "raise SystemExit('SHADOWED tpkit')\n"}
    rep = run_checks(["week02/column_parallel"], src, sandbox="off")
    assert rep.passed, rep.cases["week02/column_parallel"].message()


@needs_box
def test_a_job_is_bounded_in_memory_cpu_share_and_tmp():
    """Every job has its own pids, memory and cpu cgroups (a hog cannot starve the job graded beside it) and
    a size-capped /tmp; what could not be set up is said in the box's notes."""
    from grader.box.sandbox import Limits, Sandbox
    probe = ("import os; print(sorted(l.split(':')[1] for l in open('/proc/self/cgroup') if 'grader-' in l)); "
             "s = os.statvfs('/tmp'); print(s.f_blocks * s.f_frsize)")
    import subprocess
    import sys
    with Sandbox(mode="on", limits=Limits(tmp_bytes=64 << 20), chdir="/tmp") as box:
        out = subprocess.run(box.prefix + [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    controllers, tmp = out.stdout.splitlines()
    assert controllers == str(sorted(["cpu", "memory", "pids"])), (out.stdout, out.stderr, box.notes)
    assert int(tmp) <= 64 << 20


SWAP_SIMULATOR = textwrap.dedent("""
    import tpkit.pipeline as _pl

    def _perfect(schedule, m=None, v=1, t_f=1.0, t_b=2.0, t_w=1.0):
        p = len(schedule)
        return _pl.Timeline(p=p, m=m, v=v, events=[[] for _ in range(p)], busy=[0.0] * p,
                            peak_in_flight=[min(p - s, m) for s in range(p)], split=False)
    _pl.simulate.__code__ = _perfect.__code__         # the simulator now says every schedule is perfect

    def gpipe(p, m):
        return [[("F", i) for i in range(m)] for _ in range(p)]       # no backward at all

    def one_f_one_b(p, m):
        return gpipe(p, m)
""")


def test_schedules_are_simulated_where_the_student_cannot_reach():
    """A schedule is plain data: the trusted process simulates it, so rewriting the rank's simulator (its
    __code__, the module, anything in the rank's process) changes nothing."""
    from grader.judge.job import run_checks
    rep = run_checks(["week09/schedule"], {"pipeline_lab.py": SWAP_SIMULATOR}, sandbox="off")
    msg = rep.cases["week09/schedule"].message()
    assert not rep.passed, msg
    assert "runs each F(mb) and B(mb) once" in msg, msg          # the trusted simulator saw no backward


def test_a_forged_deadlock_exit_status_still_ends_in_a_verdict():
    """A rank that leaves with the harness's 'gave up on a deadlock' status (os._exit(3)) without a verdict of
    its own is judged like any rank that died: every launch judges at least one check, so the job ends."""
    from grader.judge.job import run_checks
    from grader.rank.exchange import DEADLOCKED
    module = f"import os\nos._exit({DEADLOCKED})\n" + solution_modules("week02")["tp_linear.py"]
    rep = run_checks(["week02/column_parallel", "week02/row_parallel"], {"tp_linear.py": module}, sandbox="off")
    assert not rep.passed and len(rep.runs) <= 2, [r.seconds for r in rep.runs]
    assert f"exit status {DEADLOCKED}" in rep.cases["week02/column_parallel"].message()


def test_phases_a_rank_names_must_come_in_order():
    """A rank labels its collectives' phases itself: "setup" only before the check's own collectives, nothing but
    "harness" (the grader's) after the first harness one; training steps may alternate forward and backward."""
    from grader.judge.case import Contract
    from grader.judge.compare import check_contract
    from grader.rank.exchange import RankRecord
    contract = Contract(counts={"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}, unchecked=("harness",))

    def problems(*phases):
        entries = [{"phase": p, "op": "all_reduce", "sent": 0.0} for p in phases]
        return check_contract(contract, RankRecord(ledger=entries), 0)

    assert problems("forward", "backward", "forward", "backward", "harness", "harness") == []
    assert "came after the grader's own (harness)" in problems("forward", "harness", "backward", "forward",
                                                               "backward")[0]
    assert "setup comes first" in problems("forward", "setup", "backward", "forward", "backward")[0]
