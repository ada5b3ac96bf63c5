"""Week 2: ColumnParallelLinear and RowParallelLinear, outputs AND gradients, t = 2 and 4.

For W of shape (out, in) and t ranks (Megatron-LM, Shoeybi et al. 2019, Sec. 3):
- column-parallel: rank r holds W[r-th out-block] (out/t, in); Y_r = X W_r^T needs no
  communication; dX = sum_r dY_r W_r needs one all-reduce in backward (the f operator).
- row-parallel: rank r holds W[:, r-th in-block] (out, in/t); Y = sum_r X_r W_r^T needs one
  all-reduce in forward (the g operator); dX_r = dY W_r is local.
"""
from __future__ import annotations

import math

import torch

from grader.case import Case, Contract, register
from grader.reference import dense_linear, dense_mlp

MODULE = "tp_linear"


def _linear_inputs(cfg, gen):
    i, o = cfg["in"], cfg["out"]
    d = {"x": torch.randn(*cfg["lead"], i, generator=gen),
         "W": torch.randn(o, i, generator=gen) / math.sqrt(i),
         "dy": torch.randn(*cfg["lead"], o, generator=gen)}
    if cfg.get("bias", True):
        d["b"] = 0.1 * torch.randn(o, generator=gen)
    return d


def _dense(w, b):
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
    with torch.no_grad():
        lin.weight.copy_(w)
        if b is not None:
            lin.bias.copy_(b)
    return lin


def _shard(t, rank, world, dim):
    return t.chunk(world, dim=dim)[rank].contiguous()


# -- column-parallel ------------------------------------------------------------
def _run_column(mod, cfg, inp, ctx):
    layer = mod.ColumnParallelLinear.from_dense(_dense(inp["W"], inp.get("b")),
                                                gather_output=cfg["gather"], group=ctx.group)
    ctx.record_params(layer)
    x = inp["x"].clone().requires_grad_(True)
    ctx.phase("forward")
    y = layer(x)
    ctx.phase("backward")
    dy = inp["dy"] if cfg["gather"] else ctx.shard(inp["dy"], -1)
    ctx.backward(y, dy)
    out = {"y": y, "dx": x.grad, "dW": ctx.grad(layer, "weight")}
    if "b" in inp:
        out["db"] = ctx.grad(layer, "bias")
    return out


def _expect_column(cfg, ref, r, t):
    out = {"y": ref["y"] if cfg["gather"] else _shard(ref["y"], r, t, -1), "dx": ref["dx"],
           "dW": _shard(ref["dW"], r, t, 0)}
    if "db" in ref:
        out["db"] = _shard(ref["db"], r, t, 0)
    return out


def _contract_column(cfg, t):
    params = {"weight": (cfg["out"] // t, cfg["in"])}
    if cfg.get("bias", True):
        params["bias"] = (cfg["out"] // t,)
    return Contract(
        counts={"forward": {"all_gather": 1} if cfg["gather"] else {}, "backward": {"all_reduce": 1}},
        params=params,
        why={"forward": "Y_r = X W_r^T is local; only gather_output=True needs one all-gather.",
             "backward": "dX = sum_r dY_r W_r: one all-reduce of dX (the f operator); the gather's backward is a local split."})


# -- row-parallel ---------------------------------------------------------------
def _run_row(mod, cfg, inp, ctx):
    layer = mod.RowParallelLinear.from_dense(_dense(inp["W"], inp.get("b")),
                                             input_is_parallel=cfg["parallel_input"], group=ctx.group)
    ctx.record_params(layer)
    x_in = ctx.shard(inp["x"], -1) if cfg["parallel_input"] else inp["x"]
    x = x_in.clone().requires_grad_(True)
    ctx.phase("forward")
    y = layer(x)
    ctx.phase("backward")
    ctx.backward(y, inp["dy"])
    out = {"y": y, "dx": x.grad, "dW": ctx.grad(layer, "weight")}
    if "b" in inp:
        out["db"] = ctx.grad(layer, "bias")
    return out


def _expect_row(cfg, ref, r, t):
    out = {"y": ref["y"], "dx": _shard(ref["dx"], r, t, -1) if cfg["parallel_input"] else ref["dx"],
           "dW": _shard(ref["dW"], r, t, 1)}
    if "db" in ref:
        out["db"] = ref["db"]          # the bias is replicated: every rank's grad is the dense grad
    return out


def _contract_row(cfg, t):
    params = {"weight": (cfg["out"], cfg["in"] // t)}
    if cfg.get("bias", True):
        params["bias"] = (cfg["out"],)
    return Contract(
        counts={"forward": {"all_reduce": 1},
                "backward": {} if cfg["parallel_input"] else {"all_gather": 1}},
        params=params,
        why={"forward": "Y = sum_r X_r W_r^T: exactly one all-reduce of the partial outputs (the g operator).",
             "backward": "dX_r = dY W_r is local; only a replicated input (input_is_parallel=False) must "
                         "all-gather the dX slices back to the full dX."})


# -- column -> row MLP ----------------------------------------------------------
def _mlp_inputs(cfg, gen):
    h, f = cfg["hidden"], cfg["ffn"]
    return {"x": torch.randn(*cfg["lead"], h, generator=gen),
            "W1": torch.randn(f, h, generator=gen) / math.sqrt(h), "b1": 0.1 * torch.randn(f, generator=gen),
            "W2": torch.randn(h, f, generator=gen) / math.sqrt(f), "b2": 0.1 * torch.randn(h, generator=gen),
            "dy": torch.randn(*cfg["lead"], h, generator=gen)}


def _run_mlp(mod, cfg, inp, ctx):
    fc1 = mod.ColumnParallelLinear.from_dense(_dense(inp["W1"], inp["b1"]), gather_output=False, group=ctx.group)
    fc2 = mod.RowParallelLinear.from_dense(_dense(inp["W2"], inp["b2"]), input_is_parallel=True, group=ctx.group)
    ctx.record_params(fc1, "fc1.")
    ctx.record_params(fc2, "fc2.")
    x = inp["x"].clone().requires_grad_(True)
    ctx.phase("forward")
    y = fc2(torch.nn.functional.gelu(fc1(x)))
    ctx.phase("backward")
    ctx.backward(y, inp["dy"])
    return {"y": y, "dx": x.grad, "dW1": ctx.grad(fc1, "weight"), "db1": ctx.grad(fc1, "bias"),
            "dW2": ctx.grad(fc2, "weight"), "db2": ctx.grad(fc2, "bias")}


def _expect_mlp(cfg, ref, r, t):
    return {"y": ref["y"], "dx": ref["dx"], "dW1": _shard(ref["dW1"], r, t, 0), "db1": _shard(ref["db1"], r, t, 0),
            "dW2": _shard(ref["dW2"], r, t, 1), "db2": ref["db2"]}


def _contract_mlp(cfg, t):
    h, f = cfg["hidden"], cfg["ffn"]
    return Contract(counts={"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}},
                    params={"fc1.weight": (f // t, h), "fc1.bias": (f // t,), "fc2.weight": (h, f // t),
                            "fc2.bias": (h,)},
                    why={"forward": "column->GeLU->row needs one all-reduce, after the row-parallel GEMM.",
                         "backward": "one all-reduce of dX, in the column-parallel layer's f operator."})


HINTS = {
    "db": "A bias must be added once: after the all-reduce in a row-parallel layer, and sharded with the "
          "output features in a column-parallel one.",
    "dx": "Input grads need the conjugate operator: the f operator all-reduces dX in backward.",
    "dW": "Each rank's weight grad must equal its slice of the dense weight grad.",
    "y": "Check the slice of W each rank keeps (rank r takes the r-th torch.chunk block) and that the "
         "bias is added once, not on every rank.",
}


def _lin(c, **kw):
    d = {"lead": [4], "in": 8, "out": 16, "bias": True}
    d.update(c)
    d.update(kw)
    return d


for name, gather, cfg, seed in [
        ("column_parallel", True, _lin({}), 0),
        ("column_parallel_local", False, _lin({}), 1),
        ("column_parallel_hidden", True, _lin({"lead": [2, 3], "in": 12, "out": 20, "bias": False}), None),
        ("column_parallel_local_hidden", False, _lin({"lead": [3, 2], "in": 20, "out": 12}), None)]:
    register(Case(name=f"week02/{name}", module=MODULE, world_sizes=(2, 4), config=dict(cfg, gather=gather),
                  make_inputs=_linear_inputs, reference=lambda c, d: dense_linear(d["x"], d["W"], d.get("b"), d["dy"]),
                  run_rank=_run_column, expected=_expect_column, contract=_contract_column, seed=seed,
                  hidden=seed is None, title="ColumnParallelLinear", hints=HINTS))

for name, par, cfg, seed in [
        ("row_parallel", False, _lin({"in": 16, "out": 8}), 2),
        ("row_parallel_input_parallel", True, _lin({"in": 16, "out": 8}), 3),
        ("row_parallel_hidden", False, _lin({"lead": [2, 3], "in": 20, "out": 12}), None),
        ("row_parallel_input_parallel_hidden", True, _lin({"lead": [5], "in": 12, "out": 20, "bias": False}), None)]:
    register(Case(name=f"week02/{name}", module=MODULE, world_sizes=(2, 4), config=dict(cfg, parallel_input=par),
                  make_inputs=_linear_inputs, reference=lambda c, d: dense_linear(d["x"], d["W"], d.get("b"), d["dy"]),
                  run_rank=_run_row, expected=_expect_row, contract=_contract_row, seed=seed,
                  hidden=seed is None, title="RowParallelLinear", hints=HINTS))

for name, cfg, seed in [("mlp", {"lead": [4], "hidden": 8, "ffn": 32}, 4),
                        ("mlp_hidden", {"lead": [2, 5], "hidden": 12, "ffn": 24}, None)]:
    register(Case(name=f"week02/{name}", module=MODULE, world_sizes=(2, 4), config=cfg, make_inputs=_mlp_inputs,
                  reference=lambda c, d: dense_mlp(d["x"], d["W1"], d["b1"], d["W2"], d["b2"], d["dy"]),
                  run_rank=_run_mlp, expected=_expect_mlp, contract=_contract_mlp, seed=seed, hidden=seed is None,
                  title="Megatron MLP", hints={**HINTS, "db2": HINTS["db"], "db1": HINTS["db"]}))
