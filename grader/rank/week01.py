"""Week 1 on a rank: hand this rank's own input x_r (`inp` holds nothing else: grader/cases/week01.py
`_own_row`) to the student's ring collective (ring_reduce_scatter, ring_all_gather or ring_all_reduce, named
by the case's config["fn"]) on the case's group, and return its result; the input is handed through
ctx.hand, so the rank entry fails the item if the function wrote into it (the task: return a new tensor,
leave `x` unchanged)."""
from __future__ import annotations


def run_ring(mod, cfg, inp, ctx):
    x = ctx.hand("x", inp["x"].clone())
    ctx.phase("forward")
    y = getattr(mod, cfg["fn"])(x, group=ctx.group)
    ctx.phase("after")
    return {"y": y}
