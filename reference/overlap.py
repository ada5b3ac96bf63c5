"""Ring all-gather+GEMM and GEMM+reduce-scatter that overlap P2P with compute (the Week 6 lab's answers).

Megatron-style SP (Korthikanti et al. 2022) puts an all-gather in front of every column-parallel GEMM
and a reduce-scatter behind every row-parallel one. Both can be split into t ring steps so that the
transfer of step k+1 runs while the GEMM of step k computes (Wang et al. 2023, "Overlap communication
with dependent computation via decomposition"; torchtitan "async TP"):

    AG+GEMM:  step k: post send(cur -> r+1), recv(nxt <- r-1); Y[:, src_k] = cur W^T; wait; swap buffers
    GEMM+RS:  step k: P = X[:, c_k] W^T (+ the partial sum received at step k-1); post send(P -> r+1)

On gloo the P2P runs on gloo's own threads, so the overlap is real on CPU too. On CUDA the P2P is posted
from a side stream (`comm_stream`), so the compute stream is free for the GEMM; Work.wait() then makes
the compute stream wait for the transfer without blocking the host.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F


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
    cur = x_s.contiguous()                                          # the caller's block: read, never written
    bufs = [torch.empty_like(x_s), torch.empty_like(x_s)]           # two receive buffers take turns
    for k in range(t):
        src = (r - k) % t                                           # whose block we hold at step k
        nxt_buf = bufs[k % 2]
        works = _post(cur, nxt_buf, nxt, prv, group, stream) if k < t - 1 else []  # prefetch k+1 ...
        if serialize:
            _wait(works, stream)
            works = []
        y[:, src * Tc:(src + 1) * Tc] = F.linear(cur, w)            # ... while step k's GEMM runs
        x_full[:, src * Tc:(src + 1) * Tc] = cur
        _wait(works, stream)
        cur = nxt_buf
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


