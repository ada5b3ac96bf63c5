"""Profiler timelines: `%%torchrun --trace` records torch.profiler on every rank and merges the ranks' files
into one valid Chrome trace (one process lane per rank, one clock) that `tpkit.trace` reads and draws."""
import json
import os

import pytest

from tpkit import trace

CELL = """
from torch.profiler import record_function
x, w = torch.randn(4, 8), torch.randn(8, 8)
with record_function("forward"):
    y = x @ w                       # a GEMM, then one all-reduce (a row-parallel g)
    dist.all_reduce(y)
with record_function("backward"):
    dist.all_reduce(y)              # one all-reduce (a column-parallel f)
"""
PH = {"X", "B", "E", "i", "I", "M", "C", "s", "t", "f", "b", "e", "n"}   # the Chrome trace format's phases


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """One 2-rank traced job through the magic's code path; returns (merged path, printed lines, shown paths)."""
    from launch.magic import run_cell
    here, work = os.getcwd(), tmp_path_factory.mktemp("traced")
    lines, shown = [], []
    os.chdir(work)
    try:
        run_cell("-n 2 --trace step.trace.json", CELL, print_fn=lines.append, show_trace=shown.append)
    finally:
        os.chdir(here)
    return str(work / "step.trace.json"), lines, shown


def test_merged_file_is_one_valid_chrome_trace(traced):
    path, lines, shown = traced
    assert lines == ["trace of 2 ranks merged into step.trace.json (open it in ui.perfetto.dev or chrome://tracing)"]
    assert shown == ["step.trace.json"]                          # the notebook draws the file it just wrote
    with open(path) as f:
        tr = json.load(f)
    assert isinstance(tr["traceEvents"], list) and tr["traceEvents"]
    for e in tr["traceEvents"]:
        assert {"name", "ph", "ts", "pid"} <= e.keys(), e
        assert e["ph"] in PH and isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and "tid" in e, e
    assert {e["pid"] for e in tr["traceEvents"]} == {0, 1}
    names = [(e["pid"], e["args"]["name"]) for e in tr["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    assert sorted(names) == [(0, "rank 0"), (1, "rank 1")]     # one process_name per rank


def test_collectives_on_both_ranks_inside_the_user_ranges(traced):
    path = traced[0]
    for r in (0, 1):
        assert [e["name"] for e in trace.collectives(path, r, within="forward")] == ["gloo:all_reduce"]
        assert [e["name"] for e in trace.collectives(path, r, within="backward")] == ["gloo:all_reduce"]
        gemms = trace.events(path, r, kinds=("gemm",), within="forward")
        assert [e["name"] for e in gemms] == ["aten::matmul", "aten::mm"]   # `x @ w`: matmul calls mm
        assert trace.summary(path, within="forward")[r]["counts"] == {"gloo:all_reduce": 1}


def test_one_clock_for_all_lanes(traced):
    """No rank leaves the start barrier, or finishes an all-reduce, before the last rank entered it."""
    tr = trace.load(traced[0])
    anchors = tr["otherData"]["anchors"]
    assert min(a[0] for a in anchors.values()) <= 0 == max(a[0] for a in anchors.values())
    assert all(a[1] >= 0 for a in anchors.values()), anchors
    ars = {r: trace.collectives(tr, r, within=w) for r in (0, 1) for w in ("forward",)}
    assert min(a[0]["ts"] + a[0]["dur"] for a in ars.values()) >= max(a[0]["ts"] for a in ars.values())


def test_draw_has_a_lane_per_rank(traced):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ax = trace.draw(traced[0])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 1", "rank 0"]
    assert "(ms)" in ax.get_xlabel() and "GEMMs vs collectives" in ax.get_title()
    assert len(ax.collections) >= 2 * 3                           # per rank: GEMM, collective and call bars
    plt.close(ax.figure)


def test_merge_aligns_kineto_base_times_and_keeps_lanes_apart(tmp_path):
    """Synthetic per-rank files: a later baseTimeNanoseconds shifts a rank's events; flow ids stay per rank."""
    def rank_file(r, base_ns, events):
        p = tmp_path / f"rank{r}.json"
        p.write_text(json.dumps({"baseTimeNanoseconds": base_ns, "distributedInfo": {"rank": r}, "traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 100 + r, "tid": 0, "ts": 0, "args": {"name": "python"}},
            {"ph": "i", "name": "Iteration Start", "pid": "Traces", "tid": "x", "ts": 1.0},
            {"ph": "s", "name": "fwdbwd", "cat": "fwdbwd", "id": 7, "pid": 100 + r, "tid": 1, "ts": 12.0},
            *events]}))
        return str(p)

    def x(name, ts, dur, cat="cpu_op"):
        return {"ph": "X", "name": name, "cat": cat, "pid": 0, "tid": 1, "ts": ts, "dur": dur}

    p0 = rank_file(0, 1_000_000, [x(trace.ANCHOR, 10.0, 50.0, "user_annotation"), x("gloo:all_reduce", 100.0, 20.0)])
    p1 = rank_file(1, 1_020_000, [x(trace.ANCHOR, 10.0, 30.0, "user_annotation"), x("gloo:all_reduce", 85.0, 40.0)])
    tr = trace.merge([p1, p0], str(tmp_path / "m.trace.json"))
    assert json.load(open(tmp_path / "m.trace.json")) == tr
    # rank 1's clock base is 20 µs later: its anchor starts at 30 µs, 20 µs after the earliest event (rank 0's)
    assert tr["otherData"]["start_us"] == 20.0
    assert tr["otherData"]["anchors"] == {"0": [-0.02, 0.03], "1": [0.0, 0.03]}
    ar = {r: trace.collectives(tr, r)[0] for r in (0, 1)}
    assert (ar[0]["ts"], ar[1]["ts"]) == (100.0 - 30.0, 105.0 - 30.0)   # µs from time zero
    assert all(isinstance(e["pid"], int) for e in tr["traceEvents"])   # kineto's "Traces" row is dropped
    assert sorted(e["id"] for e in tr["traceEvents"] if e["ph"] == "s") == [7, 1_000_000_007]


def test_grading_skips_traced_cells_and_bad_options_fail(tmp_path, monkeypatch):
    from launch.magic import run_cell
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COURSE_GRADING", "1")
    lines = []
    assert run_cell("-n 2 --trace t.trace.json", CELL, print_fn=lines.append) is None
    assert lines == ["(%%torchrun -n 2: not run while the notebook is being graded)"]
    assert not os.path.exists(tmp_path / "t.trace.json")
    monkeypatch.delenv("COURSE_GRADING")
    with pytest.raises(ValueError, match="bad option value"):
        run_cell("-n 2 --trace", "pass")
