"""The course backend's kernels for torch's c10d ops on CPU: each posts this rank's tensors to the switchboard.

`launch.course_pg.register` puts them in place of gloo's CPU kernels, so a call reaches them through torch's
dispatcher exactly as it reached gloo (a dispatch mode such as tpkit's ledger still sees `c10d.allreduce_`).
A kernel takes the op's schema arguments (the group comes boxed) and returns what the schema returns: the
tensors it fills when the answer arrives, and a Work (`launch.course_pg.CourseWork`) that completes then.
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist


def unbox(work):
    """The Work a kernel returned boxed, as a group's method must return it."""
    return dist.Work.unbox(work)


_OP_NAMES = {0: "sum", 1: "avg", 2: "product", 3: "min", 4: "max"}
_UNSUPPORTED_OP = "this reduce op is not supported by the grader's backend: use SUM, AVG, PRODUCT, MIN or MAX"
_handed_op = threading.local()


def script_op(op) -> object:
    """A ReduceOp as the c10d ops take it. Python cannot make one of a given kind, so the kind goes to the
    kernel beside it (`_reduce`), for the call made right after on this thread."""
    for name in _OP_NAMES.values():
        if op == getattr(dist.ReduceOp, name.upper()):
            _handed_op.name = name
            return torch.classes.c10d.ReduceOp()
    raise ValueError(_UNSUPPORTED_OP)


def _reduce(op) -> str:
    """The reduce op's name ("sum", "max", ...): handed beside it by `script_op`, else read from it."""
    name, _handed_op.name = getattr(_handed_op, "name", None), None
    if name:
        return name
    if op.op() not in _OP_NAMES:
        raise ValueError(_UNSUPPORTED_OP)
    return _OP_NAMES[op.op()]


def _post(pg, op: str, tensors, deliver, **extra):
    g = dist.ProcessGroup.unbox(pg)
    return g.link.post({"op": op, "group": g.name_, "ranks": g.ranks, **extra}, list(tensors), deliver)


def _copy_into(outs):
    def deliver(res):
        for o, r in zip(outs, res):
            o.copy_(r.view_as(o))
    return deliver


# -- the kernels: (the op's arguments) -> what its schema returns ---------------------------------------------
def _allreduce(tensors, pg, op, sparse_indices=None, async_op=True, timeout=-1):
    return tensors, _post(pg, "all_reduce", tensors, _copy_into(tensors), reduce=_reduce(op)).boxed()


def _allreduce_coalesced(tensors, pg, op, async_op=True, timeout=-1):
    return _post(pg, "all_reduce", tensors, _copy_into(tensors), reduce=_reduce(op)).boxed()


def _allgather(outputs, inputs, pg, async_op=True, timeout=-1):
    return outputs, _post(pg, "all_gather", inputs[:1], _copy_into(outputs[0])).boxed()


def _allgather_base(out, inp, pg, async_op=True, timeout=-1):
    def deliver(res):
        out.copy_(torch.cat([r.reshape(-1) for r in res]).view_as(out))
    return out, _post(pg, "all_gather", [inp], deliver).boxed()


def _allgather_into_tensor_coalesced(outs, inps, pg, async_op=True):
    return [_allgather_base(o, i, pg)[1] for o, i in zip(outs, inps)][-1]   # answered in order: the last is all


def _reduce_scatter(outputs, inputs, pg, op, async_op=True, timeout=-1):
    return outputs, _post(pg, "reduce_scatter", inputs[0], _copy_into(outputs[:1]), reduce=_reduce(op)).boxed()


def _reduce_scatter_base(out, inp, pg, op, async_op=True, timeout=-1):
    t = dist.ProcessGroup.unbox(pg).size()
    if inp.numel() != t * out.numel():
        raise ValueError(f"reduce_scatter: the input has {inp.numel()} elements, not {t} x the output's {out.numel()}")
    parts = list(inp.reshape(-1).chunk(t))                 # rank r's share of the sum is part r
    return out, _post(pg, "reduce_scatter", parts, _copy_into([out]), reduce=_reduce(op)).boxed()


def _reduce_scatter_tensor_coalesced(outs, inps, pg, op, async_op=True, timeout=-1):
    return [_reduce_scatter_base(o, i, pg, op)[1] for o, i in zip(outs, inps)][-1]


def _alltoall_base(out, inp, pg, out_splits, in_splits, async_op=True, timeout=-1):
    t = dist.ProcessGroup.unbox(pg).size()
    rows_in = list(in_splits) or [inp.shape[0] // t] * t
    rows_out = list(out_splits) or [out.shape[0] // t] * t
    if sum(rows_in) != inp.shape[0] or sum(rows_out) != out.shape[0]:
        raise ValueError(f"all_to_all_single: split sizes {rows_in} / {rows_out} do not add up to the input's "
                         f"{inp.shape[0]} / the output's {out.shape[0]} rows")

    def deliver(res):                      # the rows every rank sent to this one, in rank order
        if res:
            out.copy_(torch.cat(res).view_as(out))
    return _post(pg, "all_to_all", list(inp.split(rows_in)), deliver, out_rows=rows_out,
                 even=not in_splits and not out_splits).boxed()


def _alltoall(outs, inps, pg, async_op=True, timeout=-1):
    rows = [o.shape[0] if o.dim() else 1 for o in outs]
    return outs, _post(pg, "all_to_all", inps, _copy_into(outs), out_rows=rows, even=False).boxed()


def _broadcast(tensors, pg, root_rank, root_tensor=0, async_op=True, timeout=-1):
    return tensors, _post(pg, "broadcast", tensors, _copy_into(tensors), root=root_rank).boxed()


def _barrier(tensor, pg, device_ids, async_op=True, timeout=-1):
    return _post(pg, "barrier", [], lambda res: None).boxed()


def _send(tensors, pg, dst, tag):
    # a send completes when its recv is posted (rendezvous), as NCCL's does: code that relies on a buffered
    # send deadlocks on a GPU, and is told so here
    return _post(pg, "send", tensors, lambda res: None, peer=dst, tag=tag).boxed()


def _recv(tensors, pg, src, tag):
    return _post(pg, "recv", [torch.empty(0, dtype=t.dtype) for t in tensors], _copy_into(tensors), peer=src, tag=tag,
                 want=[list(t.shape) for t in tensors]).boxed()


def _unsupported(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"dist.{name} is not supported by the grader's backend: use all_reduce, "
                                  "all_gather, reduce_scatter, all_to_all, broadcast, barrier, send and recv")
    return kernel


KERNELS = {"allreduce_": _allreduce, "allreduce_coalesced_": _allreduce_coalesced, "allgather_": _allgather,
           "_allgather_base_": _allgather_base, "allgather_into_tensor_coalesced_": _allgather_into_tensor_coalesced,
           "reduce_scatter_": _reduce_scatter, "_reduce_scatter_base_": _reduce_scatter_base,
           "reduce_scatter_tensor_coalesced_": _reduce_scatter_tensor_coalesced, "alltoall_base_": _alltoall_base,
           "alltoall_": _alltoall, "broadcast_": _broadcast, "barrier": _barrier, "send": _send, "recv_": _recv,
           **{n: _unsupported(n.strip("_")) for n in ("allgather_coalesced_", "gather_", "scatter_", "reduce_",
                                                     "recv_any_source_")}}


