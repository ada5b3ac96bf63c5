"""The course backend's kernels for torch's c10d ops on CPU: each posts this rank's tensors to the switchboard.

`launch.course_pg.register` puts them in place of gloo's CPU kernels, so a call reaches them through torch's
dispatcher exactly as it reached gloo (a dispatch mode such as tpkit's ledger still sees `c10d.allreduce_`).
A kernel takes the op's schema arguments (the group comes boxed) and returns what the schema returns: the
tensors it fills when the answer arrives, and a Work (`launch.course_pg.CourseWork`) that completes then. The
Work's future (and `Work.result()`) carries what gloo's carries: the op's output tensors.

What gloo refuses is refused here too, before anything is posted, with what to use instead (`GlooRefuses`): code
that passes in grading then runs on a student's CPU, and the grader never answers a call gloo could not.
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist


def unbox(work):
    """The Work a kernel returned boxed, as a group's method must return it."""
    return dist.Work.unbox(work)


class GlooRefuses(RuntimeError):
    """A call gloo rejects (or gets wrong): the grader's backend rejects it as well, and says what to use."""


_OP_NAMES = {0: "sum", 1: "avg", 2: "product", 3: "min", 4: "max", 5: "band", 6: "bor", 7: "bxor"}
BITWISE = ("band", "bor", "bxor")
_UNSUPPORTED_OP = ("this reduce op is not supported by gloo nor by the grader's backend: use SUM, AVG, PRODUCT, MIN, "
                   "MAX, BAND, BOR or BXOR (PREMUL_SUM is NCCL's: scale the tensor, then SUM)")
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
    """The reduce op's name ("sum", "max", "band", ...): handed beside it by `script_op`, else read from it."""
    name, _handed_op.name = getattr(_handed_op, "name", None), None
    if name:
        return name
    if op.op() not in _OP_NAMES:
        raise ValueError(_UNSUPPORTED_OP)
    return _OP_NAMES[op.op()]


def _reduce_fields(what: str, name: str, tensors) -> dict:
    """The header fields naming the reduction, once this rank's tensors are known to suit it (as gloo decides)."""
    for x in tensors:
        if name == "avg" and not (x.is_floating_point() or x.is_complex()):
            raise GlooRefuses(
                f"{what} with ReduceOp.AVG on a {_dtype(x)} tensor: gloo cannot average integers or booleans (it fails "
                "with \"result type Float can't be cast to the desired output type\"), so the grader refuses it too. "
                "Reduce with ReduceOp.SUM and divide by the group's size yourself (// for a floor), or average a "
                "floating-point copy.")
        if name in BITWISE and (x.is_floating_point() or x.is_complex()):
            raise GlooRefuses(f"Cannot use ReduceOp.{name.upper()} with non-integral dtype {_dtype(x)}: {what} with a "
                              "bitwise reduction takes integer or bool tensors (as on gloo)")
    # the switchboard names the arithmetic reductions `reduce`, the bitwise ones `bitwise`
    return {"bitwise": name} if name in BITWISE else {"reduce": name}


def _dtype(x) -> str:
    return str(x.dtype).removeprefix("torch.")


def _group(pg):
    return dist.ProcessGroup.unbox(pg)


def _post(pg, op: str, tensors, deliver, result=(), **extra):
    """`result`: the Work's value (its future's and `result()`'s), as gloo gives it: the op's output tensors."""
    g = _group(pg)
    return g.link.post({"op": op, "group": g.name_, "ranks": g.ranks, **extra}, list(tensors), deliver, list(result))


def _copy_into(outs):
    def deliver(res):
        for o, r in zip(outs, res):
            o.copy_(r.view_as(o))
    return deliver


def _same_meta(what: str, x, like, names: tuple[str, str]):
    """gloo's check that an output fits its input exactly (shape and dtype, not only the number of elements)."""
    if x.dtype != like.dtype or tuple(x.shape) != tuple(like.shape):
        raise GlooRefuses(f"{what}: {names[0]} is {_dtype(x)} {tuple(x.shape)}, but {names[1]} is {_dtype(like)} "
                          f"{tuple(like.shape)}: gloo needs every one of the same shape and dtype")


# -- the kernels: (the op's arguments) -> what its schema returns ---------------------------------------------
def _allreduce(tensors, pg, op, sparse_indices=None, async_op=True, timeout=-1):
    name = _reduce(op)
    if any(x.layout == torch.sparse_coo for x in tensors):
        return tensors, _sparse_allreduce(tensors, pg, name)
    fields = _reduce_fields("all_reduce", name, tensors)
    return tensors, _post(pg, "all_reduce", tensors, _copy_into(tensors), tensors, **fields).boxed()


def _sparse_allreduce(tensors, pg, name: str):
    """A sparse COO all-reduce, as gloo does it: every rank's non-zeros (coalesced) are summed; each rank's tensor
    becomes the coalesced sum."""
    if name != "sum" or len(tensors) != 1:
        raise GlooRefuses("a sparse all_reduce sums one sparse COO tensor (gloo supports only ReduceOp.SUM for sparse "
                          "tensors): all_reduce a dense copy (x.to_dense()) for other reductions")
    x = tensors[0]
    mine = x.coalesce()

    def deliver(res):
        x.copy_(torch.sparse_coo_tensor(res[0], res[1], x.shape, check_invariants=False).coalesce())
    return _post(pg, "all_reduce", [mine.indices(), mine.values()], deliver, tensors, reduce="sum",
                 sparse=list(x.shape)).boxed()


def _allreduce_coalesced(tensors, pg, op, async_op=True, timeout=-1):
    fields = _reduce_fields("all_reduce_coalesced", _reduce(op), tensors)
    return _post(pg, "all_reduce", tensors, _copy_into(tensors), tensors, **fields).boxed()


def _allgather(outputs, inputs, pg, async_op=True, timeout=-1):
    t = _group(pg).size()
    if len(inputs) != 1 or len(outputs) != 1 or len(outputs[0]) != t:
        raise GlooRefuses(f"all_gather: the output list has {len(outputs[0]) if outputs else 0} tensors, not one per "
                          f"rank of the group ({t})")
    for i, o in enumerate(outputs[0]):
        _same_meta("all_gather", o, inputs[0], (f"output tensor {i}", "the input"))
    return outputs, _post(pg, "all_gather", inputs[:1], _copy_into(outputs[0]), outputs[0]).boxed()


def _concatenated(what: str, full, part, t: int, names: tuple[str, str], fix: str):
    """gloo's rule for the one-tensor gather and scatter: the full tensor is the t parts concatenated along dim 0."""
    want = (t * part.shape[0],) + tuple(part.shape[1:]) if part.dim() else None
    if want is None or tuple(full.shape) != want or full.dtype != part.dtype:
        shape = f"({', '.join(str(s) for s in want)})" if want else "(t * n, ...) of parts with a dim 0"
        raise GlooRefuses(
            f"{what}: {names[0]} is {_dtype(full)} {tuple(full.shape)} and {names[1]} {_dtype(part)} "
            f"{tuple(part.shape)}, but gloo takes only the {t} parts concatenated along dim 0, {_dtype(part)} {shape}; "
            f"NCCL also takes a stacked (t, n, ...) or flat layout, gloo rejects it and so does the grader. {fix}")


_GATHER_FIX = ("Allocate the output as x.new_empty(t * x.shape[0], *x.shape[1:]) and view it after "
               "(.view(t, *x.shape) for the stacked layout), or use dist.all_gather with one tensor per rank.")
_SCATTER_FIX = ("Flatten a stacked (t, n, ...) input with .flatten(0, 1) (for a 0-dim output, reduce into a (1,) "
                "one from a (t,) input), or use dist.reduce_scatter with one tensor per rank.")


def _allgather_base_work(out, inp, pg, result=None):
    t = _group(pg).size()
    _concatenated("all_gather_single (all_gather_into_tensor)", out, inp, t, ("the output", "the input"), _GATHER_FIX)

    def deliver(res):
        out.copy_(torch.cat([r.reshape(-1) for r in res]).view_as(out))
    return _post(pg, "all_gather", [inp], deliver, list(out.chunk(t)) if result is None else result)  # gloo's: chunks


def _allgather_base(out, inp, pg, async_op=True, timeout=-1):
    return out, _allgather_base_work(out, inp, pg).boxed()


def _allgather_into_tensor_coalesced(outs, inps, pg, async_op=True):
    # answered in order: the last one done is all done, so its value is every output
    works = [_allgather_base_work(o, i, pg, list(outs) if n == len(outs) - 1 else None)
             for n, (o, i) in enumerate(zip(outs, inps))]
    return works[-1].boxed()


def _allgather_coalesced(output_lists, input_list, pg, async_op=True):
    """One all-gather per input tensor (answered in order: the last Work is done when all are)."""
    t = _group(pg).size()
    if len(output_lists) != t:
        raise GlooRefuses(f"all_gather_coalesced: {len(output_lists)} output lists, not one per rank of the group "
                          f"({t})")
    for j, outs in enumerate(output_lists):
        if len(outs) != len(input_list):
            raise GlooRefuses(f"all_gather_coalesced: output list {j} has {len(outs)} tensors, the input list "
                              f"{len(input_list)}: each output list holds one tensor per input tensor")
        for i, (o, x) in enumerate(zip(outs, input_list)):
            _same_meta("all_gather_coalesced", o, x, (f"output [{j}][{i}]", f"input {i}"))
    value = [list(outs) for outs in output_lists]
    if not input_list:
        return _post(pg, "barrier", [], lambda res: None, value).boxed()
    works = [_post(pg, "all_gather", [x], _copy_into([outs[i] for outs in output_lists]),
                   value if i == len(input_list) - 1 else ()) for i, x in enumerate(input_list)]
    return works[-1].boxed()


def _reduce_scatter(outputs, inputs, pg, op, async_op=True, timeout=-1):
    t = _group(pg).size()
    if len(outputs) != 1 or len(inputs) != 1 or len(inputs[0]) != t:
        raise GlooRefuses(f"reduce_scatter: the input list has {len(inputs[0]) if inputs else 0} tensors, not one per "
                          f"rank of the group ({t})")
    for i, x in enumerate(inputs[0]):
        _same_meta("reduce_scatter", x, outputs[0], (f"input tensor {i}", "the output"))
    fields = _reduce_fields("reduce_scatter", _reduce(op), inputs[0])
    return outputs, _post(pg, "reduce_scatter", inputs[0], _copy_into(outputs[:1]), outputs[:1], **fields).boxed()


def _reduce_scatter_base_work(out, inp, pg, name: str, result):
    t = _group(pg).size()
    _concatenated("reduce_scatter_single (reduce_scatter_tensor)", inp, out, t, ("the input", "the output"),
                  _SCATTER_FIX)
    fields = _reduce_fields("reduce_scatter", name, [inp])
    parts = list(inp.chunk(t))                             # rank r's share of the sum is part r
    return _post(pg, "reduce_scatter", parts, _copy_into([out]), result, **fields)


def _reduce_scatter_base(out, inp, pg, op, async_op=True, timeout=-1):
    return out, _reduce_scatter_base_work(out, inp, pg, _reduce(op), [out]).boxed()


def _reduce_scatter_tensor_coalesced(outs, inps, pg, op, async_op=True, timeout=-1):
    name = _reduce(op)                 # read once: the kind handed beside `op` is for one call
    works = [_reduce_scatter_base_work(o, i, pg, name, list(outs) if n == len(outs) - 1 else ())
             for n, (o, i) in enumerate(zip(outs, inps))]
    return works[-1].boxed()


def _alltoall_base(out, inp, pg, out_splits, in_splits, async_op=True, timeout=-1):
    t = _group(pg).size()
    rows_in = list(in_splits) or [inp.shape[0] // t] * t
    rows_out = list(out_splits) or [out.shape[0] // t] * t
    if sum(rows_in) != inp.shape[0] or sum(rows_out) != out.shape[0]:
        raise ValueError(f"all_to_all_single: split sizes {rows_in} / {rows_out} do not add up to the input's "
                         f"{inp.shape[0]} / the output's {out.shape[0]} rows")

    def deliver(res):                      # the rows every rank sent to this one, in rank order
        if res:
            out.copy_(torch.cat(res).view_as(out))
    return _post(pg, "all_to_all", list(inp.split(rows_in)), deliver, [out], out_rows=rows_out,
                 even=not in_splits and not out_splits).boxed()


def _alltoall(outs, inps, pg, async_op=True, timeout=-1):
    t = _group(pg).size()
    if len(inps) != t or len(outs) != t:
        raise GlooRefuses(f"all_to_all: {len(inps)} input and {len(outs)} output tensors, not one per rank of the "
                          f"group ({t})")
    for i, x in enumerate(list(inps) + list(outs)):
        name = f"input tensor {i}" if i < t else f"output tensor {i - t}"
        if x.dtype != inps[0].dtype or tuple(x.shape) != tuple(inps[0].shape):
            raise GlooRefuses(
                f"all_to_all: {name} is {_dtype(x)} {tuple(x.shape)} but input tensor 0 is {_dtype(inps[0])} "
                f"{tuple(inps[0].shape)}: gloo's all_to_all takes tensors of one shape only. For uneven parts use "
                "dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes) on the parts "
                "concatenated along dim 0")
    rows = [o.shape[0] if o.dim() else 1 for o in outs]
    return outs, _post(pg, "all_to_all", inps, _copy_into(outs), outs, out_rows=rows, even=False).boxed()


def _broadcast(tensors, pg, root_rank, root_tensor=0, async_op=True, timeout=-1):
    return tensors, _post(pg, "broadcast", tensors, _copy_into(tensors), tensors, root=root_rank).boxed()


def _reduce_to_root(tensors, pg, op, root_rank, root_tensor=0, async_op=True, timeout=-1):
    """dist.reduce: only the root receives the reduction (the others' tensors are left as they were, as on gloo)."""
    fields = _reduce_fields("reduce", _reduce(op), tensors)
    return _post(pg, "reduce", tensors, _copy_into(tensors), tensors, root=root_rank, **fields).boxed()


def _root_list(op: str, lists, mine, is_root: bool, t: int, words: tuple[str, str, str]) -> list:
    """The root's list of one tensor per rank (gather's outputs, scatter's inputs), each like this rank's own
    `mine`, checked as gloo checks it; [] on any other rank, which must pass none. words: (the list's side, `mine`'s
    side, the root's name)."""
    side, other, root = words
    if not is_root:
        if lists and any(len(x) for x in lists):
            raise GlooRefuses(f"{op}: only the {root} rank takes a {op} list (pass {op}_list=None elsewhere)")
        return []
    if len(lists) != 1 or len(lists[0]) != t:
        n = len(lists[0]) if len(lists) == 1 else len(lists)
        raise GlooRefuses(f"{op}: Incorrect {side} list size {n}. {side.capitalize()} list size should be {t}, same as "
                          f"size of the process group (one tensor per rank: gloo takes no stacked {side})")
    for i, x in enumerate(lists[0]):
        _same_meta(op, x, mine, (f"{side} tensor {i}", f"the {other}"))
    return list(lists[0])


def _gather(output_tensors, input_tensors, pg, root_rank, async_op=True, timeout=-1):
    g = _group(pg)
    t = g.size()
    if len(input_tensors) != 1:
        raise GlooRefuses(f"gather: {len(input_tensors)} input tensors, not one")
    inp = input_tensors[0]
    outs = _root_list("gather", output_tensors, inp, g.rank() == root_rank, t, ("output", "input", "destination"))
    return _post(pg, "gather", [inp], _copy_into(outs), outs, root=root_rank).boxed()


def _scatter(output_tensors, input_tensors, pg, root_rank, async_op=True, timeout=-1):
    g = _group(pg)
    t = g.size()
    if len(output_tensors) != 1:
        raise GlooRefuses(f"scatter: {len(output_tensors)} output tensors, not one")
    out = output_tensors[0]
    parts = _root_list("scatter", input_tensors, out, g.rank() == root_rank, t, ("input", "output", "source")) \
        or [torch.empty(0, dtype=out.dtype)]                # nothing sent: the dtype says what it receives
    work = _post(pg, "scatter", parts, _copy_into([out]), [out], root=root_rank, want=[list(out.shape)])
    return output_tensors, work.boxed()


def _barrier(tensor, pg, device_ids, async_op=True, timeout=-1):
    return _post(pg, "barrier", [], lambda res: None).boxed()


def _not_self(what: str, pg, peer: int):
    if peer == _group(pg).rank():
        raise GlooRefuses(f"{what} this rank itself: gloo cannot (its connection to itself is never made) and "
                          "dist.send / dist.recv refuse it; use the tensor you have (x.clone()) instead")


def _send(tensors, pg, dst, tag):
    # a send completes when its recv is posted (rendezvous), as NCCL's does: code that relies on a buffered
    # send deadlocks on a GPU, and is told so here
    _not_self("send to", pg, dst)
    return _post(pg, "send", tensors, lambda res: None, tensors, peer=dst, tag=tag).boxed()


def _recv(tensors, pg, src, tag):
    _not_self("recv from", pg, src)
    return _post(pg, "recv", [torch.empty(0, dtype=t.dtype) for t in tensors], _copy_into(tensors), tensors, peer=src,
                 tag=tag, want=[list(t.shape) for t in tensors]).boxed()


def _recv_any_source(tensors, pg, tag):
    """A recv from whichever rank's send comes first; `Work._source_rank()` names it (the switchboard says)."""
    return _post(pg, "recv", [torch.empty(0, dtype=t.dtype) for t in tensors], _copy_into(tensors), tensors, peer=-1,
                 any_source=True, tag=tag, want=[list(t.shape) for t in tensors]).boxed()


KERNELS = {"allreduce_": _allreduce, "allreduce_coalesced_": _allreduce_coalesced, "allgather_": _allgather,
           "_allgather_base_": _allgather_base, "allgather_into_tensor_coalesced_": _allgather_into_tensor_coalesced,
           "allgather_coalesced_": _allgather_coalesced, "reduce_scatter_": _reduce_scatter,
           "_reduce_scatter_base_": _reduce_scatter_base,
           "reduce_scatter_tensor_coalesced_": _reduce_scatter_tensor_coalesced, "alltoall_base_": _alltoall_base,
           "alltoall_": _alltoall, "broadcast_": _broadcast, "reduce_": _reduce_to_root, "gather_": _gather,
           "scatter_": _scatter, "barrier": _barrier, "send": _send,
           "recv_": _recv, "recv_any_source_": _recv_any_source}
SPARSE_KERNELS = {"allreduce_": _allreduce}     # gloo's sparse all-reduce: the op dispatches on SparseCPU
