"""What the switchboard computes for one collective, once every rank of the group has posted it.

Pure functions of the posts (`launch.switchboard.Post`: a rank's op, its tensors, its header): whether the
ranks agree on the call (`disagreement`), and for each rank the tensors it gets back, the bytes the record
counts for it (the ledger's convention, `tpkit.ledger`: all-gather the gathered size, reduce-scatter the
input) and what else the record says (the reduce op, all-to-all split sizes and the bytes actually sent).
"""
from __future__ import annotations

import torch

P2P = ("send", "recv")


def nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


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
        else:
            torch.minimum(acc, x, out=acc)
    if op == "avg":
        acc = acc / len(xs) if acc.is_floating_point() else acc // len(xs)
    return acc


def disagreement(posts) -> str:
    """Why the group's posts cannot be one collective ("" if they can)."""
    first = posts[0]
    t = len(posts)
    if len({p.op for p in posts}) > 1:
        return "different collectives"
    meta = [[(x.dtype, tuple(x.shape)) for x in p.tensors] for p in posts]
    op = first.op
    if op in ("all_reduce", "broadcast", "all_gather") and any(m != meta[0] for m in meta):
        return "tensors of different shapes or dtypes"
    if op in ("all_reduce", "reduce_scatter") and len({p.header.get("reduce") for p in posts}) > 1:
        return "different reduce ops"
    if op == "broadcast" and (len({p.header.get("root") for p in posts}) > 1
                              or not 0 <= int(first.header.get("root", -1)) < t):
        return "different or invalid roots"
    if op == "reduce_scatter" and (any(len(p.tensors) != t for p in posts) or any(m != meta[0] for m in meta)):
        return "inputs of different sizes"
    if op == "all_to_all":
        return _all_to_all_disagreement(posts)
    if op not in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier"):
        return f"{op} is not a collective the switchboard knows"
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
    red = posts[0].header.get("reduce", "sum")
    if op == "all_reduce":
        out = [reduce([p.tensors[i] for p in posts], red) for i in range(len(posts[0].tensors))]
        return [(out, sum(nbytes(x) for x in p.tensors), {"reduce": red}) for p in posts]
    if op == "all_gather":
        parts = [p.tensors[0] for p in posts]
        return [(parts, nbytes(p.tensors[0]) * t, {}) for p in posts]
    if op == "reduce_scatter":   # rank j gets the sum of every rank's part j
        return [([reduce([q.tensors[j] for q in posts], red)], sum(nbytes(x) for x in p.tensors), {"reduce": red})
                for j, p in enumerate(posts)]
    if op == "all_to_all":       # rank j gets every rank's part j, in rank order
        return [([q.tensors[j] for q in posts], sum(nbytes(x) for x in p.tensors), _all_to_all_fields(p, j))
                for j, p in enumerate(posts)]
    if op == "broadcast":
        root = int(posts[0].header["root"])
        return [(posts[root].tensors, sum(nbytes(x) for x in p.tensors), {"root": root}) for p in posts]
    return [([], 0, {}) for _ in posts]      # barrier


def _all_to_all_fields(post, j: int) -> dict:
    """Split sizes as the rank gave them ([] when even) and the bytes it sent to the OTHER ranks: with uneven
    splits (MoE dispatch) that is not (t-1)/t of anything, so it is counted row by row."""
    rows = [x.shape[0] if x.dim() else 1 for x in post.tensors]
    row_bytes = next((nbytes(x) // x.shape[0] for x in post.tensors if x.dim() and x.shape[0]), 0)
    even = bool(post.header.get("even"))
    return {"in_splits": [] if even else rows, "out_splits": [] if even else list(post.header["out_rows"]),
            "sent": float((sum(rows) - rows[j]) * row_bytes)}
