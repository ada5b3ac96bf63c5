"""Generalized tensor parallelism (GTP_remat) / ZeRO-3 on a chain of linears, and the tools that watch it (Week 8).

Each rank r of a group of N stores rows r*out_i/N.. of every weight W_i (out_i, in_i) and runs whole GEMMs on its
own micro-batch. The schedule is the one of Megatron-LM's GTP (megatron_gtp, Sec. 3.1 "Overlap design summary"):

    fwd:  AG(W_{i+1}) || GEMM(W_i)
    bwd:  AG(W_{i-1}) || dgrad(W_i) -> wgrad(W_i) || RS(wgrad_i) || [finalize wgrad_{i+1}]

Backward of layer i: dX = dY W_i (dgrad), dW_i = dY^T X over this rank's micro-batch only (wgrad), then
dW_i[r] = sum over ranks of their dW_i, rows r*out_i/N.. (one reduce-scatter). With `deferred_rs=True` that
reduce-scatter is launched asynchronously and finalised one backward step later (Sec. 1.1 "Deferred RS finalize
for wgrad"): layer i-1's backward waits for it after its own dgrad and wgrad GEMMs, which the reduce-scatter runs
under; the last one (layer 0) is finalised by `GTPChain.finalize_grads()` at the end of backward. The price is a
second full-size weight-grad buffer alive (the one in flight and the one just computed).
With `deferred_rs=False` every reduce-scatter is waited right after it is launched (the synchronous baseline).
"""
from __future__ import annotations

import time
import weakref

import torch
import torch.distributed as dist

from tpkit.dispatch import MeasuringMode
from tpkit.timeline import Timeline

GEMMS = {"mm", "addmm", "bmm", "matmul", "linear"}
_COLLECTIVES = {"_allgather_base_": "AG", "_reduce_scatter_base_": "RS"}   # c10d ops of *_into_tensor / *_single


class WeightGatherer:
    """Every layer's shard and the in-flight all-gathers, at most one ahead of use."""

    def __init__(self, shards, group=None):
        self.shards, self.group = shards, group
        self.world = dist.get_world_size(group)
        self.inflight = {}                                    # layer -> (full buffer, Work)

    def start(self, i):
        """Launch the async all-gather of W_i (nothing if out of range or already in flight)."""
        if i < 0 or i >= len(self.shards) or i in self.inflight:
            return
        shard = self.shards[i].detach()                       # (out_i/N, in_i)
        full = shard.new_empty(shard.shape[0] * self.world, shard.shape[1])   # (out_i, in_i)
        self.inflight[i] = (full, dist.all_gather_single(full, shard, group=self.group, async_op=True))

    def wait(self, i):
        """The full W_i: the prefetched buffer, or a cold gather; forgotten here, so it dies with the caller's."""
        if i not in self.inflight:
            self.start(i)                                     # cold: W_0 in forward, W_{L-1} in backward
        full, work = self.inflight.pop(i)
        work.wait()
        return full


class GradReducer:
    """The weight-grad reduce-scatters: launched by layer i's backward, finalised into shards[i].grad.

    deferred: finalize(i + 1) is called by layer i's backward after its GEMMs (so RS_{i+1} ran under them);
    otherwise launch() waits at once.
    """

    def __init__(self, shards, group=None, deferred=True):
        self.shards, self.group, self.deferred = shards, group, deferred
        self.world = dist.get_world_size(group)
        self.pending = {}                                     # layer -> (shard-sized result, full grad, Work)

    def launch(self, i, dw_full):
        """Start RS(dW_i): sum the (out_i, in_i) grads of all ranks, keep this rank's (out_i/N, in_i) rows."""
        out = dw_full.new_empty(dw_full.shape[0] // self.world, dw_full.shape[1])   # (out_i/N, in_i)
        work = dist.reduce_scatter_single(out, dw_full, group=self.group, async_op=True)
        self.pending[i] = (out, dw_full, work)                # dw_full stays alive until the RS is done
        if not self.deferred:
            self.finalize(i)

    def finalize(self, i):
        """Wait for RS(dW_i), if pending, and accumulate its result into shards[i].grad."""
        if i not in self.pending:
            return
        out, _, work = self.pending.pop(i)
        work.wait()
        p = self.shards[i]
        p.grad = out if p.grad is None else p.grad + out

    def finalize_all(self):
        for i in sorted(self.pending, reverse=True):
            self.finalize(i)


class GTPLinear(torch.autograd.Function):
    """y = x W_i^T with W_i whole only inside this call and inside its backward."""

    @staticmethod
    def forward(ctx, x, shard, i, gatherer, reducer):
        w = gatherer.wait(i)                                  # (out, in), just in time
        gatherer.start(i + 1)                                 # prefetch: runs under this GEMM
        ctx.save_for_backward(x)                              # not w: gathered again in backward
        ctx.i, ctx.gatherer, ctx.reducer = i, gatherer, reducer
        return x @ w.T                                        # (n, out)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        g, red, i = ctx.gatherer, ctx.reducer, ctx.i
        w = g.wait(i)
        g.start(i - 1)                                        # prefetch the previous layer's weight
        dx = dy @ w                                           # dgrad (n, in): RS(dW_{i+1}) still in flight
        del w
        dw_full = dy.T @ x                                    # wgrad (out, in), this rank's micro-batch only
        red.launch(i, dw_full)                                # async RS of dW_i ...
        red.finalize(i + 1)                                   # ... and RS(dW_{i+1}), launched one layer ago, is done
        return dx, None, None, None, None                     # the shard's grad arrives through the reducer


class GTPChain(torch.nn.Module):
    """Linear -> GELU -> ... -> Linear, each weight stored as this rank's block of rows."""

    def __init__(self, shards, group=None, deferred_rs=True):
        super().__init__()
        self.shards = torch.nn.ParameterList(shards)
        self.group, self.deferred_rs, self.reducer = group, deferred_rs, None

    @classmethod
    def from_dense(cls, weights, group=None, deferred_rs=True):
        r, n = dist.get_rank(group), dist.get_world_size(group)
        return cls([torch.nn.Parameter(w.detach().chunk(n, 0)[r].clone()) for w in weights], group, deferred_rs)

    def forward(self, x):
        gatherer = WeightGatherer(list(self.shards), self.group)
        self.reducer = GradReducer(list(self.shards), self.group, self.deferred_rs)
        for i, shard in enumerate(self.shards):
            x = GTPLinear.apply(x, shard, i, gatherer, self.reducer)
            if i < len(self.shards) - 1:
                x = torch.nn.functional.gelu(x)
        return x

    def finalize_grads(self):
        """Wait for the reduce-scatters still in flight after backward (layer 0's when deferred)."""
        self.reducer.finalize_all()


def dense_chain_grads(weights, x):
    """The single-device model: y = W_{L-1} gelu(... gelu(W_0 x)), loss y.square().sum(); returns the dW_i."""
    ws = [w.clone().requires_grad_(True) for w in weights]
    h = x
    for i, w in enumerate(ws):
        h = h @ w.T
        h = torch.nn.functional.gelu(h) if i < len(ws) - 1 else h
    h.square().sum().backward()
    return [w.grad for w in ws]


class GradBufferWatch(MeasuringMode):
    """Full-size weight-grad buffers alive at once: every reduce-scatter's input, followed with a weak reference
    (as tpkit.gather_watch.GatherWatch follows all-gather outputs); counted at each new reduce-scatter."""

    def __init__(self):
        super().__init__()
        self._live: list[tuple[weakref.ref, int]] = []
        self.peak_count = self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d" and func._opname == "_reduce_scatter_base_":
            self._live = [(r, b) for r, b in self._live if r() is not None]
            inp = args[1]
            self._live.append((weakref.ref(inp), inp.numel() * inp.element_size()))
            self.peak_count = max(self.peak_count, len(self._live))
            self.peak_bytes = max(self.peak_bytes, sum(b for _, b in self._live))
        return out


class CollectiveTimeline(Timeline):
    """tpkit.timeline.Timeline extended to collectives: each all-gather and reduce-scatter from its issue to the
    return of the wait() on its own Work (matched by identity), and every GEMM on its own, in program order.

    Host clocks on one thread: the order of the events is exact; their lengths are CPU/gloo times.
    """

    def __init__(self):
        super().__init__()
        self.gemms: list[tuple[float, float]] = []            # (start, end)
        self.colls: list[dict] = []                           # {"op", "issued", "posted", "waited", "returned"}
        self._by_work: dict[int, dict] = {}
        self._works: list = []                                # keeps each Work alive, so its id stays unique

    def on_wait(self, work, started, returned):
        super().on_wait(work, started, returned)             # Timeline's record of time blocked in wait
        rec = self._by_work.get(id(work))
        if rec is not None and rec["returned"] is None:
            rec["waited"], rec["returned"] = started, returned

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        s = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        e = time.perf_counter()
        name = func._opname
        if func.namespace == "c10d" and name in _COLLECTIVES and isinstance(out, (tuple, list)):
            work = torch._C._distributed_c10d.Work.unbox(out[-1])   # the same Python object dist.* returns
            self._works.append(work)
            rec = {"op": _COLLECTIVES[name], "issued": s, "posted": e, "waited": None, "returned": None}
            self._by_work[id(work)] = rec
            self.colls.append(rec)
        elif func.namespace == "aten" and name in GEMMS:
            self.gemms.append((s, e))
        return out

    def lanes(self, op="RS"):
        """{'compute': GEMMs, 'comm': op's collectives from issue to wait returned}, seconds since the start."""
        t0 = self.t0
        return {"compute": [(s - t0, e - t0) for s, e in self.gemms],
                "comm": [(c["issued"] - t0, c["returned"] - t0) for c in self.colls
                         if c["op"] == op and c["returned"] is not None]}
