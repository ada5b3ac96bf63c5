"""Ring all-gather+GEMM and GEMM+reduce-scatter that overlap P2P with compute, and per-rank timelines.

Megatron-style SP (Korthikanti et al. 2022) puts an all-gather in front of every column-parallel GEMM
and a reduce-scatter behind every row-parallel one. Both can be split into t ring steps so that the
transfer of step k+1 runs while the GEMM of step k computes (Wang et al. 2023, "Overlap communication
with dependent computation via decomposition"; torchtitan "async TP"):

    AG+GEMM:  step k: post send(cur -> r+1), recv(nxt <- r-1); Y[:, src_k] = cur W^T; wait; swap buffers
    GEMM+RS:  step k: P = X[:, c_k] W^T (+ the partial sum received at step k-1); post send(P -> r+1)

On gloo the P2P runs on gloo's own threads, so the overlap is real on CPU too. On CUDA the P2P is posted
from a side stream (`comm_stream`), so the compute stream is free for the GEMM; Work.wait() then makes
the compute stream wait for the transfer without blocking the host.
This module is the lecture's and the profile's; the week-6 lab asks students to write their own.
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode


def ring_peers(group=None):
    """(t, r, next global rank, previous global rank) of this rank's ring."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    glob = (lambda i: i) if group is None else (lambda i: dist.get_global_rank(group, i))
    return t, r, glob((r + 1) % t), glob((r - 1) % t)


def _post(send, recv, nxt, prv, group, stream=None):
    """Post one ring step (send to next, receive from previous); on CUDA from the comm stream."""
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())       # the send buffer was written on the compute stream
    with ctx:
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, group),
                                       dist.P2POp(dist.irecv, recv, prv, group)])


def _wait(works, stream=None):
    for w in works:
        w.wait()
    if stream is not None:
        torch.cuda.current_stream().wait_stream(stream)       # later GEMMs read the received buffer


def comm_stream_for(x):
    """A side stream for P2P when x is on a GPU; None (same thread, gloo's own threads) on CPU."""
    return torch.cuda.Stream(device=x.device) if x.is_cuda else None


def ring_all_gather_matmul(x_s, w, group=None, serialize=False):
    """x_s (B, T/t, C) sequence block, w (O, C) -> (Y = AG(x) W^T (B, T, O), the gathered x (B, T, C)).

    serialize=True waits for each P2P right after posting it (the lecture's "find the bug"): same result, no overlap.
    """
    t, r, nxt, prv = ring_peers(group)
    B, Tc, C = x_s.shape
    stream = comm_stream_for(x_s)
    y = x_s.new_empty(B, t * Tc, w.shape[0])                        # (B, T, O)
    x_full = x_s.new_empty(B, t * Tc, C)                            # (B, T, C), kept for dW
    bufs = [x_s.contiguous(), torch.empty_like(x_s)]                # double buffer: compute on one, receive into the other
    for k in range(t):
        src = (r - k) % t                                           # whose block we hold at step k
        cur = bufs[k % 2]
        works = _post(cur, bufs[(k + 1) % 2], nxt, prv, group, stream) if k < t - 1 else []  # prefetch k+1 ...
        if serialize:
            _wait(works, stream)
            works = []
        y[:, src * Tc:(src + 1) * Tc] = F.linear(cur, w)            # ... while step k's GEMM runs
        x_full[:, src * Tc:(src + 1) * Tc] = cur
        _wait(works, stream)
    return y, x_full


def matmul_reduce_scatter(x, w, group=None):
    """x (B, T, I) full sequence (a partial-sum contribution), w (O, I) -> this rank's block of sum_r X_r W_r^T (B, T/t, O).

    The partial sum for block c travels the ring r+1 -> ... and ends at its owner; step k's GEMM runs while
    step k-1's partial sum is in flight. Summation order differs from reduce_scatter: equal bits at t = 2 only.
    """
    t, r, nxt, prv = ring_peers(group)
    B, T, _ = x.shape
    Tc = T // t
    stream = comm_stream_for(x)
    recv, works, send = None, [], None
    for k in range(t):
        c = (r - k - 1) % t                                         # the block this step works on; c = r at k = t-1
        part = F.linear(x[:, c * Tc:(c + 1) * Tc], w)               # (B, T/t, O) overlaps the transfer of step k-1
        if k > 0:
            _wait(works, stream)
            part = part + recv                                      # add what the previous ranks summed so far
        if k < t - 1:
            send, recv = part.contiguous(), torch.empty_like(part)
            works = _post(send, recv, nxt, prv, group, stream)
    return part


class AllGatherLinear(torch.autograd.Function):
    """Column-parallel linear on a sequence-sharded input: ring AG+GEMM forward, ring GEMM+RS backward."""

    @staticmethod
    def forward(ctx, x_s, w, group):
        y, x_full = ring_all_gather_matmul(x_s, w, group)
        ctx.save_for_backward(x_full, w)
        ctx.group = group
        return y

    @staticmethod
    def backward(ctx, dy):
        x_full, w = ctx.saved_tensors
        dx_s = matmul_reduce_scatter(dy, w.t(), ctx.group)          # dX = dY W, summed over ranks, block r
        dw = dy.flatten(0, -2).t() @ x_full.flatten(0, -2)          # (O/t, C)
        return dx_s, dw, None


class LinearReduceScatter(torch.autograd.Function):
    """Row-parallel linear to a sequence-sharded output: ring GEMM+RS forward, ring AG+GEMM backward."""

    @staticmethod
    def forward(ctx, x, w, group):
        ctx.save_for_backward(x, w)
        ctx.group = group
        return matmul_reduce_scatter(x, w, group)

    @staticmethod
    def backward(ctx, dy_s):
        x, w = ctx.saved_tensors
        dx, dy = ring_all_gather_matmul(dy_s, w.t(), ctx.group)     # dX = AG(dY) W; dY gathered on the way
        dw = dy.flatten(0, -2).t() @ x.flatten(0, -2)               # (O, I/t)
        return dx, dw, None


def all_gather_linear(x_s, w, group=None):
    return AllGatherLinear.apply(x_s, w, group)


def linear_reduce_scatter(x, w, group=None):
    return LinearReduceScatter.apply(x, w, group)


# -- per-rank timelines and overlap efficiency ----------------------------------------------------
_P2P = {"send", "recv_"}


class Timeline(TorchDispatchMode):
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
    """The same P2P steps as the ring, with no GEMM: the communication time to hide."""
    t, r, nxt, prv = ring_peers(group)
    a, b = x_s.contiguous(), torch.empty_like(x_s)
    for _ in range(steps):
        _wait(_post(a, b, nxt, prv, group))
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
    effs, alone, exposed, tl = [], [], [], None
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
