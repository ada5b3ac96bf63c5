"""Profiler timelines on any machine: each rank records a torch.profiler trace, one file shows all ranks.

    with RankProfile(out_dir):                     # on every rank: torch.profiler (CPU) + a start barrier
        with record_function("forward"): y = layer(x)      # user ranges (torch.profiler)
        with record_function("backward"): y.backward(dy)
    merge(glob(out_dir + "/rank*.json"), "step.trace.json")    # one process lane ("pid") per rank
    draw("step.trace.json")                                    # matplotlib: GEMMs vs collectives per rank

`%%torchrun -n 2 --trace step.trace.json` does all three for a notebook cell. Open the merged file in
ui.perfetto.dev or chrome://tracing (Chrome trace format: {"traceEvents": [{name, ph, ts, pid, tid, ...}]}).

What torch.profiler 2.13 records for a gloo collective on CPU (run and read, not assumed): the calling
thread gets a `c10d::allreduce_` op (also `c10d::allgather_`, `c10d::_reduce_scatter_base_`, ...) that only
hands the work to gloo, and a gloo worker thread (`pt_gloo_runloop`) gets a `gloo:all_reduce`
range that lasts until the collective completed, waiting for the peers included. Send/recv run on the
calling thread as `gloo:send` / `gloo:recv`. So the time of a collective is its `gloo:*` range, and
`collectives()` counts those (one per collective per rank). With NCCL the backend's ranges are expected as
`nccl:*` (matched too, not checked here: no GPU); on GPUs the kernels matter, so use nsys (docs/student.md).
"""
from __future__ import annotations

import json
import os
import re
import statistics

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

ANCHOR = "tpkit.trace:start_barrier"
PH = {"X", "B", "E", "i", "I", "M", "C", "s", "t", "f", "b", "e", "n"}    # phases of the Chrome trace format
GEMM = re.compile(r"^aten::(mm|addmm|matmul|linear|bmm|baddbmm)$")
COLLECTIVE = re.compile(r"all_?reduce|all_?gather|reduce_?scatter|broadcast|send|recv|barrier|c10d|gloo:|nccl",
                        re.I)
EXECUTED = re.compile(r"^(gloo|nccl):")    # the collective as the backend ran it (not the enqueueing c10d:: op)


class RankProfile:
    """torch.profiler on this rank (CPU activities, shapes off), written to `out_dir/rank{r}.json` on stop().

    start() enters a `tpkit.trace:start_barrier` range around a dist.barrier() (when a process group exists):
    every rank's lane starts with it, and no rank leaves it before the last one entered, which `merge`
    uses as time zero and to check the clocks (`otherData.anchors`).
    """

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        self.prof = None

    def start(self) -> "RankProfile":
        # kineto prints a dated "USDT ... profiler_start/stop" line at every log level below 6 (read when the
        # first profiler starts): 6 keeps cell outputs clean; a failing profiler still raises in Python
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self.prof = profile(activities=[ProfilerActivity.CPU], record_shapes=False)
        self.prof.start()
        if dist.is_initialized():
            with record_function(ANCHOR):
                dist.barrier()
        return self

    def stop(self) -> str:
        self.prof.stop()
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, f"rank{self.rank}.json")
        self.prof.export_chrome_trace(path)
        return path

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        if exc[0] is None:
            self.stop()
        else:
            self.prof.stop()


def load(path_or_trace) -> dict:
    if isinstance(path_or_trace, dict):
        return path_or_trace
    with open(path_or_trace) as f:
        return json.load(f)


def merge(paths, out: str | None = None) -> dict:
    """Per-rank Chrome traces -> one trace: pid = rank, a "rank r" process_name each, one clock for all.

    Clock: kineto stamps every event on the machine's real-time clock: ts (µs) + baseTimeNanoseconds/1e3 is
    Unix time on every rank. On one host all ranks read that same clock, so putting the per-rank files on a
    common base aligns them without any estimate. We chose this over aligning the ranks' exits from a
    barrier: ranks do not leave a barrier together (on this loaded 2-core machine their exits from the start
    barrier were up to several milliseconds apart), so that would shift whole lanes by scheduling jitter.
    The start barrier is still recorded, as a check: with one clock no rank may leave it before the last rank
    entered it (`otherData.anchors`, ms from time zero; tests/test_trace.py asserts it). Across hosts the
    real-time clocks differ by their NTP offset and the barrier exits would be the better reference (not
    implemented: the course launches every rank on one host).
    Time zero (`otherData.start_us`) is the moment the last rank entered the start barrier; ts are µs from
    the earliest event, so no ts is negative.
    """
    per_rank = {}
    for p in paths:
        d = load(p)
        r = d.get("distributedInfo", {}).get("rank")
        if r is None:
            r = int(re.search(r"rank(\d+)", os.path.basename(p)).group(1))
        per_rank[int(r)] = d
    if not per_rank:
        raise ValueError("merge: no per-rank trace files")
    base = min(d.get("baseTimeNanoseconds", 0) for d in per_rank.values())
    shift = {r: (d.get("baseTimeNanoseconds", 0) - base) / 1e3 for r, d in per_rank.items()}   # µs

    def xs(r):   # this rank's complete events on the common clock
        return [e for e in per_rank[r]["traceEvents"] if e.get("ph") == "X" and isinstance(e.get("pid"), int)]

    first = min(e["ts"] + shift[r] for r, d in per_rank.items() for e in d["traceEvents"]
                if e.get("ph") in PH - {"M"} and isinstance(e.get("pid"), int) and "ts" in e)
    anchors = {r: next(((e["ts"] + shift[r] - first, e["ts"] + e["dur"] + shift[r] - first)
                        for e in xs(r) if e["name"] == ANCHOR), None) for r in per_rank}
    start = max(a[0] for a in anchors.values()) if all(anchors.values()) else 0.0
    events = []
    for r, d in sorted(per_rank.items()):
        events += [{"name": "process_name", "ph": "M", "ts": 0, "pid": r, "tid": 0, "args": {"name": f"rank {r}"}},
                   {"name": "process_sort_index", "ph": "M", "ts": 0, "pid": r, "tid": 0, "args": {"sort_index": r}}]
        for e in d["traceEvents"]:
            # kineto's own process rows ("python", "Spans", "Traces") give way to the rank lanes
            if e.get("ph") not in PH or "name" not in e or not isinstance(e.get("pid"), int) \
                    or (e["ph"] == "M" and e["name"].startswith("process_")):
                continue
            e = dict(e, pid=r, ts=0 if e["ph"] == "M" else round(e["ts"] + shift[r] - first, 3))
            if e["ph"] in ("s", "t", "f"):        # autograd's forward->backward arrows: ids unique per rank
                if not isinstance(e.get("id"), int):
                    continue
                e["id"] = r * 1_000_000_000 + e["id"]
            events.append(e)
    merged = {"traceEvents": events, "displayTimeUnit": "ms",
              "otherData": {"ranks": sorted(per_rank), "clock": "unix time (one host, one clock)",
                            "start_us": round(start, 3),
                            "anchors": {str(r): None if a is None else [round((a[0] - start) / 1e3, 3),
                                                                        round((a[1] - start) / 1e3, 3)]
                                        for r, a in anchors.items()}}}
    if out:
        with open(out, "w") as f:
            json.dump(merged, f)
    return merged


def kind(e: dict) -> str | None:
    """"gemm", "collective" (the backend's gloo:/nccl: range), "call" (a c10d:: op that enqueues one),
    "region" (a user record_function range) or None."""
    name = e.get("name", "")
    if GEMM.match(name):
        return "gemm"
    if EXECUTED.match(name):
        return "collective"
    if COLLECTIVE.search(name) and e.get("cat") == "cpu_op":
        return "call"
    if e.get("cat") == "user_annotation" and name != ANCHOR and not name.startswith("ProfilerStep"):
        return "region"
    return None


def events(trace, rank: int | None = None, kinds=None, within: str | None = None) -> list[dict]:
    """Complete events (ph "X") in start order, ts/dur in µs from time zero. within: only events starting inside one of
    this rank's user ranges of that name (any thread: gloo's worker runs inside the caller's range)."""
    tr = load(trace)
    zero = tr.get("otherData", {}).get("start_us", 0.0)
    out = sorted((dict(e, ts=e["ts"] - zero) for e in tr["traceEvents"]
                  if e.get("ph") == "X" and (rank is None or e["pid"] == rank) and (kinds is None or kind(e) in kinds)),
                 key=lambda e: e["ts"])
    if within is not None:
        spans = [(e["pid"], e["ts"], e["ts"] + e["dur"]) for e in events(tr, rank) if e["name"] == within]
        out = [e for e in out if any(p == e["pid"] and s <= e["ts"] <= t for p, s, t in spans)]
    return out


def collectives(trace, rank: int | None = None, within: str | None = None) -> list[dict]:
    """One event per collective per rank: the backend's gloo:*/nccl:* ranges (name, ts, dur in µs)."""
    return events(trace, rank, ("collective",), within)


def summary(trace, within: str | None = None) -> dict:
    """{rank: {"counts": {name: n}, "total_ms", "median_ms"}} of the collectives (within a user range)."""
    out = {}
    for r in load(trace)["otherData"]["ranks"]:
        cs = collectives(trace, r, within)
        counts = {}
        for e in cs:
            counts[e["name"]] = counts.get(e["name"], 0) + 1
        durs = [e["dur"] / 1e3 for e in cs]
        out[r] = {"counts": counts, "total_ms": sum(durs), "median_ms": statistics.median(durs) if durs else 0.0}
    return out


def draw(trace, ax=None, title: str | None = None):
    """Ranks as lanes: GEMMs (aten::mm/addmm/matmul/linear/bmm) and collectives (gloo:* ranges and the
    c10d:: calls) in two colours, user ranges as labelled grey bands; x in ms from time zero, zoomed to the
    user ranges when there are any."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    tr = load(trace)
    ranks = tr["otherData"]["ranks"]
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 0.9 * len(ranks) + 1.5))
    regs = events(tr, kinds=("region",))
    shown = [e for e in events(tr) if e["ts"] >= 0 and kind(e)]
    lo = min((e["ts"] for e in regs), default=0.0)
    hi = max((e["ts"] + e["dur"] for e in (regs or shown)), default=1.0)
    colours = {"gemm": "tab:blue", "collective": "tab:orange", "call": "tab:orange"}
    for i, r in enumerate(ranks):
        y = len(ranks) - 1 - i                                      # rank 0 on top
        for k, (y0, h) in (("gemm", (y - 0.05, 0.4)), ("collective", (y - 0.42, 0.35)), ("call", (y - 0.42, 0.35))):
            bars = [(e["ts"] / 1e3, e["dur"] / 1e3) for e in shown if e["pid"] == r and kind(e) == k]
            ax.broken_barh(bars, (y0, h), facecolors=colours[k], edgecolor=colours[k], linewidth=0.4)
        for e in regs:
            if e["pid"] == r:
                ax.broken_barh([(e["ts"] / 1e3, e["dur"] / 1e3)], (y + 0.37, 0.08), facecolors="0.6")
                ax.text(e["ts"] / 1e3, y + 0.47, e["name"], fontsize=7, va="bottom")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in reversed(ranks)])
    ax.set_ylim(-0.6, len(ranks) - 0.3 + 0.25)
    pad = 0.02 * (hi - lo) / 1e3
    ax.set_xlim(lo / 1e3 - pad, hi / 1e3 + pad)
    ax.set_xlabel("time since every rank reached the start barrier (ms)")
    ax.set_title(title or f"torch.profiler timeline, {len(ranks)} ranks, CPU/gloo: GEMMs vs collectives")
    ax.legend(handles=[Patch(color="tab:blue", label="GEMM (aten::mm/addmm/matmul/linear/bmm)"),
                       Patch(color="tab:orange", label="collective (gloo:* range, c10d:: call)"),
                       Patch(color="0.6", label="user range (record_function)")],
              fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, frameon=False)
    return ax
