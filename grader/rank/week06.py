"""Week 6 on a rank: call the student's ring_all_gather_matmul / matmul_reduce_scatter on this rank's shards
(forward only), then recompute the non-overlapped version (all-gather then F.linear per block, or F.linear
per block then reduce-scatter) in the "harness" phase the contract ignores, to report bit-exactness at
t = 2; or build OverlapColumnParallelLinear / OverlapRowParallelLinear from the dense weight and return
output, input grad and weight grad after forward and backward; or (Task 4) build SPColumnParallelLinear,
record in which order its backward issued the all-gather / reduce-scatter, ran its dgrad and wgrad GEMMs (named by
the buffers they read) and waited (tpkit.timeline.IssueLog),
and recompute the non-overlapped version in the "harness" phase for bit-exactness. `inp` is this rank's own
(grader/cases/week06.py `_own_*`): its blocks of x and dY and, for the ring functions, its weight shard; the dense
weight a linear's from_dense is handed has the other ranks' blocks NaN; so nothing here shards the student's
inputs. Every tensor handed to the
student's code goes through ctx.hand: the rank entry fails the item if the code wrote into one of them."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tpkit.ledger import _OPS, _tensors
from tpkit.timeline import IssueLog, Provenance


# -- the non-overlapped version, with plain collectives (all_gather_single / reduce_scatter_single split
# dim 0, so the sequence dim is moved to the front). _all_gather_seq and _reduce_scatter_seq are the one copy of
# reference/sp_layers.py's all_gather_seq / reduce_scatter_seq that a rank may see: a rank cannot import
# reference/, and tpkit must not hold them (they are week 5's lab answer) ----------------------------------
def _all_gather_seq(x, group):
    """(B, T/t, C) -> (B, T, C): every rank's sequence block, in rank order."""
    t = dist.get_world_size(group)
    xs = x.transpose(0, 1).contiguous()                                  # (T/t, B, C)
    out = xs.new_empty((t * xs.shape[0],) + tuple(xs.shape[1:]))         # (T, B, C)
    dist.all_gather_single(out, xs, group=group)
    return out.transpose(0, 1).contiguous()                              # (B, T, C)


def _reduce_scatter_seq(x, group):
    """(B, T, C) partial sums -> (B, T/t, C): this rank's block of the summed tensor."""
    t = dist.get_world_size(group)
    xs = x.transpose(0, 1).contiguous()                                  # (T, B, C)
    out = xs.new_empty((xs.shape[0] // t,) + tuple(xs.shape[1:]))        # (T/t, B, C)
    dist.reduce_scatter_single(out, xs, group=group)
    return out.transpose(0, 1).contiguous()                              # (B, T/t, C)


def _plain_ag(x_s, w, group):
    x_full = _all_gather_seq(x_s, group)
    t = x_full.shape[1] // x_s.shape[1]
    return torch.cat([F.linear(c.contiguous(), w) for c in x_full.chunk(t, dim=1)], dim=1)


def _plain_rs(x, w, t, group):
    return _reduce_scatter_seq(torch.cat([F.linear(c.contiguous(), w) for c in x.chunk(t, dim=1)], dim=1), group)


def _same_bits(got, plain):
    return torch.tensor([int(isinstance(got, torch.Tensor) and got.shape == plain.shape and torch.equal(got, plain))])


# -- the two ring functions (forward only) --------------------------------------------------------
def run_ag_matmul(mod, cfg, inp, ctx):
    x_s, w = ctx.hand("x_s", inp["x"]), ctx.hand("weight", inp["W"])       # (B, T/t, C), (O/t, C)
    ctx.phase("forward")
    y, x_full = mod.ring_all_gather_matmul(x_s, w, ctx.group)
    ctx.phase("harness")                     # the non-overlapped version, outside the contract's phases
    plain = _plain_ag(ctx.handed[0][2], w, ctx.group)   # from the untouched copy of x_s
    out = {"y": y, "x_full": x_full}
    if ctx.world_size == 2:
        out["same_bits_as_plain"] = _same_bits(y, plain)
    return out


def run_matmul_rs(mod, cfg, inp, ctx):
    x, w = ctx.hand("x", inp["x"]), ctx.hand("weight", inp["W"])           # (B, T, I/t), (O, I/t)
    ctx.phase("forward")
    y = mod.matmul_reduce_scatter(x, w, ctx.group)
    ctx.phase("harness")
    out = {"y": y}
    if ctx.world_size == 2:
        out["same_bits_as_plain"] = _same_bits(y, _plain_rs(ctx.handed[0][2], w, 2, ctx.group))
    else:
        _plain_rs(ctx.handed[0][2], w, ctx.world_size, ctx.group)   # same collectives on every rank in every case
    return out


# -- the linears (forward + backward) -------------------------------------------------------------
def run_linear(mod, cfg, inp, ctx):
    dense = torch.nn.Linear(cfg["in"], cfg["out"], bias=False)
    with torch.no_grad():
        dense.weight.copy_(inp["W"])
    ctx.hand("linear.weight", dense.weight)    # from_dense may read the dense layer, never write into it
    column = cfg["kind"] == "column"
    cls = mod.OverlapColumnParallelLinear if column else mod.OverlapRowParallelLinear
    layer = cls.from_dense(dense, group=ctx.group)
    ctx.record_params(layer)
    x = ctx.hand("x", inp["x"].clone()).requires_grad_(True)    # column: (B, T/t, I); row: (B, T, I/t)
    ctx.phase("forward")
    y = layer(x)
    ctx.phase("backward")
    y.backward(inp["dy"])                                       # column: (B, T, O/t); row: (B, T/t, O)
    return {"y": y, "dx": x.grad, "dW": layer.weight.grad}


# -- the sequence-parallel column linear with Megatron's backward overlap (Task 4) ------------------------
def _saved_full_input(grad_fn, full_numel: int) -> bool:
    """Did forward keep a tensor the size of the gathered input (save_for_backward or a ctx attribute)?"""
    if grad_fn is None:
        return False
    try:
        kept = list(getattr(grad_fn, "saved_tensors", ()))
    except RuntimeError:          # saved tensors already freed
        kept = []
    kept += [v for v in getattr(grad_fn, "__dict__", {}).values() if isinstance(v, torch.Tensor)]
    return any(t.numel() == full_numel for t in kept)


class BackwardGemms(IssueLog):
    """IssueLog whose GEMMs are named by what they read and make: "dgrad" reads all of dY and the weight and makes
    all of dX (B, T, C); "wgrad" reads all of dY and of the X gathered in backward and makes all of dW (O/t, C);
    any other GEMM (a 1x1 torch.mm put under a collective, one position's share of the real one) is "other" and
    hides nothing. Operands count through views and data-moving copies (tpkit.timeline.Provenance):
    dy.flatten(0, -2).t(), a contiguous copy of the gathered buffer."""

    def __init__(self, dy, weight, x_numel, dw_numel):
        super().__init__()
        self.prov = Provenance()
        self.prov.tag(dy, "dy")
        self.prov.tag(weight, "weight")
        self.whole = {"dy": dy.numel(), "weight": dw_numel, "X": x_numel}     # the weight and dW: (O/t, C)
        self.made = {"dgrad": x_numel, "wgrad": dw_numel}                     # dX: (B, T, C) like X

    def gemm_label(self, func, args, out) -> str:
        read = {n for t in _tensors(args) for n in self.prov.of(t) if t.numel() == self.whole[n]}
        made = sum(t.numel() for t in _tensors(out))
        for label, other in (("dgrad", "weight"), ("wgrad", "X")):
            if {"dy", other} <= read and made == self.made[label]:
                return label
        return "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if _OPS.get(func._opname) == "all_gather":          # the backward's all-gather output is X
            if func.namespace == "c10d" and args:
                self.prov.tag(args[0], "X")
            elif func.namespace == "_c10d_functional":
                self.prov.tag(out, "X")
        self.prov.carry(func, args, kwargs, out)
        return out


def run_sp_column(mod, cfg, inp, ctx):
    dense = torch.nn.Linear(cfg["in"], cfg["out"], bias=False)
    with torch.no_grad():
        dense.weight.copy_(inp["W"])
    ctx.hand("linear.weight", dense.weight)
    layer = mod.SPColumnParallelLinear.from_dense(dense, group=ctx.group)
    ctx.record_params(layer)
    x_s = ctx.hand("x_s", inp["x"].clone()).requires_grad_(True)      # (B, T/t, C)
    dy = inp["dy"]                                                    # (B, T, O/t)
    x_numel = x_s.numel() * ctx.world_size                            # the gathered X (B, T, C)
    ctx.phase("forward")
    y = layer(x_s)
    saved_full = _saved_full_input(getattr(y, "grad_fn", None), x_numel)
    ctx.phase("backward")
    dw_numel = cfg["out"] // ctx.world_size * cfg["in"]
    with BackwardGemms(dy, getattr(layer, "weight", None), x_numel, dw_numel) as sched:
        ctx.backward(y, dy)
    ctx.phase("harness")   # the non-overlapped version on untouched copies: same collectives, same GEMMs
    x_copy = ctx.handed[1][2]
    w = ctx.shard(inp["W"], 0)                                             # (O/t, C): the block not NaN
    x_full = _all_gather_seq(x_copy, ctx.group)                            # (B, T, C)
    y_plain = F.linear(x_full, w)                                          # (B, T, O/t)
    dx_plain = _reduce_scatter_seq(dy @ w, ctx.group)                      # (B, T/t, C)
    dw_plain = dy.flatten(0, -2).t() @ x_full.flatten(0, -2)               # (O/t, C)
    dw = ctx.grad(layer)
    return {"y": y, "dx": x_s.grad, "dW": dw,
            "bits_y": _same_bits(y, y_plain), "bits_dx": _same_bits(x_s.grad, dx_plain),
            "bits_dW": _same_bits(dw, dw_plain),
            "overlap_ag": torch.tensor([sched.overlap_code("all_gather", "dgrad")]),
            "overlap_rs": torch.tensor([sched.overlap_code("reduce_scatter", "wgrad")]),
            "saves_shard_only": torch.tensor([0 if saved_full else 1])}
