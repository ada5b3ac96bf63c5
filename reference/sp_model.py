"""A whole `tpkit.models.ForCausalLM` under TP or TP+SP: the model's edges (Week 5 lecture §8).

Korthikanti et al. 2022 (Sec. 4.2.2) apply sequence parallelism between the transformer layers; the
edges of the model decide how a tensor enters and leaves that sequence region:

    ids (B,T) -> vocab-parallel lookup: partial sums E_r (B,T,C), rows of rank r's vocab range only
              -> RS along T -> x_s (B,T/t,C)          [TP: all-reduce -> x (B,T,C)]
              -> L SP blocks (reference.sp_layers.ParallelDecoderLayer) -> (B,T/t,C)
              -> final norm on T/t positions (weight grad all-reduced, like the blocks' norms)
              -> AG along T -> (B,T,C) -> LM head, rows of rank r's vocab range -> logits (B,T,V/t)
              -> vocab-parallel cross-entropy (reference.vocab.cross_entropy: 3 all-reduces of (B,T))

E = sum_r E_r, and the first block needs only positions of block r: a reduce-scatter gives exactly that,
for half the bytes of the all-reduce. The head's rank r computes its logit columns z_r = h W_r^T for all
T positions, so it needs every position of h: an all-gather. The backward of each is the other
(`GatherFromSequence`: dh_s = block r of sum_r dz_r W_r; `ReduceScatterToSequence`: every rank's lookup
touched all T positions, so it needs dE at all of them).

`embed` selects how the embedding's partial sums enter the sequence region (the lecture compares them):
    "reduce_scatter"    RS along T (Megatron-LM `VocabParallelEmbedding(reduce_scatter_embeddings=True)`)
    "all_reduce_split"  all-reduce, then keep block r with an all-gather backward (Megatron-LM when a
                        learned position embedding is added: `scatter_to_sequence_parallel_region`)
    "all_reduce_slice"  all-reduce, then a plain slice: the forward is right, the embedding grad is not
Megatron-LM: `megatron/core/tensor_parallel/layers.py` (`VocabParallelEmbedding`, the SP input gather of
`ColumnParallelLinear`), `megatron/core/models/gpt/gpt_model.py` (`output_layer`), and
`megatron/core/models/common/embeddings/language_model_embedding.py`.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from reference.sp_layers import (
    GatherFromSequence,
    ParallelDecoderLayer,
    ReduceScatterToSequence,
    SplitToSequence,
    rms_norm,
)
from reference.tp_layers import CopyToTP, ReduceFromTP
from reference.vocab import cross_entropy, shard_rows, vocab_range
from tpkit.models import ForCausalLM

EMBED_ENTRIES = ("reduce_scatter", "all_reduce_split", "all_reduce_slice")


class ParallelCausalLM(nn.Module):
    """`ForCausalLM` split over `group`. mode "tp": activations (B, T, C) replicated between blocks;
    mode "sp": (B, T/t, C). forward(ids) -> this rank's logit columns (B, T, ceil(V/t)) for all T positions.

    Parameters (rank r): embed_weight, lm_head_weight: rows vocab_range(V, r, t), zero-padded;
    layers: `ParallelDecoderLayer`s; norm_weight: replicated (C,).
    """

    def __init__(self, dense: ForCausalLM, group=None, mode: str = "sp", embed: str = "reduce_scatter"):
        super().__init__()
        if embed not in EMBED_ENTRIES:
            raise ValueError(f"embed must be one of {EMBED_ENTRIES}")
        t, r = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.mode, self.embed, self.t = group, mode, embed, t
        self.vocab_size = dense.config.vocab_size
        self.vocab_start = vocab_range(self.vocab_size, r, t)[0]
        self.eps = dense.model.norm.eps
        self.embed_weight = nn.Parameter(shard_rows(dense.model.embed_tokens.weight, r, t))      # (V/t, C)
        self.layers = nn.ModuleList(ParallelDecoderLayer(layer, group, mode) for layer in dense.model.layers)
        self.norm_weight = nn.Parameter(dense.model.norm.weight.detach().clone())               # (C,)
        self.lm_head_weight = nn.Parameter(shard_rows(dense.lm_head.weight, r, t))             # (V/t, C)

    def _enter(self, e):
        """The embedding's partial sums (B, T, C) -> the activation the first block takes."""
        g = self.group
        if self.mode == "tp":
            return ReduceFromTP.apply(e, g)                                  # (B, T, C): plain TP's g
        if self.embed == "reduce_scatter":
            return ReduceScatterToSequence.apply(e, g)                       # (B, T/t, C)
        full = ReduceFromTP.apply(e, g)                                      # (B, T, C), twice the bytes
        if self.embed == "all_reduce_split":
            return SplitToSequence.apply(full, g)                            # (B, T/t, C); bwd all-gathers
        return full.chunk(self.t, dim=1)[dist.get_rank(g)]                   # (B, T/t, C); bwd: only block r

    def forward(self, input_ids):
        g = self.group
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.embed_weight.shape[0])        # ids another rank owns
        e = F.embedding(local.masked_fill(outside, 0), self.embed_weight)    # (B, T, C) partial sum
        h = self._enter(e.masked_fill(outside.unsqueeze(-1), 0.0))           # (B, T/t, C) or (B, T, C)
        for layer in self.layers:
            h = layer(h)
        # SP: each rank's norm saw T/t positions, so its weight grad is a partial sum (all-reduce in bwd)
        w = CopyToTP.apply(self.norm_weight, g) if self.mode == "sp" else self.norm_weight
        h = rms_norm(h, w, self.eps)
        # every rank's head reads all T positions: AG (bwd: RS of the partial dh); TP: f (bwd: all-reduce)
        h = GatherFromSequence.apply(h, g) if self.mode == "sp" else CopyToTP.apply(h, g)   # (B, T, C)
        return F.linear(h, self.lm_head_weight)                              # (B, T, V/t)

    def loss(self, input_ids, targets):
        """Mean cross-entropy over the B*T tokens, identical on every rank (3 all-reduces of (B, T))."""
        return cross_entropy(self(input_ids), targets, self.vocab_size, self.group)


def dense_grads_as_model(dense: nn.Module) -> nn.Module:
    """A copy of `dense` whose weights are its gradients: sharding it exactly as the weights were sharded
    gives each rank's expected gradient shards, parameter for parameter."""
    out = copy.deepcopy(dense)
    with torch.no_grad():
        for (_, p), (_, q) in zip(dense.named_parameters(), out.named_parameters()):
            q.copy_(p.grad)
    return out
