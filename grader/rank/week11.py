"""Week 11 on a rank: call the student's route on this rank's router logits and backpropagate a random upstream
grad of the gates and the aux loss; or call the student's route_biased on the logits and the (replicated) expert
bias and backpropagate a random upstream grad of the gates; or exchange this rank's per-expert counts and move its
rows with the student's AllToAll, forward and backward; or build the student's EPMoE from what rank r of t holds (the
replicated router weight and ITS experts' weights only) and run its tokens forward and backward. `inp` is
this rank's own view (grader/cases/week11.py, rank_inputs): no other rank's tokens or experts ever reach it.

What the all-to-alls moved (split sizes, bytes) is read on the trusted side from the switchboard's record of
this rank's collectives (grader/cases/week11.py), not from anything the rank says."""
from __future__ import annotations

import torch

from grader.rank.context import GradingError

def _tensor(x, name):
    if not isinstance(x, torch.Tensor):
        raise GradingError(f"`{name}` is a {type(x).__name__}, not a tensor.")
    return x


def run_routing(mod, cfg, inp, ctx):
    logits = ctx.hand("logits", inp["logits"].clone()).requires_grad_(True)
    ctx.phase("forward")
    out = mod.route(logits, cfg["k"], cfg["C"])
    if not isinstance(out, tuple) or len(out) != 4:
        raise GradingError("route must return a tuple (experts, gates, keep, aux).")
    experts, gates, keep, aux = (_tensor(v, n) for v, n in zip(out, ("experts", "gates", "keep", "aux")))
    if tuple(gates.shape) != tuple(inp["dgates"].shape) or aux.numel() != 1:
        raise GradingError(f"gates has shape {tuple(gates.shape)} and aux {tuple(aux.shape)}; expected "
                           f"{tuple(inp['dgates'].shape)} (N, k) and a scalar.")
    ctx.phase("backward")
    loss = (gates * inp["dgates"]).sum() + aux.reshape(()) * inp["daux"].reshape(())
    if not loss.requires_grad:
        raise GradingError("neither gates nor aux requires grad: the autograd graph back to the logits was cut "
                           "(.detach(), torch.no_grad() or .data?).")
    loss.backward()
    return {"experts": experts.long(), "gates": gates, "keep": keep.long(), "aux": aux.reshape(()),
            "dlogits": logits.grad}


def run_all_to_all(mod, cfg, inp, ctx):
    t = ctx.world_size
    counts = ctx.hand("counts", inp["counts"].clone())
    x = ctx.hand("x", inp["x"].clone()).requires_grad_(True)
    ctx.phase("forward")
    recv_counts = _tensor(mod.exchange_counts(counts, ctx.group), "recv_counts")
    send = counts.view(t, -1).sum(1).tolist()
    recv = recv_counts.reshape(t, -1).sum(1).tolist()
    y = mod.AllToAll.apply(x, recv, send, ctx.group)
    ctx.phase("backward")
    ctx.backward(y, inp["dy"], "y")
    return {"recv_counts": recv_counts.long(), "y": y, "dx": x.grad}


def run_layer(mod, cfg, inp, ctx):
    router, w1, w2 = (ctx.hand(n, inp[n].clone()) for n in ("router", "w1", "w2"))
    layer = mod.EPMoE(router, w1, w2, cfg["k"], cfg["C"], group=ctx.group)
    ctx.record_params(layer)
    x = ctx.hand("x", inp["x"].clone()).requires_grad_(True)
    ctx.phase("forward")
    y = layer(x)
    ctx.phase("backward")
    ctx.backward(y, inp["dy"], "y")
    out = {"y": y, "dx": x.grad}
    for name in ("router", "w1", "w2"):
        out[f"d{name}"] = ctx.grad(layer, name)
    return out


def run_route_biased(mod, cfg, inp, ctx):
    logits = ctx.hand("logits", inp["logits"].clone()).requires_grad_(True)
    bias = ctx.hand("bias", inp["bias"].clone())
    ctx.phase("forward")
    out = mod.route_biased(logits, cfg["k"], bias)
    if not isinstance(out, tuple) or len(out) != 2:
        raise GradingError("route_biased must return a tuple (experts, gates).")
    experts, gates = (_tensor(v, n) for v, n in zip(out, ("experts", "gates")))
    if tuple(gates.shape) != tuple(inp["dgates"].shape):
        raise GradingError(f"gates has shape {tuple(gates.shape)}; expected {tuple(inp['dgates'].shape)} (N, k).")
    ctx.phase("backward")
    loss = (gates * inp["dgates"]).sum()
    if not loss.requires_grad:
        raise GradingError("gates does not require grad: the autograd graph back to the logits was cut "
                           "(.detach(), torch.no_grad() or .data?).")
    loss.backward()
    return {"experts": experts.long(), "gates": gates, "dlogits": logits.grad}
