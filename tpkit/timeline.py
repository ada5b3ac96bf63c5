"""Per-rank timelines of compute and communication, and how much of the communication was hidden.

A `Timeline` (a TorchDispatchMode) timestamps GEMMs and copies, P2P posts and the time spent blocked
in Work.wait(); `overlap_efficiency` turns one rank's timeline into hidden / total communication.
CPU clocks: on a GPU these are launch times; use torch.profiler / nsys there.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from tpkit.dispatch import MeasuringMode


# -- per-rank timelines and overlap efficiency ----------------------------------------------------
_P2P = {"send", "recv_"}


class Timeline(MeasuringMode):
    """Timestamps on this rank: compute ops (GEMMs and copies, merged), P2P posts, time blocked in Work.wait().

    Work.wait is wrapped only while the timeline is active. CPU clocks: on a GPU, GEMM times here are
    launch times; use torch.profiler / nsys there.
    """

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, float, float]] = []     # (kind, start, end), kind in gemm/post/wait
        self.t0 = time.perf_counter()

    def __enter__(self):
        work = torch._C._distributed_c10d.Work
        self._orig_wait = orig = work.wait
        events = self.events

        def timed_wait(w, *a, **k):
            s = time.perf_counter()
            out = orig(w, *a, **k)
            events.append(("wait", s, time.perf_counter()))
            return out

        work.wait = timed_wait
        return super().__enter__()

    def __exit__(self, *exc):
        torch._C._distributed_c10d.Work.wait = self._orig_wait
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._opname
        s = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        e = time.perf_counter()
        if func.namespace == "c10d":
            if name in _P2P:
                self.events.append(("post", s, e))
        elif self.events and self.events[-1][0] == "gemm" and s - self.events[-1][2] < 2e-5:
            self.events[-1] = ("gemm", self.events[-1][1], e)          # merge back-to-back compute ops
        else:
            self.events.append(("gemm", s, e))                         # compute: GEMMs and the copies around them
        return out

    def lanes(self):
        """{'compute': [(start, end)], 'comm': [(post, last wait return)]}, seconds since the timeline began."""
        comp = [(s - self.t0, e - self.t0) for k, s, e in self.events if k == "gemm"]
        comm, start, last = [], None, None
        for kind, s, e in self.events:            # a comm step: from its first post to the wait before the next post
            if kind == "post" and (start is None or last is not None):
                if start is not None:
                    comm.append((start - self.t0, last - self.t0))
                start, last = s, None
            elif kind == "wait" and start is not None:
                last = e
        if start is not None and last is not None:
            comm.append((start - self.t0, last - self.t0))
        return {"compute": comp, "comm": comm}

    def blocked(self) -> float:
        return sum(e - s for k, s, e in self.events if k == "wait")


def ring_exchange_only(x_s, steps, group=None):
    """`steps` ring P2P exchanges of x_s with no GEMM: the communication an overlapped ring must hide."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    glob = (lambda i: i) if group is None else (lambda i: dist.get_global_rank(group, i))
    nxt, prv = glob((r + 1) % t), glob((r - 1) % t)
    a, b = x_s.contiguous(), torch.empty_like(x_s)
    for _ in range(steps):
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, a, nxt, group), dist.P2POp(dist.irecv, b, prv, group)]):
            w.wait()
        a, b = b, a


def lane_overlap(lanes) -> tuple[float, float]:
    """(hidden, total) seconds: total = length of the comm intervals (post -> wait returned), hidden = the part
    of them covered by a GEMM on this rank. A comm step whose wait was entered after it had finished counts
    until that wait returned, but it is then covered by the GEMM anyway: hidden/total stays honest."""
    total = sum(e - s for s, e in lanes["comm"])
    hidden = sum(max(0.0, min(e, ge) - max(s, gs)) for s, e in lanes["comm"] for gs, ge in lanes["compute"])
    return hidden, total


def overlap_efficiency(fn, x_s=None, comm_payload=None, group=None, reps=5):
    """hidden / total communication on this rank from per-rank timestamps (a report, not a grade).

    Median over `reps` runs after one warm-up of `lane_overlap` of the Timeline of `fn()`. Also returns the
    median time of the same P2P steps alone (`ring_exchange_only` of `comm_payload`, if given) for scale.
    Returns (efficiency in [0, 1], comm-alone seconds or nan, median exposed seconds blocked in wait, Timeline).
    """
    t = dist.get_world_size(group)
    effs, alone, exposed = [], [], []
    for i in range(reps + 1):
        if comm_payload is not None:
            dist.barrier(group=group)
            s = time.perf_counter()
            ring_exchange_only(comm_payload, t - 1, group)
            if i:
                alone.append(time.perf_counter() - s)
        dist.barrier(group=group)
        with Timeline() as tl:
            fn()
        if i:
            hidden, total = lane_overlap(tl.lanes())
            effs.append(hidden / total if total > 0 else 0.0)
            exposed.append(tl.blocked())
    return (statistics.median(effs), statistics.median(alone) if alone else float("nan"),
            statistics.median(exposed), tl)


def plot_timelines(lanes_by_rank: dict, title: str, ax=None):
    """One lane per rank and stream (compute / comm), bars in ms."""
    import matplotlib.pyplot as plt
    ax = ax or plt.gca()
    ranks = sorted(lanes_by_rank)
    labels = []
    for i, r in enumerate(ranks):
        for j, (lane, color) in enumerate((("compute", "tab:blue"), ("comm", "tab:orange"))):
            y = 2 * i + j
            ax.broken_barh([(s * 1e3, (e - s) * 1e3) for s, e in lanes_by_rank[r][lane]], (y - 0.4, 0.8),
                           facecolors=color, edgecolor="k", linewidth=0.3)
            labels.append(f"rank {r} {lane}")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("time since the step began (ms)")
    ax.set_title(title)
    return ax
