"""Week 2 on a rank: build the student's ColumnParallelLinear / RowParallelLinear from the dense layer it is
handed, run forward and backward on this rank's input, return outputs and grads for the trusted compare.
`inp` is this rank's own (grader/cases/week02.py `_own_*`): the dense weights carry only its block, the rest
NaN, and X and dY are what a real rank of the layer has.
Every tensor handed to the student's code (the dense layer's parameters, the input) goes through ctx.hand:
the rank entry fails the item if the code wrote into one of them. The upstream grad given to .backward()
is not handed (in any week): autograd passes it to the output's backward, and a backward that reduces its
incoming grad in place (g all-reducing in backward too) is a wrong collective the contract already names;
failing it as "overwrote dy" would hide that cause."""
from __future__ import annotations

import torch


def _dense(w, b, ctx=None, name="linear"):
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
    with torch.no_grad():
        lin.weight.copy_(w)
        if b is not None:
            lin.bias.copy_(b)
    return lin if ctx is None else ctx.hand_module(name, lin)


def run_column(mod, cfg, inp, ctx):
    layer = mod.ColumnParallelLinear.from_dense(_dense(inp["W"], inp.get("b"), ctx),
                                                gather_output=cfg["gather"], group=ctx.group)
    ctx.record_params(layer)
    x = ctx.hand("x", inp["x"].clone()).requires_grad_(True)
    ctx.phase("forward")
    y = layer(x)
    ctx.phase("backward")
    ctx.backward(y, inp["dy"])            # this rank's grad of its output: the whole of it only when gathered
    out = {"y": y, "dx": x.grad, "dW": ctx.grad(layer, "weight")}
    if "b" in inp:
        out["db"] = ctx.grad(layer, "bias")
    return out


def run_row(mod, cfg, inp, ctx):
    layer = mod.RowParallelLinear.from_dense(_dense(inp["W"], inp.get("b"), ctx),
                                             input_is_parallel=cfg["parallel_input"], group=ctx.group)
    ctx.record_params(layer)
    x = ctx.hand("x", inp["x"].clone()).requires_grad_(True)   # its slice of X when input_is_parallel
    ctx.phase("forward")
    y = layer(x)
    ctx.phase("backward")
    ctx.backward(y, inp["dy"])
    out = {"y": y, "dx": x.grad, "dW": ctx.grad(layer, "weight")}
    if "b" in inp:
        out["db"] = ctx.grad(layer, "bias")
    return out


def run_mlp(mod, cfg, inp, ctx):
    fc1 = mod.ColumnParallelLinear.from_dense(_dense(inp["W1"], inp["b1"], ctx, "fc1"), gather_output=False,
                                              group=ctx.group)
    fc2 = mod.RowParallelLinear.from_dense(_dense(inp["W2"], inp["b2"], ctx, "fc2"), input_is_parallel=True,
                                           group=ctx.group)
    ctx.record_params(fc1, "fc1.")
    ctx.record_params(fc2, "fc2.")
    x = ctx.hand("x", inp["x"].clone()).requires_grad_(True)
    ctx.phase("forward")
    y = fc2(torch.nn.functional.gelu(fc1(x)))
    ctx.phase("backward")
    ctx.backward(y, inp["dy"])
    return {"y": y, "dx": x.grad, "dW1": ctx.grad(fc1, "weight"), "db1": ctx.grad(fc1, "bias"),
            "dW2": ctx.grad(fc2, "weight"), "db2": ctx.grad(fc2, "bias")}
