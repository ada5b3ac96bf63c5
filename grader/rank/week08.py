"""Week 8 on a rank: build the student's GTPChain (or GTPChainOverlap) from the dense weights (each rank keeps
its rows of every weight), run this rank's micro-batch forward (and backward, then finalize_grads() for the
overlapped chain) under tpkit.gather_watch.GatherWatch, and return the output, the input grad, this rank's
weight-grad shards and what the watch saw: the most gathered full weights alive at once, and how many full
weights were saved for backward; and, from a dispatch mode that sees every all-gather and reduce-scatter launch,
every GEMM and every Work.wait() in order: how many gathers had been launched after each weight's own when its
GEMM ran (the prefetch: 1 = the next weight, 0 at the last one), and, at each backward dX GEMM and each dW GEMM,
how many weight-grad reduce-scatters had been launched and not yet waited (the deferred finalisation: 1 = the
later layer's, 0 at the first backward layer), and how many were never waited at all. For the overlapped chain,
half the shards' .grad are pre-seeded with known tensors (the trusted side adds them to the expected grads), so
finalize must add its result to .grad, as the lab says, not overwrite it. `inp` is this rank's own
(grader/cases/week08.py `_own`): its micro-batch of x and dY, its rows of the pre-seeded grads, and the dense
weights from_dense is handed with the other ranks' rows NaN; so nothing here shards."""
from __future__ import annotations

import os
import weakref

import torch

from tpkit.dispatch import MeasuringMode
from tpkit.timeline import Provenance


def _warm_imports():
    """Rank processes only: pay DTensor's lazy imports (torch._dynamo, ...) when this module is imported.

    The rank entry must import this module before it arms the item timeout: a lazy import interrupted by
    that alarm would leave torch._dynamo half-initialised for every later item.
    """
    import torch._dynamo
    import torch.distributed._functional_collectives
    import torch.distributed.tensor  # noqa: F401


if os.environ.get("COURSE_JOB_ID"):   # only in a grading job's processes, not when the trusted side imports it
    _warm_imports()


FWD_AHEAD = "at each forward GEMM: later weights already being gathered (1 = the next one)"
BWD_AHEAD = "at each backward GEMM: earlier weights already being gathered (1 = the previous one)"
RS_INFLIGHT = "at each backward dX GEMM: weight-grad reduce-scatters launched and not yet waited (1 = the later layer's)"
RS_INFLIGHT_DW = ("at each backward dW GEMM, last layer first: weight-grad reduce-scatters launched and not yet waited "
                  "(1 = the later layer's; -1 = no dW GEMM seen)")
RS_UNWAITED = "weight-grad reduce-scatters never waited"
_RS_OPS = {"_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_"}
_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "mv", "addmv", "_addmm_activation", "dot"}


class PrefetchOrder(MeasuringMode):
    """A dispatch mode that sees, in each phase, every all-gather and reduce-scatter launch and every GEMM, and
    (while active) every Work.wait(): at the first GEMM that reads a gathered buffer (or a view of it), it
    records how many gathers of that phase were launched after that buffer's own and how many reduce-scatters
    of that phase are in flight (launched, their Work not yet waited). The forward GEMM of layer i names its
    other operand x_i; in backward, the first GEMM that reads all of x_i (or a view or copy of it,
    tpkit.timeline.Provenance) and makes a whole (out_i, in_i) grad is layer i's dW GEMM, where the count of
    reduce-scatters in flight is taken too. A Work is matched to its launch by
    identity: Work.unbox of the op's output is the very object dist.* hands the caller (a functional
    collective, waited with wait_tensor, is not followed: the lab asks for dist.reduce_scatter_single and its
    Work)."""

    def __init__(self, ledger):
        super().__init__()
        self.ledger = ledger
        self.gathers: dict[str, list] = {}     # phase -> [(weakref to the buffer, storage ptr, read yet)]
        self.ahead: dict[str, list] = {}       # phase -> [later gathers launched, per weight, at its GEMM]
        self.rs: dict[str, list] = {}          # phase -> [[Work, waited yet]] per c10d reduce-scatter
        self.rs_inflight: dict[str, list] = {}  # phase -> [reduce-scatters in flight, per weight, at its GEMM]
        self._works: dict[int, list] = {}      # id(Work) -> its record (the Work is kept, so the id is unique)
        self.prov = Provenance()               # which storages hold a layer's input x_i
        self.x_numel: dict[int, int] = {}      # layer -> numel of x_i, of its weight
        self.w_numel: dict[int, int] = {}
        self.rs_at_dw: dict[int, int] = {}     # layer -> reduce-scatters in flight at its dW GEMM

    def on_wait(self, work, started, returned):
        rec = self._works.get(id(work))
        if rec is not None:
            rec[1] = True

    def unwaited(self, phase):
        return sum(1 for _, waited in self.rs.get(phase, []) if not waited)

    def _track_rs(self, out):
        if isinstance(out, (tuple, list)) and out and isinstance(out[-1], torch.ScriptObject):
            try:
                work = torch._C._distributed_c10d.Work.unbox(out[-1])
            except Exception:      # noqa: BLE001
                return
            rec = [work, False]
            self._works[id(work)] = rec
            self.rs.setdefault(self.ledger.phase, []).append(rec)

    @staticmethod
    def _ptr(t):
        try:
            return t.untyped_storage().data_ptr() if t.untyped_storage().nbytes() > 0 else None
        except Exception:      # noqa: BLE001
            return None

    def _track(self, out):
        if isinstance(out, torch.Tensor):
            self.gathers.setdefault(self.ledger.phase, []).append([weakref.ref(out), self._ptr(out), False])

    def _gemm(self, args, out):
        mine = self.gathers.get(self.ledger.phase, [])
        operands = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
                    if isinstance(t, torch.Tensor)]
        ptrs = {self._ptr(t) for t in operands}
        for j in range(len(mine) - 1, -1, -1):    # the newest live buffer with that storage
            ref, ptr, read = mine[j]
            if ptr is not None and ptr in ptrs and ref() is not None and self._ptr(ref()) == ptr:
                if not read:
                    mine[j][2] = True
                    ahead = self.ahead.setdefault(self.ledger.phase, [])
                    if self.ledger.phase == "forward":      # layer i's GEMM: its other operand is x_i
                        i = len(ahead)
                        for t in operands:
                            if self._ptr(t) != ptr:
                                self.prov.tag(t, f"x{i}")
                                self.x_numel[i], self.w_numel[i] = t.numel(), ref().numel()
                    ahead.append(len(mine) - (j + 1))
                    self.rs_inflight.setdefault(self.ledger.phase, []).append(self.unwaited(self.ledger.phase))
                return
        if self.ledger.phase == "backward":            # a dW GEMM reads all of x_i and makes all of dW_i
            made = out.numel() if isinstance(out, torch.Tensor) else -1
            for t in operands:
                for name in self.prov.of(t):
                    i = int(name[1:])
                    if i not in self.rs_at_dw and t.numel() == self.x_numel[i] and made == self.w_numel[i]:
                        self.rs_at_dw[i] = self.unwaited("backward")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._opname
        out = func(*args, **kwargs)
        if func.namespace == "aten" and name in _GEMMS:
            self._gemm(args, out)
        self.prov.carry(func, args, kwargs, out)
        if func.namespace == "c10d" and name in ("_allgather_base_", "allgather_into_tensor_coalesced_") and args:
            for o in (args[0] if isinstance(args[0], (list, tuple)) else [args[0]]):
                self._track(o)
        elif func.namespace == "_c10d_functional" and name == "all_gather_into_tensor":
            self._track(out)
        elif func.namespace == "c10d" and name in _RS_OPS:
            self._track_rs(out)
        return out


def _run(mod, cfg, inp, ctx, overlap):
    from tpkit.gather_watch import GatherWatch
    weights = [ctx.hand(f"weights[{i}]", inp[f"W{i}"]) for i in range(len(cfg["dims"]) - 1)]
    chain = (mod.GTPChainOverlap if overlap else mod.GTPChain).from_dense(weights, group=ctx.group)
    ctx.record_params(chain)
    if overlap:   # finalize must add to .grad: layers 0, 2, .. start with a known grad, the others with none
        for i, p in enumerate(chain.parameters()):
            if f"G{i}" in inp:
                p.grad = inp[f"G{i}"].clone()                             # (out_i/t, in_i)
    x = ctx.hand("x", inp["x"]).requires_grad_(True)    # this rank's micro-batch (N/t, in_0)
    dy = inp["dy"]
    watch = GatherWatch()
    order = PrefetchOrder(ctx.ledger)
    with watch, order, watch.saved_hooks():
        ctx.phase("forward")
        y = chain(x)
        fwd_peak = watch.peak_count
        if cfg["backward"]:
            ctx.phase("backward")
            y.backward(dy)
            if overlap:
                chain.finalize_grads()    # the reduce-scatters still in flight (layer 0's) are waited here
    out = {"y": y, "peak_gathered_weights": torch.tensor(float(watch.peak_count)),
           "full_weights_saved_for_backward": torch.tensor(float(watch.saved_full)),
           FWD_AHEAD: torch.tensor(order.ahead.get("forward", []), dtype=torch.int64)}
    if cfg["backward"]:
        out["dx"] = x.grad
        shards = list(chain.parameters())
        out.update({f"dW{i}": p.grad for i, p in enumerate(shards)})
        out[BWD_AHEAD] = torch.tensor(order.ahead.get("backward", []), dtype=torch.int64)
        if overlap:
            out[RS_INFLIGHT] = torch.tensor(order.rs_inflight.get("backward", []), dtype=torch.int64)
            out[RS_INFLIGHT_DW] = torch.tensor([order.rs_at_dw.get(i, -1) for i in reversed(range(len(weights)))],
                                               dtype=torch.int64)
            out[RS_UNWAITED] = torch.tensor(float(order.unwaited("backward")))
    else:
        out["peak_gathered_weights"] = torch.tensor(float(fwd_peak))
    return out


def run_chain(mod, cfg, inp, ctx):
    return _run(mod, cfg, inp, ctx, overlap=False)


def run_overlap(mod, cfg, inp, ctx):
    """Task 3: GTPChainOverlap, whose backward defers each weight-grad reduce-scatter by one layer, then
    chain.finalize_grads(), inside the backward phase: a collective it issued would count with the backward's."""
    return _run(mod, cfg, inp, ctx, overlap=True)
