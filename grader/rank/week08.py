"""Week 8 on a rank: build the student's GTPChain from the dense weights (each rank keeps its rows of every
weight), run this rank's micro-batch forward (and backward) under tpkit.gather_watch.GatherWatch, and return
the output, the input grad, this rank's weight-grad shards and what the watch saw: the most gathered full
weights alive at once, and how many full weights were saved for backward."""
from __future__ import annotations

import os

import torch


def _warm_imports():
    """Rank processes only: pay DTensor's lazy imports (torch._dynamo, ...) when this module is imported.

    The rank entry must import this module before it arms the item timeout: a lazy import interrupted by
    that alarm would leave torch._dynamo half-initialised for every later item.
    """
    import torch._dynamo  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import torch.distributed._functional_collectives  # noqa: F401


if os.environ.get("COURSE_JOB_ID"):   # only in a grading job's processes, not when the trusted side imports it
    _warm_imports()


def run_chain(mod, cfg, inp, ctx):
    from tpkit.gather_watch import GatherWatch
    weights = [inp[f"W{i}"] for i in range(len(cfg["dims"]) - 1)]
    chain = mod.GTPChain.from_dense(weights, group=ctx.group)
    ctx.record_params(chain)
    x = ctx.shard(inp["x"], 0).requires_grad_(True)                  # this rank's micro-batch
    watch = GatherWatch()
    with watch, watch.saved_hooks():
        ctx.phase("forward")
        y = chain(x)
        fwd_peak = watch.peak_count
        if cfg["backward"]:
            ctx.phase("backward")
            y.backward(ctx.shard(inp["dy"], 0))
    out = {"y": y, "peak_gathered_weights": torch.tensor(float(watch.peak_count)),
           "full_weights_saved_for_backward": torch.tensor(float(watch.saved_full))}
    if cfg["backward"]:
        out["dx"] = x.grad
        shards = list(chain.parameters())
        out.update({f"dW{i}": p.grad for i, p in enumerate(shards)})
    else:
        out["peak_gathered_weights"] = torch.tensor(float(fwd_peak))
    return out
