"""CommLedger: every collective a rank issues, with its phase and bytes, seen at the dispatcher.

A TorchDispatchMode sees each `torch.ops.c10d.*` and `_c10d_functional.*` op before it
runs, whatever Python wrapper the student called (dist.all_reduce, the deprecated
all_gather_into_tensor, a P2POp batch, functional collectives), in forward and in the
autograd backward alike. Nothing in torch.distributed is patched.

Bytes are logical, never inferred from timings (gloo emulates reduce-scatter with
all-reduce internally). For one tensor of N bytes on a group of t ranks, a ring sends
per rank: all-reduce 2(t-1)/t N, all-gather and reduce-scatter (t-1)/t N (N = the full,
gathered size), send N; an all-to-all the rows it sends to the other ranks ((t-1)/t N when even; with
split sizes the entry also records them).
"""
from __future__ import annotations

from collections import Counter

import torch
from tpkit.dispatch import MeasuringMode
from tpkit.progress import ProgressFile

# dispatcher op name -> the course's name for it
_OPS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast_": "broadcast", "broadcast": "broadcast", "reduce_": "reduce",
    "alltoall_base_": "all_to_all", "alltoall_": "all_to_all", "all_to_all_single": "all_to_all",
    "gather_": "gather", "scatter_": "scatter",
    "send": "send", "recv_": "recv", "recv_any_source_": "recv",
    "barrier": "barrier", "monitored_barrier_": "barrier",
}
P2P = {"send", "recv"}


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)


def _nbytes(obj) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(obj))


def _group_size(group_name: str, default: int) -> int:
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group
        return _resolve_process_group(group_name).size()
    except Exception:
        return default


def _all_to_all_single(args, functional: bool, t: int) -> dict:
    """all_to_all_single's split sizes (rows of dim 0; [] = even) and the bytes this rank sends to the OTHER
    ranks: with uneven splits (MoE dispatch) that is not (t-1)/t of anything, so it is counted row by row.
    The dispatcher's args: functional (input, output_splits, input_splits, group_name), else
    (output, input, process_group, output_splits, input_splits, ...)."""
    inp, out_splits, in_splits, pg = ((args[0], args[1], args[2], args[3]) if functional
                                      else (args[1], args[3], args[4], args[2]))
    try:
        if isinstance(pg, str):
            from torch.distributed.distributed_c10d import _resolve_process_group
            me = _resolve_process_group(pg).rank()
        else:
            me = torch.distributed.ProcessGroup.unbox(pg).rank()
    except Exception:
        return {}
    rows = list(in_splits) or [inp.shape[0] // t] * t
    row_bytes = inp[0].numel() * inp.element_size() if inp.dim() and inp.shape[0] else 0
    return {"bytes": int(inp.numel() * inp.element_size()), "in_splits": list(in_splits),
            "out_splits": list(out_splits), "sent": float((sum(rows) - rows[me]) * row_bytes)}


_REDUCE_OPS = {0: "sum", 1: "avg", 2: "product", 3: "min", 4: "max", 5: "band", 6: "bor", 7: "bxor", 8: "premul_sum"}


def _reduce_op(args, functional: bool) -> str:
    """"sum", "max", ...: a functional op names it; a c10d op passes a ReduceOp object."""
    for a in args[1:]:
        if functional and isinstance(a, str):
            return a.lower()
        if isinstance(a, torch.ScriptObject) and "ReduceOp" in str(a._type()):
            return _REDUCE_OPS.get(int(a.op()), "other")
    return "sum"


def ring_bytes_sent(op: str, full_bytes: int, t: int) -> float:
    """Bytes one rank sends for `op` on a ring of t ranks (full_bytes = the full tensor)."""
    if t <= 1:
        return 0.0
    return {"all_reduce": 2 * (t - 1) / t * full_bytes, "all_gather": (t - 1) / t * full_bytes,
            "reduce_scatter": (t - 1) / t * full_bytes, "all_to_all": (t - 1) / t * full_bytes,
            "send": full_bytes}.get(op, 0.0)


class CommLedger(MeasuringMode):
    """Record collectives. `phase` tags entries (e.g. "forward", "backward").

    progress_file: rewritten (`tpkit.progress`) before and after each collective, so a trusted process can say
    where a rank was when a job hung ("rank 2 was still in all_reduce #3 (forward)").
    """

    def __init__(self, group_size: int = 1, progress_file: str | None = None, label: str = ""):
        super().__init__()
        self.label = label
        self.group_size = group_size
        self.phase = "setup"
        self.entries: list[dict] = []
        self.progress_file = progress_file

    def set_phase(self, phase: str):
        self.phase = phase
        self._progress("between collectives")

    def _progress(self, where: str, entry: dict | None = None):
        if not self.progress_file:
            return
        n = Counter(e["op"] for e in self.entries)
        state = {"item": self.label, "phase": self.phase, "where": where, "done": dict(n)}
        if entry is not None:
            state["op"] = entry["op"]
            state["index"] = entry["index"]
        ProgressFile.at(self.progress_file).write(state)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # A mode runs before tensor subclasses and is off while its handler runs, so collectives a
        # DTensor op issues (loss_parallel's all-reduces, redistributions) would go unseen. Let
        # DTensor handle the op first; its collectives on local tensors come back through here
        # (CommDebugMode does the same). FakeTensor, used for sharding propagation, goes through.
        if any(t.__name__ == "DTensor" for t in types):
            return NotImplemented
        ns = func.namespace
        if ns in ("c10d", "_c10d_functional"):
            name = _OPS.get(func._opname)
            if name is not None:
                entry = self._entry(name, args, functional=ns == "_c10d_functional")
                self._progress("inside", entry)
                out = func(*args, **kwargs)
                self.entries.append(entry)
                self._progress("between collectives")
                return out
        return func(*args, **kwargs)

    def _entry(self, op: str, args, functional: bool = False) -> dict:
        tensors = list(_tensors(args))
        t = self.group_size
        if functional and args and isinstance(args[0], torch.Tensor):
            # functional ops: (input, [reduce_op,] group_size, group_name); the group is the op's own
            # (a 2-D mesh mixes groups of different sizes)
            full = _nbytes(args[0])
            sizes = [a for a in args[1:] if isinstance(a, int) and not isinstance(a, bool)]
            names = [a for a in args[1:] if isinstance(a, str)]
            if sizes:
                t = sizes[0]
            elif names:
                t = _group_size(names[-1], t)
            if op == "all_gather":
                full *= t                 # the input is this rank's shard
        elif op == "all_gather":      # (output, input, ...): count the gathered size
            full = _nbytes(args[0])
        elif op == "reduce_scatter":  # (output, input, ...): count the input size
            full = _nbytes(args[1]) if len(args) > 1 else _nbytes(args[0])
        else:
            full = _nbytes(args[0]) if args else 0
        dtype = str(tensors[0].dtype).replace("torch.", "") if tensors else ""
        shape = list(tensors[0].shape) if tensors else []
        index = sum(1 for e in self.entries if e["op"] == op) + 1
        entry = {"phase": self.phase, "op": op, "index": index, "bytes": int(full), "dtype": dtype, "shape": shape,
                 "sent": float(ring_bytes_sent(op, full, t)), "group": t}
        if op == "all_to_all" and args and isinstance(args[0], torch.Tensor):
            entry.update(_all_to_all_single(args, functional, t))
        if op in ("all_reduce", "reduce_scatter"):
            entry["reduce"] = _reduce_op(args, functional)
        return entry

    # summaries -------------------------------------------------------------
    def counts(self, phase: str | None = None) -> dict[str, int]:
        return dict(Counter(e["op"] for e in self.entries if phase is None or e["phase"] == phase))

    def bytes_sent(self, phase: str | None = None) -> float:
        return sum(e["sent"] for e in self.entries if phase is None or e["phase"] == phase)

    def table(self) -> str:
        rows = [f"{'phase':<9} {'op':<15} {'count':>5} {'bytes':>10} {'sent/rank':>10}"]
        keys = sorted({(e["phase"], e["op"]) for e in self.entries})
        for ph, op in keys:
            es = [e for e in self.entries if (e["phase"], e["op"]) == (ph, op)]
            rows.append(f"{ph:<9} {op:<15} {len(es):>5} {sum(e['bytes'] for e in es):>10} "
                        f"{sum(e['sent'] for e in es):>10.0f}")
        return "\n".join(rows)
