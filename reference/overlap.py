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

Also here: `SPColumnLinear`, the SP column linear whose backward posts its all-gather before the dgrad GEMM
and its reduce-scatter before the wgrad GEMM (Megatron-LM), `SPMLP` (a block built on it, for timing a step),
and `pipelined_all_gather_matmul` (the step
order of PyTorch's micro-pipelined `symm_mem.fused_all_gather_matmul`, with P2P on gloo).
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


# -- Megatron's backward overlap for the sequence-parallel column linear (Week 6 §7-§8) -------------------
def start_all_gather_seq(x_s, group=None):
    """Post (async_op=True) the all-gather of the sequence blocks x_s (B, T/t, C).

    Returns (buffer (T, B, C), Work): read the buffer only after Work.wait(). all_gather_single works on
    dim 0, so the sequence goes first; Megatron keeps activations as [s, b, h] and needs no transpose.
    """
    t = dist.get_world_size(group)
    xs = x_s.transpose(0, 1).contiguous()                           # (T/t, B, C)
    out = xs.new_empty((t * xs.shape[0],) + tuple(xs.shape[1:]))    # (T, B, C)
    return out, dist.all_gather_single(out, xs, group=group, async_op=True)


def start_reduce_scatter_seq(x, group=None):
    """Post (async_op=True) the reduce-scatter of partial sums x (B, T, C) along the sequence.

    Returns (buffer (T/t, B, C), Work): this rank's block of the sum, valid after Work.wait().
    """
    t = dist.get_world_size(group)
    xs = x.transpose(0, 1).contiguous()                             # (T, B, C)
    out = xs.new_empty((xs.shape[0] // t,) + tuple(xs.shape[1:]))   # (T/t, B, C)
    return out, dist.reduce_scatter_single(out, xs, group=group, async_op=True)


def batch_first(x):
    """(T', B, C) -> (B, T', C), contiguous."""
    return x.transpose(0, 1).contiguous()


class SPColumnLinear(torch.autograd.Function):
    """Y = AllGather_T(x_s) W_r^T, the first GEMM after a sequence-parallel region (Korthikanti et al. 2022, §4.2.2),
    with the backward of Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication (sequence_parallel=True).

    x_s (B, T/t, C) this rank's sequence block, w (O/t, C) this rank's rows of W -> Y (B, T, O/t).
    Forward keeps only x_s, not the gathered X (B, T, C): 1/t of that activation. Backward needs
        dX = dY W      (dgrad; a partial sum: this rank saw only O/t of the outputs)  -> reduce-scatter along T
        dW = dY^T X    (wgrad; needs the whole sequence of X)                         -> all-gather X again
    and hides each collective under the GEMM that does not need it:
        post AG(x_s) | dgrad GEMM | wait AG | post RS(dX) | wgrad GEMM | wait RS
    overlap=False waits on each collective right after posting it (the serialised schedule, same bits).
    """

    @staticmethod
    def forward(ctx, x_s, w, group=None, overlap=True):
        buf, work = start_all_gather_seq(x_s, group)
        work.wait()                                                 # the forward GEMM needs all of X at once
        ctx.save_for_backward(x_s, w)                               # the shard only: X is gathered again in backward
        ctx.group, ctx.overlap = group, overlap
        return F.linear(batch_first(buf), w)                        # (B, T, O/t)

    @staticmethod
    def backward(ctx, dy):                                          # dy (B, T, O/t)
        x_s, w = ctx.saved_tensors
        # wgrad needs the whole X, but forward kept only this rank's block: gather it again. Post it first:
        # the dgrad GEMM below does not read X, so the transfer runs while it computes. (On GPUs Megatron
        # relies on CUDA_DEVICE_MAX_CONNECTIONS=1 so that the gather is scheduled before that GEMM.)
        x_buf, ag = start_all_gather_seq(x_s, ctx.group)
        if not ctx.overlap:
            ag.wait()
        dx = dy @ w                                                 # (B, T, C) dgrad, a partial sum over ranks
        if ctx.overlap:
            ag.wait()                                               # wgrad reads X from here on
        x = batch_first(x_buf)                                      # (B, T, C)
        # every rank holds a partial dX for all T positions, and rank r keeps only block r of the sum (the
        # sequence-parallel region before this layer): a reduce-scatter. Post it before the wgrad GEMM,
        # which does not read dX, so the reduction runs while dW computes.
        dx_buf, rs = start_reduce_scatter_seq(dx, ctx.group)
        if not ctx.overlap:
            rs.wait()
        dw = dy.flatten(0, -2).t() @ x.flatten(0, -2)              # (O/t, C) wgrad over all B*T rows
        if ctx.overlap:
            rs.wait()                                               # dX_s is returned: it must have arrived
        return batch_first(dx_buf), dw, None, None                  # (B, T/t, C), (O/t, C)


def sp_column_linear(x_s, w, group=None, overlap=True):
    return SPColumnLinear.apply(x_s, w, group, overlap)


# -- micro-pipelined all-gather + matmul: the schedule of torch's fused_all_gather_matmul (Week 6 §9) --------
def pipelined_all_gather_matmul(a_s, b, group=None, order=None):
    """a_s (B, T/t, C) sequence block, b (C, O) -> (A = AllGather_T(a_s) (B, T, C), A @ b (B, T, O)).

    The order of `torch.distributed._symmetric_memory._pipelined_all_gather_and_consume` (Wang et al. 2023's
    decomposition): step 0 multiplies the local shard; step s = 1..t-1 the shard of rank (r + s) mod t,
    fetched while step s-1 multiplies. On GPUs each fetch is a copy out of that rank's symmetric-memory
    buffer (NVLink lets every rank read every other); on gloo it is one send to (r - s) mod t and one
    receive from (r + s) mod t, posted a step ahead. `order`, if a list, gets the source rank of each step's GEMM.
    """
    t, r = dist.get_world_size(group), dist.get_rank(group)
    glob = (lambda i: i) if group is None else (lambda i: dist.get_global_rank(group, i))
    a_s = a_s.contiguous()
    shards = a_s.new_empty((t,) + tuple(a_s.shape))                 # (t, B, T/t, C): shard j of A at [j]
    out = a_s.new_empty((t,) + tuple(a_s.shape[:-1]) + (b.shape[1],))   # (t, B, T/t, O)

    def fetch(s):                                                   # post the exchange of step s
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, a_s, glob((r - s) % t), group),
                                       dist.P2POp(dist.irecv, shards[(r + s) % t], glob((r + s) % t), group)])
    shards[r] = a_s
    works = fetch(1) if t > 1 else []
    for s in range(t):
        src = (r + s) % t
        out[src] = torch.matmul(shards[src], b)                     # (B, T/t, O), while step s+1 is in flight
        if order is not None:
            order.append(src)
        for w in works:
            w.wait()
        works = fetch(s + 2) if s + 2 < t else []
    B, Tc = a_s.shape[0], a_s.shape[1]
    return (shards.transpose(0, 1).reshape(B, t * Tc, -1),          # (B, T, C)
            out.transpose(0, 1).reshape(B, t * Tc, -1))             # (B, T, O)


class SPMLP(torch.nn.Module):
    """x_s (B, T/t, C) -> x_s + RS_T(gelu(AG_T(x_s) W1_r^T) W2_r^T): an SP block's MLP, without its norm.

    W1_r (F/t, C) is this rank's rows of the first weight (column-parallel: `SPColumnLinear`, backward-
    overlapped when overlap=True), W2_r (C, F/t) its columns of the second (row-parallel, partial sums
    reduce-scattered along T). Per block and step: forward AG + RS, backward AG (of dY, for the row GEMM)
    + AG (X again) + RS (dX).
    """

    def __init__(self, w1, w2, group=None, overlap=True):
        super().__init__()
        t, r = dist.get_world_size(group), dist.get_rank(group)
        self.w1 = torch.nn.Parameter(w1.detach().chunk(t, 0)[r].clone())    # (F/t, C)
        self.w2 = torch.nn.Parameter(w2.detach().chunk(t, 1)[r].clone())    # (C, F/t)
        self.group, self.overlap = group, overlap

    def forward(self, x_s):
        from reference.sp_layers import ReduceScatterToSequence
        h = F.gelu(SPColumnLinear.apply(x_s, self.w1, self.group, self.overlap))   # (B, T, F/t)
        return x_s + ReduceScatterToSequence.apply(F.linear(h, self.w2), self.group)  # (B, T/t, C)
