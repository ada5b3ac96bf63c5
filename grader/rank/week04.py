"""Week 4 on a rank: build the student's VocabParallelEmbedding from the dense table (only this rank's rows;
the rest NaN) and look up the full (B, T) ids, or hand vocab_parallel_cross_entropy this rank's padded slice
of the logits (padded columns filled with a large value, as a padded lm_head could produce); `inp` is already
this rank's own (grader/cases/week04.py `_own_rows`, `_own_logits`). Run backward and return the output (or
loss) with this rank's weight (or logit) grad, the embedding's weight shard itself (its rows past V must be
zeros), and how many of the cross-entropy's forward all-reduces used ReduceOp.MAX (a dispatch mode reads
each all-reduce's op). Every tensor handed to the student goes through ctx.hand."""
from __future__ import annotations

import torch


def upstream(cfg) -> float:
    """dL/dloss = B*T, as if the loss were summed over tokens: each logit grad is then O(1), not O(1/#tokens)."""
    return float(cfg["batch"] * cfg["seq"])


WEIGHT_SHARD = "weight shard kept by this rank"


def run_embedding(mod, cfg, inp, ctx):
    dense = torch.nn.Embedding(cfg["vocab"], cfg["hidden"])
    with torch.no_grad():
        dense.weight.copy_(inp["W"])
    ctx.hand("embedding.weight", dense.weight)
    emb = mod.VocabParallelEmbedding.from_dense(dense, group=ctx.group)
    ctx.record_params(emb)
    ctx.phase("forward")
    y = emb(ctx.hand("input_ids", inp["ids"].clone()))
    ctx.phase("backward")
    y.backward(inp["dy"])
    w = getattr(emb, "weight", None)
    return {"y": y, "dW": emb.weight.grad, WEIGHT_SHARD: w.detach() if isinstance(w, torch.Tensor) else None}


def run_cross_entropy(mod, cfg, inp, ctx):
    local = inp["logits"].requires_grad_(True)                             # (B, T, ceil(V/t)): its own slice
    ctx.phase("forward")
    loss = mod.vocab_parallel_cross_entropy(ctx.hand("local_logits", local),
                                            ctx.hand("targets", inp["targets"].clone()), group=ctx.group,
                                            ignore_index=cfg["ignore_index"], label_smoothing=cfg["smoothing"],
                                            vocab_size=cfg["vocab"])
    ctx.phase("backward")
    loss.backward(torch.tensor(upstream(cfg)))
    return {"loss": loss, "dlogits": local.grad}
