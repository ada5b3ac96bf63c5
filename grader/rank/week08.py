"""Week 8 on a rank: build the student's GTPChain from the dense weights (each rank keeps its rows of every
weight), run this rank's micro-batch forward (and backward) under tpkit.gather_watch.GatherWatch, and return
the output, the input grad, this rank's weight-grad shards and what the watch saw: the most gathered full
weights alive at once, and how many full weights were saved for backward; and, from a dispatch mode that sees
every all-gather launch and every GEMM in order, how many gathers had been launched after each weight's own
when its GEMM ran (the prefetch: 1 = the next weight, 0 at the last one)."""
from __future__ import annotations

import os

import torch


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
_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "mv", "addmv", "_addmm_activation", "dot"}


def _prefetch_order(ledger):
    """A dispatch mode that sees, in each phase, every all-gather launch and every GEMM: at the first GEMM that
    reads a gathered buffer (or a view of it), it records how many gathers of that phase were launched after
    that buffer's own. Defined per call, so nothing at module level stands between the student and it."""
    import weakref

    from tpkit.dispatch import MeasuringMode

    class PrefetchOrder(MeasuringMode):
        def __init__(self):
            super().__init__()
            self.gathers: dict[str, list] = {}     # phase -> [(weakref to the buffer, storage ptr, read yet)]
            self.ahead: dict[str, list] = {}       # phase -> [later gathers launched, per weight, at its GEMM]

        @staticmethod
        def _ptr(t):
            try:
                return t.untyped_storage().data_ptr() if t.untyped_storage().nbytes() > 0 else None
            except Exception:      # noqa: BLE001
                return None

        def _track(self, out):
            if isinstance(out, torch.Tensor):
                self.gathers.setdefault(ledger.phase, []).append([weakref.ref(out), self._ptr(out), False])

        def _gemm(self, args):
            mine = self.gathers.get(ledger.phase, [])
            ptrs = set()
            for a in args:
                for t in (a if isinstance(a, (list, tuple)) else [a]):
                    if isinstance(t, torch.Tensor):
                        ptrs.add(self._ptr(t))
            for j in range(len(mine) - 1, -1, -1):    # the newest live buffer with that storage
                ref, ptr, read = mine[j]
                if ptr is not None and ptr in ptrs and ref() is not None and self._ptr(ref()) == ptr:
                    if not read:
                        mine[j][2] = True
                        self.ahead.setdefault(ledger.phase, []).append(len(mine) - (j + 1))
                    return

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func._opname
            if func.namespace == "aten" and name in _GEMMS:
                self._gemm(args)
            out = func(*args, **kwargs)
            if func.namespace == "c10d" and name in ("_allgather_base_", "allgather_into_tensor_coalesced_") and args:
                for o in (args[0] if isinstance(args[0], (list, tuple)) else [args[0]]):
                    self._track(o)
            elif func.namespace == "_c10d_functional" and name == "all_gather_into_tensor":
                self._track(out)
            return out

    return PrefetchOrder()


def run_chain(mod, cfg, inp, ctx):
    from tpkit.gather_watch import GatherWatch
    weights = [ctx.hand(f"weights[{i}]", inp[f"W{i}"]) for i in range(len(cfg["dims"]) - 1)]
    chain = mod.GTPChain.from_dense(weights, group=ctx.group)
    ctx.record_params(chain)
    x = ctx.hand("x", ctx.shard(inp["x"], 0)).requires_grad_(True)    # this rank's micro-batch
    dy = ctx.shard(inp["dy"], 0)
    watch = GatherWatch()
    order = _prefetch_order(ctx.ledger)
    with watch, order, watch.saved_hooks():
        ctx.phase("forward")
        y = chain(x)
        fwd_peak = watch.peak_count
        if cfg["backward"]:
            ctx.phase("backward")
            y.backward(dy)
    out = {"y": y, "peak_gathered_weights": torch.tensor(float(watch.peak_count)),
           "full_weights_saved_for_backward": torch.tensor(float(watch.saved_full)),
           FWD_AHEAD: torch.tensor(order.ahead.get("forward", []), dtype=torch.int64)}
    if cfg["backward"]:
        out["dx"] = x.grad
        shards = list(chain.parameters())
        out.update({f"dW{i}": p.grad for i, p in enumerate(shards)})
        out[BWD_AHEAD] = torch.tensor(order.ahead.get("backward", []), dtype=torch.int64)
    else:
        out["peak_gathered_weights"] = torch.tensor(float(fwd_peak))
    return out
