"""Week 10 on a rank: call the student's RingAttention (or ulysses_attention) on this rank's own sequence
chunks of q, k, v (the trusted side cut them: two mirrored chunks r and 2t-1-r of 2t for the ring, the
contiguous block r for Ulysses, chunks r and 2t-1-r of every document for packed documents, with cu_seqlens)
and, for the dp x cp check, its sequence's tokens and the replicated weights of one attention layer and return the output chunks and, after backward from this rank's chunks
of dy, dq, dk and dv. For the ring it also measures what autograd keeps for backward: only this rank's
q, k, v, output and log-sum-exp, never K/V blocks of other ranks. Every tensor handed to the student's
code goes through ctx.hand."""
from __future__ import annotations

import torch
import torch.distributed as dist

from grader.rank.context import GradingError
from tpkit.memory import saved_activation_bytes

SAVED = "saved for backward: only this rank's q, k, v, out, lse (1 = yes)"
DIVISIBLE = "heads not divisible by t raises ValueError (1 = yes)"


def local_saved_bytes(q) -> int:
    """q, k, v and the output (each like q) plus one float32 log-sum-exp per query row."""
    return 4 * q.numel() * q.element_size() + q[..., 0].numel() * 4


def _inputs(cfg, inp, ctx, grad: bool):
    return [ctx.hand(n, inp[n].clone()).requires_grad_(grad) for n in ("q", "k", "v")]


def _grads(y, q, k, v, dy, ctx):
    ctx.phase("backward")
    ctx.backward(y, dy, "y")
    return {"dq": q.grad, "dk": k.grad, "dv": v.grad}


def run_ring(mod, cfg, inp, ctx):
    q, k, v = _inputs(cfg, inp, ctx, cfg["backward"])
    out = {}
    ctx.phase("forward")
    if not cfg["backward"]:
        out["y"] = mod.RingAttention.apply(q, k, v, ctx.group)
        return out

    def forward():
        out["y"] = mod.RingAttention.apply(q, k, v, ctx.group)
        return out["y"]

    saved = saved_activation_bytes(forward)
    out[SAVED] = torch.tensor(int(saved <= local_saved_bytes(q)))
    out.update(_grads(out["y"], q, k, v, inp["dy"], ctx))
    return out


def run_ulysses(mod, cfg, inp, ctx):
    q, k, v = _inputs(cfg, inp, ctx, True)
    ctx.phase("forward")
    y = mod.ulysses_attention(q, k, v, ctx.group)
    return {"y": y, **_grads(y, q, k, v, inp["dy"], ctx)}


def run_packed(mod, cfg, inp, ctx):
    """The student's DocRingAttention on this rank's tokens of a packed sequence (every document cut into 2t
    chunks, chunks r and 2t-1-r of each) with the batch's cu_seqlens, forward and backward."""
    q, k, v = _inputs(cfg, inp, ctx, True)
    cu = ctx.hand("cu_seqlens", inp["cu_seqlens"].clone())
    ctx.phase("forward")
    y = mod.DocRingAttention.apply(q, k, v, cu, ctx.group)
    return {"y": y, **_grads(y, q, k, v, inp["dy"], ctx)}


def run_dp_cp(mod, cfg, inp, ctx):
    """A (dp, cp) mesh on the whole job: the student's groups, the lab's attention_layer (their DocRingAttention
    over their CP group) on this rank's tokens, backward from its dy, then their sum of the weight gradients."""
    if ctx.world_size != dist.get_world_size() or ctx.world_size != cfg["dp"] * cfg["cp"]:
        raise GradingError(f"the dp x cp check runs on the whole job of dp * cp = {cfg['dp'] * cfg['cp']} ranks")
    x, cu = ctx.hand("x", inp["x"].clone()), ctx.hand("cu_seqlens", inp["cu_seqlens"].clone())
    W = {n: ctx.hand(f"W_{n}", inp[f"W_{n}"].clone()).requires_grad_(True) for n in "qkvo"}
    ctx.phase("setup")
    cp_group, grad_group = mod.mesh_groups(cfg["dp"], cfg["cp"])
    ctx.phase("forward")
    y = mod.attention_layer(x, W, cu, cfg["nh"], cp_group)
    ctx.phase("backward")
    ctx.backward(y, inp["dy"], "y")
    ctx.phase("sync")
    mod.sync_weight_grads(list(W.values()), grad_group)
    return {f"dW_{n}": W[n].grad for n in "qkvo"}


def run_divisibility(mod, cfg, inp, ctx):
    """t + 1 heads cannot be split over t ranks: ulysses_attention must raise ValueError before communicating
    (any other exception, e.g. a reshape's RuntimeError, is the unclear error the rule is about)."""
    t = ctx.world_size
    q = torch.zeros(1, t + 1, 2, 8)                      # (B, nh, T/t, hs)
    try:
        mod.ulysses_attention(q, q.clone(), q.clone(), ctx.group)
        raised = 0
    except ValueError:
        raised = 1
    except NotImplementedError:
        raise
    except Exception:
        raised = 0
    return {DIVISIBLE: torch.tensor(raised)}
