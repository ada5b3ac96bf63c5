"""grader units: the ledger, the comparison messages, notebook parsing, and check() wiring."""

import pytest
import torch

from grader.judge.case import Contract
from grader.judge.compare import check_contract, check_params, compare_tensor, describe_error, is_comm_error
from grader.rank.exchange import Item, RankRecord
from grader.judge.timeouts import EXECUTE_TIMEOUT, KILL_GRACE, PG_TIMEOUT, job_wall_clock
from tpkit.ledger import CommLedger, ring_bytes_sent
from grader.autograde.notebook import check_names, grade_cells
from grader.judge.sources import module_sources


def test_ring_bytes_formulas():
    n = 4096
    assert ring_bytes_sent("all_reduce", n, 4) == 2 * 3 / 4 * n
    assert ring_bytes_sent("all_gather", n, 4) == ring_bytes_sent("reduce_scatter", n, 4) == 3 / 4 * n
    # AR = RS + AG, in volume too
    assert ring_bytes_sent("all_reduce", n, 8) == ring_bytes_sent("reduce_scatter", n, 8) + ring_bytes_sent("all_gather", n, 8)
    assert ring_bytes_sent("all_reduce", n, 1) == 0


def test_compare_messages():
    want = torch.zeros(2, 3)
    assert compare_tensor("y", want.clone(), want, 1e-3, 0)[0] is None
    msg, _ = compare_tensor("y", torch.zeros(3, 2), want, 1e-3, 1)
    assert msg == "rank 1: `y` has shape (3, 2); expected (2, 3)."
    got = want.clone()
    got[1, 2] = float("nan")
    assert "contains NaN (1 of 6 values, first at [1, 2])" in compare_tensor("y", got, want, 1e-3, 0)[0]
    got = want.clone()
    got[0, 1] = 0.25
    msg, err = compare_tensor("dW", got, want, 1e-3, 3, hint="Look at the slice.")
    assert err == 0.25 and "max |err| 0.25 at [0, 1]" in msg and "atol=1 to pass" in msg and msg.endswith("Look at the slice.")
    assert "is float64; expected float32" in compare_tensor("y", want.double(), want, 1e-3, 0)[0]
    assert "is missing (None)" in compare_tensor("y", None, want, 1e-3, 0)[0]
    assert compare_tensor("y", want + 5e-4, want, 1e-3, 0)[0] is None  # inside atol


def test_contract_messages():
    c = Contract(counts={"forward": {"all_reduce": 1}}, params={"weight": (4, 8)})
    res = RankRecord(ledger=[{"phase": "forward", "op": "all_reduce", "sent": 0}] * 2,
                     params={"weight": [8, 8]})
    probs = check_contract(c, res, 0)
    assert probs == ["rank 0: forward used 2 all_reduce; the contract is 1."]   # the shapes are the rank's word
    assert any("keeps `weight` of shape (8, 8); its shard is (4, 8)" in p for p in check_params(c, res, 0))
    c = Contract(allowed_ops={"send", "recv"}, bytes_sent={"all": 96})
    probs = check_contract(c, RankRecord(ledger=[{"phase": "forward", "op": "all_reduce", "sent": 96}]), 2)
    assert any("only recv, send are allowed" in p for p in probs)


def test_error_descriptions():
    stub = 'Traceback (most recent call last):\n  File "/j/student/m.py", line 7, in Layer.forward\n    raise NotImplementedError("x")\nNotImplementedError: x'
    assert describe_error(stub, 0) == "rank 0: not implemented yet: `Layer.forward` (m.py line 7) raises NotImplementedError: x"
    comm = "Traceback...\nRuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"
    assert is_comm_error(comm) and not is_comm_error(stub)
    assert "lost its peers in its first collective" in describe_error(comm, 1, RankRecord())


def test_each_rank_is_compared_with_the_shard_of_its_place_in_the_group():
    """At t=2 of 4 the item runs on job ranks 2 and 3, group ranks 0 and 1 (participants): rank 2's result is
    compared with shard 0. Which shard is the trusted side's to know; a record cannot say."""
    from grader.judge.case import Case
    from grader.judge.compare import compare_item
    from grader.rank.exchange import participants
    case = Case(name="t/shards", module="m", world_sizes=(2,), config={}, make_inputs=None, reference=None,
                run_rank="f", expected=lambda cfg, ref, r, t: {"y": ref["y"].chunk(t)[r]})
    item = Item(id="t/shards@t2", case="t/shards", module="m", run_rank="f", t=2, config={}, timeout=10)
    ref = {"y": torch.arange(4.0)}
    group = participants(2, 4)
    right = {j: RankRecord(tensors={"y": ref["y"].chunk(2)[i]}) for i, j in enumerate(group)}
    assert compare_item(case, item, ref, group, right, {}).passed
    swapped = {j: RankRecord(tensors={"y": ref["y"].chunk(2)[1 - i]}) for i, j in enumerate(group)}
    assert not compare_item(case, item, ref, group, swapped, {}).passed


def test_timeouts_nest():
    assert PG_TIMEOUT < job_wall_clock(1) < job_wall_clock(40) + KILL_GRACE < EXECUTE_TIMEOUT


def test_ledger_sees_collectives_in_forward_and_backward():
    """One rank, gloo: the dispatch mode sees c10d ops issued inside a custom backward."""
    import os
    import torch.distributed as dist
    from launch.forkrun import free_port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        class F(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                g = g.clone()
                dist.all_reduce(g)
                return g
        x = torch.ones(4, requires_grad=True)
        with CommLedger(group_size=2) as led:
            led.set_phase("forward")
            y = F.apply(x)
            out = torch.empty(8)
            dist.all_gather_single(out[:4], x.detach())
            led.set_phase("backward")
            y.sum().backward()
        assert led.counts("forward") == {"all_gather": 1}
        assert led.counts("backward") == {"all_reduce": 1}
        assert led.bytes_sent("backward") == 2 * 1 / 2 * 16
    finally:
        dist.destroy_process_group()


NB = {"cells": [
    {"cell_type": "code", "source": "%%writefile m.py\nA = 1", "metadata": {}},
    {"cell_type": "code", "source": "%%writefile -a m.py\nB = 2\n", "metadata": {}},
    {"cell_type": "code", "source": ["%%writefile other.py\n", "C = 3"], "metadata": {}},
    {"cell_type": "code", "source": 'check("w/a", "w/b")\n### BEGIN HIDDEN TESTS\ncheck("w/c")\n### END HIDDEN TESTS',
     "metadata": {"nbgrader": {"grade": True, "grade_id": "g1", "points": 2}}},
    {"cell_type": "code", "source": "print(1)", "metadata": {"nbgrader": {"grade": True, "grade_id": "g2", "points": 1}}},
]}


def test_notebook_parsing():
    assert module_sources(NB) == {"m.py": "A = 1\nB = 2\n", "other.py": "C = 3\n"}
    assert check_names('grader.check("x/y")\nif 0: check("z/w")') == ["x/y", "z/w"]
    cells = grade_cells(NB)
    assert [(c[2], c[3]) for c in cells] == [(["w/a", "w/b", "w/c"], 2.0)]


def test_check_in_kernel_is_deferred_and_validates(monkeypatch, capsys):
    from tpkit import check
    with pytest.raises(ValueError, match="name the check"):
        check()
    monkeypatch.setenv("GRADER_DEFER_CHECKS", "1")
    check("week02/mlp")
    assert "deferred to the trusted grader" in capsys.readouterr().out
    monkeypatch.delenv("GRADER_DEFER_CHECKS")
    with pytest.raises(KeyError, match="no check named 'week02/nope'"):
        check("week02/nope")


# -- messages that point at the cause ---------------------------------------------------------------
def _run(exitcodes, order, timed_out=False, output=""):
    from launch.runner import RunResult
    return RunResult(returncode=1, exitcodes=exitcodes, output=output, timed_out=timed_out, seconds=3.0, nproc=4,
                     backend="gloo", launcher="fork", order=order)


def test_rank_lists_are_said_once_and_in_good_grammar():
    from grader.judge.compare import rank_list
    assert rank_list([1, 1]) == "rank 1"                   # not "rank 1, 1"
    assert rank_list([3, 1]) == "ranks 1 and 3"
    assert rank_list([0, 1, 2, 3]) == "ranks 0, 1, 2 and 3"


def test_a_rank_that_lost_its_peers_is_not_blamed():
    from grader.judge.job import _missing_reason
    item = Item(id="week02/mlp@t4", case="week02/mlp", module="tp_linear", run_rank="run_mlp", t=4,
                config={}, timeout=15)
    run = _run({1: -11, 0: -15, 2: -15, 3: -15}, order=[1, 0, 2, 3])
    progress = {0: {"item": item.id, "where": "waiting", "op": "all_reduce", "index": 1, "phase": "forward"},
                1: {"item": item.id, "phase": "forward", "where": "between collectives"}}
    crashed = _missing_reason(1, item, run, progress, [], [0, 1, 2, 3])
    assert crashed.startswith("rank 1: the process crashed (signal 11, a segmentation fault)")
    stopped = _missing_reason(0, item, run, progress, [], [0, 1, 2, 3])
    assert "stopped by the grader after rank 1's process ended" in stopped
    assert "os._exit" not in stopped and "signal 15" not in stopped


def test_an_abort_inside_a_collective_names_the_size_mismatch():
    from grader.judge.job import _missing_reason
    item = Item(id="week04/embedding@t2", case="week04/embedding", module="vocab_parallel", run_rank="run_embedding",
                t=2, config={}, timeout=15)
    run = _run({0: -6, 1: -6}, order=[0, 1])
    progress = {0: {"item": item.id, "where": "inside", "op": "all_reduce", "index": 1, "phase": "forward"}}
    msg = _missing_reason(0, item, run, progress, [], [0, 1])
    assert "aborted (signal 6): gloo aborts a process when the ranks pass tensors of different sizes" in msg
    assert "not in a collective" not in msg and "in all_reduce #1 (forward)" in msg


def test_problems_merged_across_sizes_name_the_rank_at_each_size():
    from grader.judge.compare import ItemVerdict
    from grader.judge.job import CaseVerdict
    nan = "`y` contains NaN (1 of 6 values, first at [0, 0])."
    items = [ItemVerdict("c@t2", "c", 2, False, [f"rank 1: {nan}"]),
             ItemVerdict("c@t4", "c", 4, False, [f"rank 3: {nan}"])]
    msg = CaseVerdict("c", False, items).message()
    assert f"[t=2] rank 1, [t=4] rank 3: {nan}" in msg
    same = [ItemVerdict("c@t2", "c", 2, False, ["rank 0: x."]), ItemVerdict("c@t4", "c", 4, False, ["rank 0: x."])]
    assert "[t=2, 4] rank 0: x." in CaseVerdict("c", False, same).message()


def test_a_blocking_first_send_is_named_as_such():
    from grader.rank.watch import Watch
    w = Watch.__new__(Watch)
    msg = w._message((("waiting", "send", 1, "forward"), ("waiting", "send", 1, "forward")))
    assert msg.startswith("deadlock: rank 0 waits in send #1 (forward); rank 1 waits in send #1 (forward)")
    assert "no peer is sending" in msg and "batch_isend_irecv" in msg
    msg = w._message((("finished",), ("waiting", "all_reduce", 2, "backward")))
    assert msg.startswith("deadlock: rank 0 had finished this check; rank 1 waits in all_reduce #2 (backward)")


def test_a_students_traceback_starts_and_ends_in_their_code(tmp_path):
    from grader.rank.entry import user_traceback
    student = tmp_path / "student"
    student.mkdir()
    (student / "mine.py").write_text("import torch\n\ndef f(x):\n    return torch.cat([x, x.T], dim=0)\n")
    import importlib.util
    spec = importlib.util.spec_from_file_location("mine", student / "mine.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        (lambda: mod.f(torch.zeros(2, 3)))()       # a harness frame above, torch's below
    except RuntimeError as exc:
        tb = user_traceback(exc, str(student))
    frames = [ln for ln in tb.splitlines() if ln.strip().startswith("File ")]
    assert frames and all(str(student) in ln for ln in frames), tb
    assert tb.rstrip().splitlines()[-1].startswith("RuntimeError")


def test_importing_course_code_is_named():
    tb = ('Traceback (most recent call last):\n  File "/j/student/tp_linear.py", line 2, in <module>\n'
          '    from reference.tp_layers import ColumnParallelLinear\nModuleNotFoundError: No module named \'reference\'')
    msg = describe_error(tb, 0)
    assert "imports `reference.tp_layers`" in msg and "not there when grading" in msg
    from tpkit.course_imports import course_imports
    assert course_imports("import torch\nfrom reference.tp_layers import X\nimport grader.judge.job\n") == [
        (2, "reference.tp_layers"), (3, "grader.judge.job")]
    assert course_imports("from tpkit.models import DecoderLayer\n") == []


def test_self_check_says_early_that_course_code_will_be_missing(tmp_path, monkeypatch):
    from tpkit import check
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GRADER_DEFER_CHECKS", raising=False)
    (tmp_path / "tp_linear.py").write_text("from reference.tp_layers import ColumnParallelLinear, RowParallelLinear\n")
    with pytest.raises(AssertionError, match=r"tp_linear.py line 1 imports `reference.tp_layers`.*score 0"):
        check("week02/column_parallel")


def test_progress_file_rewritten_in_place(tmp_path):
    """A shorter state written over a longer one reads back whole (no stale tail), as does an empty file."""
    from tpkit.progress import ProgressFile, read_progress
    path = str(tmp_path / "rank0.progress")
    assert read_progress(path) == {}
    ProgressFile.at(path).write({"item": "week02/mlp@t2", "where": "waiting", "op": "all_reduce", "index": 12})
    ProgressFile.at(path).write({"where": "done"})
    assert read_progress(path) == {"where": "done"}
    assert ProgressFile.at(path) is ProgressFile.at(path)      # the ledger and the watch share one writer
