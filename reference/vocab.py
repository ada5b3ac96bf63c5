"""Vocabulary parallelism for the Week 4 lecture (Megatron-LM core/tensor_parallel: layers.py, cross_entropy.py).

The vocabulary of V ids is padded to t * ceil(V/t) and split in t consecutive ranges; rank r owns
[r ceil(V/t), (r+1) ceil(V/t)); ids >= V are padding (zero embedding rows, masked logit columns).

- Embedding: mask the ids outside the rank's range, shift, look up, zero the masked rows, all-reduce.
- Cross-entropy, per token i with target y: loss_i = log sum_v exp(z_v) - z_y. With m = max_v z_v:
      loss_i = m + log sum_r S_r - z_y,   S_r = sum_{v in rank r} exp(z_v - m)
  so three all-reduces of [B, T] tensors: MAX (m), SUM (z_y, non-zero on the owning rank), SUM (S).
  d loss_i / d z_v = softmax_v - [v = y]: each rank has its softmax columns once S is known, so the
  backward is local. Here autograd derives it: the SUM all-reduces are g (identity backward) and m
  carries no gradient (the loss does not depend on it).
The lab's graded module is the students' own; this one is the lecture's.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference.tp_layers import ReduceFromTP  # g: all-reduce SUM forward, identity backward


def vocab_range(vocab_size: int, rank: int, world: int) -> tuple[int, int]:
    per = math.ceil(vocab_size / world)
    return rank * per, (rank + 1) * per


def shard_rows(weight: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank r's rows of a (V, C) table, zero-padded to ceil(V/t) rows."""
    V = weight.shape[0]
    start, end = vocab_range(V, rank, world)
    out = torch.zeros(end - start, *weight.shape[1:], dtype=weight.dtype)
    rows = weight.detach()[start:min(end, V)]
    out[:rows.shape[0]] = rows
    return out


def embedding_lookup(ids: torch.Tensor, shard: torch.Tensor, start: int, group=None) -> torch.Tensor:
    """(B, T) ids -> (B, T, C), from this rank's rows [start, start + len(shard))."""
    local = ids - start
    outside = (local < 0) | (local >= shard.shape[0])                  # another rank owns these ids
    y = F.embedding(local.masked_fill(outside, 0), shard)              # (B, T, C)
    y = y.masked_fill(outside.unsqueeze(-1), 0.0)                      # zero what is not ours
    return ReduceFromTP.apply(y, group)                              # one all-reduce of (B, T, C)


def cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, group=None,
                  ignore_index: int = -100, label_smoothing: float = 0.0, local_smoothing: bool = False):
    """Mean over kept tokens of the cross-entropy, from this rank's logit columns (B, T, ceil(V/t)).

    local_smoothing=True reproduces the Megatron-LM label-smoothing bug (the mean of -log p over the
    rank's own columns, with no reduction) for the lecture's comparison.
    """
    rank = dist.get_rank(group)
    n_local = local_logits.shape[-1]
    start = rank * n_local
    real = torch.arange(start, start + n_local) < vocab_size                       # (V/t,)
    z = local_logits.float().masked_fill(~real, float("-inf"))                     # padding never wins
    m = z.detach().max(dim=-1).values                                              # (B, T)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)                          # 1: MAX
    z = z - m.unsqueeze(-1)

    keep = targets != ignore_index                                                 # the loss mask
    local_t = targets - start
    mine = keep & (local_t >= 0) & (local_t < n_local)
    z_t = torch.gather(z, -1, local_t.masked_fill(~mine, 0).unsqueeze(-1)).squeeze(-1)
    z_t = torch.where(mine, z_t, torch.zeros_like(z_t))
    if label_smoothing > 0 and not local_smoothing:
        both = ReduceFromTP.apply(torch.stack([z_t, z.masked_fill(~real, 0.0).sum(-1)]), group)  # 2: SUM
        z_t, z_sum = both[0], both[1]
    else:
        z_t = ReduceFromTP.apply(z_t, group)                                     # 2: SUM
    lse = ReduceFromTP.apply(z.exp().sum(-1), group).log()                       # 3: SUM, (B, T)
    per_token = lse - z_t
    if label_smoothing > 0:
        if local_smoothing:   # mean over this rank's columns only: a different number on every rank
            smooth = lse - z.masked_fill(~real, 0.0).sum(-1) / real.sum()
        else:
            smooth = lse - z_sum / vocab_size
        per_token = (1 - label_smoothing) * per_token + label_smoothing * smooth
    return (per_token * keep).sum() / keep.sum()


def gathered_cross_entropy(local_logits, targets, vocab_size, group=None, ignore_index=-100, label_smoothing=0.0):
    """The naive way: all-gather the [B, T, V] logits, then F.cross_entropy (for comparison only)."""
    parts = [torch.empty_like(local_logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local_logits.detach().contiguous(), group=group)
    parts[dist.get_rank(group)] = local_logits                                     # keep the graph for our slice
    full = torch.cat(parts, dim=-1)[..., :vocab_size]                              # (B, T, V)
    return F.cross_entropy(full.flatten(0, 1), targets.flatten(), ignore_index=ignore_index,
                           label_smoothing=label_smoothing)
