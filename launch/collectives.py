"""What the switchboard computes for one collective, once every rank of the group has posted it.

Pure functions of the posts (`launch.switchboard.Post`: a rank's op, its tensors, its header): whether the
ranks agree on the call (`disagreement`), and for each rank the tensors it gets back, the bytes the record
counts for it (the ledger's convention, `tpkit.ledger`: all-gather and gather the gathered size, reduce-scatter
and scatter the full input, all-reduce and reduce the tensor) and what else the record says (the reduce op, the
root, all-to-all split sizes and the bytes actually sent).

A rank gets back only what it would receive on gloo: a reduce's or a gather's result goes to the root alone, a
scatter's part j to rank j alone. For those rooted collectives `sent` is what each rank sends straight to (or from)
the root; for a sparse all-reduce, what an all-gather of each rank's non-zeros sends.
"""
from __future__ import annotations

import math

import torch

from launch.wire import shape_error

P2P = ("send", "recv")
BITWISE = ("band", "bor", "bxor")          # a post names these in `bitwise`, the arithmetic ones in `reduce`
REDUCING = ("all_reduce", "reduce_scatter", "reduce")
ROOTED = ("broadcast", "reduce", "gather", "scatter")


def nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def reduce_name(header: dict) -> str:
    """The reduction a post asks for ("sum", "max", "band", ...; `disagreement` has checked it)."""
    return header.get("bitwise") or header.get("reduce", "sum")


def reduce(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """Rank order, every time: every rank gets the same bits."""
    acc = xs[0].clone()
    for x in xs[1:]:
        if op in ("sum", "avg"):
            acc += x
        elif op == "product":
            acc *= x
        elif op == "max":
            torch.maximum(acc, x, out=acc)
        elif op == "min":
            torch.minimum(acc, x, out=acc)
        elif op == "band":
            torch.bitwise_and(acc, x, out=acc)
        elif op == "bor":
            torch.bitwise_or(acc, x, out=acc)
        else:
            torch.bitwise_xor(acc, x, out=acc)
    if op == "avg":              # floating point only: an integer average is refused (`disagreement`), as gloo fails it
        acc = acc / len(xs)
    return acc


def disagreement(posts) -> str:
    """Why the group's posts cannot be one collective ("" if they can)."""
    first = posts[0]
    t = len(posts)
    if len({p.op for p in posts}) > 1:
        return "different collectives"
    op = first.op
    if op not in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier", "all_to_all", "reduce",
                  "gather", "scatter"):
        return f"{op} is not a collective the switchboard knows"
    if op in REDUCING:
        problem = _reduction_disagreement(posts)
        if problem:
            return problem
    if op in ROOTED and (len({p.header.get("root") for p in posts}) > 1
                         or not 0 <= int(first.header.get("root", -1)) < t):
        return "different or invalid roots"
    if op == "all_reduce" and any("sparse" in p.header for p in posts):
        return _sparse_disagreement(posts)
    meta = [[(x.dtype, tuple(x.shape)) for x in p.tensors] for p in posts]
    if op in ("all_reduce", "broadcast", "all_gather", "reduce") and any(m != meta[0] for m in meta):
        return "tensors of different shapes or dtypes"
    if op == "gather" and (any(len(m) != 1 for m in meta) or any(m != meta[0] for m in meta)):
        return "inputs of different shapes or dtypes"
    if op == "reduce_scatter" and (any(len(p.tensors) != t for p in posts) or any(m != meta[0] for m in meta)):
        return "inputs of different sizes"
    if op == "scatter":
        return _scatter_disagreement(posts)
    if op == "all_to_all":
        return _all_to_all_disagreement(posts)
    return ""


def _reduction_disagreement(posts) -> str:
    for p in posts:
        bitwise = p.header.get("bitwise")
        if bitwise is not None and (bitwise not in BITWISE or "reduce" in p.header):
            return "a malformed reduce op"
    names = {reduce_name(p.header) for p in posts}
    if len(names) > 1:
        return "different reduce ops"
    name = names.pop()
    tensors = [x for p in posts for x in p.tensors]
    if "sparse" in posts[0].header:
        return ""                                   # values are checked with the rest of the sparse tensor
    if name == "avg" and any(not (x.is_floating_point() or x.is_complex()) for x in tensors):
        return "ReduceOp.AVG on integer tensors, which gloo cannot average"
    if name in BITWISE and any(x.is_floating_point() or x.is_complex() for x in tensors):
        return f"ReduceOp.{name.upper()} on floating-point tensors"
    return ""


def _sparse_disagreement(posts) -> str:
    """Each post of a sparse all-reduce: (indices (sparse dims, nnz) int64, values (nnz, *dense dims)) and its size."""
    size = posts[0].header.get("sparse")
    if any(p.header.get("sparse") != size for p in posts) or shape_error(size):
        return "sparse tensors of different sizes"
    if any(reduce_name(p.header) != "sum" for p in posts):
        return "a sparse all-reduce that is not a sum"
    kinds = set()
    for p in posts:
        if len(p.tensors) != 2:
            return "a malformed sparse tensor"
        idx, val = p.tensors
        sparse_dims = idx.shape[0] if idx.dim() == 2 else -1
        if idx.dtype != torch.int64 or sparse_dims < 1 or val.dim() < 1 or val.shape[0] != idx.shape[1] \
                or sparse_dims + val.dim() - 1 != len(size) or list(val.shape[1:]) != size[sparse_dims:]:
            return "a malformed sparse tensor"
        if math.prod(size[:sparse_dims]) >= 1 << 62:          # coalescing numbers the non-zeros in an int64
            return "a sparse tensor too large to sum"
        if idx.numel() and (idx.min() < 0 or bool((idx.amax(1) >= torch.tensor(size[:sparse_dims])).any())):
            return "sparse indices outside the tensor"
        kinds.add((sparse_dims, val.dtype))
    return "sparse tensors of different dtypes or sparse dims" if len(kinds) > 1 else ""


def _scatter_disagreement(posts) -> str:
    t, root = len(posts), int(posts[0].header["root"])
    parts = posts[root].tensors
    if len(parts) != t or any((x.dtype, x.shape) != (parts[0].dtype, parts[0].shape) for x in parts):
        return "a scatter list that is not one tensor of one shape per rank"
    for j, p in enumerate(posts):
        want = p.header.get("want", [])
        if len(want) != 1 or tuple(want[0]) != tuple(parts[0].shape):
            return f"rank {j} receives into {want[0] if len(want) == 1 else want} but the root scatters " \
                   f"{list(parts[0].shape)}"
        if j != root and (len(p.tensors) != 1 or p.tensors[0].numel()):
            return f"rank {j} sent a scatter list but is not the root"
        if p.tensors[0].dtype != parts[0].dtype:
            return "different dtypes"
    return ""


def _all_to_all_disagreement(posts) -> str:
    t = len(posts)
    if any(len(p.tensors) != t for p in posts) or any(len(p.header.get("out_rows", [])) != t for p in posts):
        return "split sizes of the wrong length"
    for j, p in enumerate(posts):
        for i, q in enumerate(posts):
            x = q.tensors[j]
            rows = x.shape[0] if x.dim() else 1
            if rows != int(p.header["out_rows"][i]):
                return f"rank {j} expects {p.header['out_rows'][i]} rows from rank {i}, which sends {rows}"
            if x.dtype != q.tensors[0].dtype or tuple(x.shape[1:]) != tuple(posts[0].tensors[0].shape[1:]):
                return "rows of different shapes or dtypes"
    return ""


def outcome(posts) -> list[tuple[list[torch.Tensor], int, dict]]:
    """Per post, in group order: (the tensors its rank gets back, the bytes recorded, further record fields)."""
    op, t = posts[0].op, len(posts)
    red = reduce_name(posts[0].header)
    root = int(posts[0].header.get("root", 0))
    if op == "all_reduce" and "sparse" in posts[0].header:
        return _sparse_sum(posts)
    if op == "all_reduce":
        out = [reduce([p.tensors[i] for p in posts], red) for i in range(len(posts[0].tensors))]
        return [(out, sum(nbytes(x) for x in p.tensors), {"reduce": red}) for p in posts]
    if op == "reduce":           # only the root gets the reduction; every other rank sends its tensors to it
        out = [reduce([p.tensors[i] for p in posts], red) for i in range(len(posts[0].tensors))]
        return [(out if j == root else [], sum(nbytes(x) for x in p.tensors),
                 {"reduce": red, "root": root, "sent": 0.0 if j == root else float(sum(nbytes(x) for x in p.tensors))})
                for j, p in enumerate(posts)]
    if op == "all_gather":
        parts = [p.tensors[0] for p in posts]
        return [(parts, nbytes(p.tensors[0]) * t, {}) for p in posts]
    if op == "gather":           # only the root gets every rank's tensor
        parts = [p.tensors[0] for p in posts]
        return [(parts if j == root else [], nbytes(p.tensors[0]) * t,
                 {"root": root, "sent": 0.0 if j == root else float(nbytes(p.tensors[0]))})
                for j, p in enumerate(posts)]
    if op == "scatter":          # rank j gets part j of the root's list, and nothing else
        parts = posts[root].tensors
        n = nbytes(parts[0])
        return [([parts[j]], n * t, {"root": root, "sent": float(n * (t - 1)) if j == root else 0.0,
                                     "shape": list(parts[j].shape)}) for j, p in enumerate(posts)]
    if op == "reduce_scatter":   # rank j gets the sum of every rank's part j
        return [([reduce([q.tensors[j] for q in posts], red)], sum(nbytes(x) for x in p.tensors), {"reduce": red})
                for j, p in enumerate(posts)]
    if op == "all_to_all":       # rank j gets every rank's part j, in rank order
        return [([q.tensors[j] for q in posts], sum(nbytes(x) for x in p.tensors), _all_to_all_fields(p, j))
                for j, p in enumerate(posts)]
    if op == "broadcast":
        return [(posts[root].tensors, sum(nbytes(x) for x in p.tensors), {"root": root}) for p in posts]
    return [([], 0, {}) for _ in posts]      # barrier


def _sparse_sum(posts) -> list[tuple[list[torch.Tensor], int, dict]]:
    """Every rank's non-zeros summed (gloo: an all-gather of them, then a coalesce): each rank gets the coalesced
    indices and values."""
    size = posts[0].header["sparse"]
    total = torch.sparse_coo_tensor(torch.cat([p.tensors[0] for p in posts], 1),
                                    torch.cat([p.tensors[1] for p in posts], 0), size, check_invariants=True).coalesce()
    out = [total.indices(), total.values()]
    t = len(posts)
    return [(out, nbytes(p.tensors[0]) + nbytes(p.tensors[1]),
             {"reduce": "sum", "sparse": True, "dtype": str(p.tensors[1].dtype).removeprefix("torch."),
              "shape": list(size), "sent": float((t - 1) * (nbytes(p.tensors[0]) + nbytes(p.tensors[1])))})
            for p in posts]


def _all_to_all_fields(post, j: int) -> dict:
    """Split sizes as the rank gave them ([] when even) and the bytes it sent to the OTHER ranks: with uneven
    splits (MoE dispatch) that is not (t-1)/t of anything, so it is counted row by row."""
    rows = [x.shape[0] if x.dim() else 1 for x in post.tensors]
    row_bytes = next((nbytes(x) // x.shape[0] for x in post.tensors if x.dim() and x.shape[0]), 0)
    even = bool(post.header.get("even"))
    return {"in_splits": [] if even else rows, "out_splits": [] if even else list(post.header["out_rows"]),
            "sent": float((sum(rows) - rows[j]) * row_bytes)}
