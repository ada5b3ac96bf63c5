"""Week 4 on a rank: build the student's VocabParallelEmbedding from the dense table and look up the full
(B, T) ids, or hand vocab_parallel_cross_entropy this rank's padded slice of the logits (padded columns
filled with PAD_LOGIT, as a padded lm_head could produce); run backward and return the output (or loss)
with this rank's weight (or logit) grad. The padding rule lives here, and the trusted side imports it."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

PAD_LOGIT = 30.0   # what a padded lm_head row might produce: must never win


def padded_rows(vocab: int, t: int) -> int:
    return math.ceil(vocab / t)


def pad_shard(x: torch.Tensor, vocab: int, r: int, t: int, dim: int, value: float = 0.0) -> torch.Tensor:
    """Rank r's slice of x padded along `dim` from V to t ceil(V/t) entries."""
    per = padded_rows(vocab, t)
    pad = [0, 0] * (x.dim() - 1 - (dim % x.dim())) + [0, t * per - vocab]
    return F.pad(x, pad, value=value).narrow(dim, r * per, per).contiguous()


def upstream(cfg) -> float:
    """dL/dloss = B*T, as if the loss were summed over tokens: each logit grad is then O(1), not O(1/#tokens)."""
    return float(cfg["batch"] * cfg["seq"])


def run_embedding(mod, cfg, inp, ctx):
    dense = torch.nn.Embedding(cfg["vocab"], cfg["hidden"])
    with torch.no_grad():
        dense.weight.copy_(inp["W"])
    emb = mod.VocabParallelEmbedding.from_dense(dense, group=ctx.group)
    ctx.record_params(emb)
    ctx.phase("forward")
    y = emb(inp["ids"].clone())
    ctx.phase("backward")
    y.backward(inp["dy"])
    return {"y": y, "dW": emb.weight.grad}


def run_cross_entropy(mod, cfg, inp, ctx):
    r, t, V = ctx.rank, ctx.world_size, cfg["vocab"]
    local = pad_shard(inp["logits"], V, r, t, -1, value=PAD_LOGIT).requires_grad_(True)  # (B, T, ceil(V/t))
    ctx.phase("forward")
    loss = mod.vocab_parallel_cross_entropy(local, inp["targets"].clone(), group=ctx.group,
                                            ignore_index=cfg["ignore_index"], label_smoothing=cfg["smoothing"],
                                            vocab_size=V)
    ctx.phase("backward")
    loss.backward(torch.tensor(upstream(cfg)))
    return {"loss": loss, "dlogits": local.grad}
