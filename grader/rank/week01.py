"""Week 1 on a rank: take row `rank` of the (4, ...) input stack, call the student's ring collective
(ring_reduce_scatter, ring_all_gather or ring_all_reduce, named by the case's config["fn"]) on the
case's group, and return its result together with the input, so the trusted compare can check that
the function left its input unchanged."""
from __future__ import annotations


def run_ring(mod, cfg, inp, ctx):
    x = inp["x"][ctx.rank].clone()
    ctx.phase("forward")
    y = getattr(mod, cfg["fn"])(x, group=ctx.group)
    ctx.phase("after")
    return {"y": y, "x_unchanged": x}
