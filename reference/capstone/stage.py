"""One pipeline stage of `tpkit.capstone_model.LlamaMoE`: its blocks under TP/SP, its experts under EP (week 12 §2)."""
from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from reference.capstone.layout import ParallelDims
from reference.expert_parallel import EPMoE
from reference.sp_layers import GatherFromSequence, ParallelDecoderLayer, ReduceScatterToSequence, rms_norm
from reference.tp_layers import CopyToTP, ReduceFromTP
from reference.vocab import cross_entropy, shard_rows, vocab_range
from tpkit.capstone_model import LlamaMoE


class _Block(ParallelDecoderLayer):
    """Week 5's block. Under SP its norm weights' gradients are partial sums over tp: reduced once per step by
    the gradient plan (as Megatron-LM's finalize_model_grads does), not inside every micro-batch's backward."""

    def _norm_weight(self, w):
        return w


class ParallelMoELayer(nn.Module):
    """x + EPMoE(norm(x)) on this rank's tokens: (b, T, C) replicated over tp (TP), or (b, T/t, C) (SP).
    The experts are sharded over the ep group and replicated over tp and edp."""

    def __init__(self, dense, ep_group, ep: int, e: int):
        super().__init__()
        E = dense.router.shape[0]
        lo, hi = e * E // ep, (e + 1) * E // ep
        self.norm_weight = nn.Parameter(dense.norm.weight.detach().clone())
        self.eps = dense.norm.eps
        # dropless: capacity ceil(E/k * N * k / E) = N, room for every token at every expert
        self.moe = EPMoE(dense.router, dense.w1[lo:hi], dense.w2[lo:hi], dense.k, E / dense.k, ep_group)

    def forward(self, x):
        n = rms_norm(x, self.norm_weight, self.eps)
        return x + self.moe(n.flatten(0, 1)).view_as(x)


class Stage(nn.Module):
    """Stage s of pp of `LlamaMoE`, sharded over the tp group (and its experts over ep). forward: ids (b, T) on
    the first stage, else the previous stage's activation -> the next activation, or the local logits
    (b, T, V/tp) on the last. `shards()` names every local tensor by its dense parameter and placement."""

    def __init__(self, dense: LlamaMoE, dims: ParallelDims, groups: dict, rank: int):
        super().__init__()
        c = dims.coords(rank)
        s, r, t = c["pp"], c["tp"], dims.tp
        self.dims, self.first, self.last = dims, s == 0, s == dims.pp - 1
        self.tp_group, self.ep_group = groups["tp"][0], groups["ep"][0]
        per = dense.config.n_blocks // dims.pp
        self.lo = s * per
        self.vocab, self.hidden = dense.config.model.vocab_size, dense.config.model.hidden_size
        self.vocab_start = vocab_range(self.vocab, r, t)[0]
        mode = "sp" if dims.sp else "tp"
        self.layers = nn.ModuleList(
            _Block(b, self.tp_group, mode) if isinstance(b, type(dense.layers[0])) else
            ParallelMoELayer(b, self.ep_group, dims.ep, c["ep"]) for b in dense.layers[self.lo:self.lo + per])
        if self.first:
            self.embed_weight = nn.Parameter(shard_rows(dense.embed_tokens.weight, r, t))      # (V/t, C)
        if self.last:
            self.norm_weight = nn.Parameter(dense.norm.weight.detach().clone())                # (C,)
            self.eps = dense.norm.eps
            self.lm_head_weight = nn.Parameter(shard_rows(dense.lm_head.weight, r, t))         # (V/t, C)

    def forward(self, x):
        g = self.tp_group
        if self.first:                       # vocab-parallel lookup: rows of my range, partial sums
            local = x - self.vocab_start
            outside = (local < 0) | (local >= self.embed_weight.shape[0])
            e = F.embedding(local.masked_fill(outside, 0), self.embed_weight).masked_fill(outside[..., None], 0.0)
            x = ReduceScatterToSequence.apply(e, g) if self.dims.sp else ReduceFromTP.apply(e, g)
        for layer in self.layers:
            x = layer(x)
        if self.last:                        # every rank's head columns read all T positions
            x = rms_norm(x, self.norm_weight, self.eps)
            x = GatherFromSequence.apply(x, g) if self.dims.sp else CopyToTP.apply(x, g)
            x = F.linear(x, self.lm_head_weight)                              # (b, T, V/t)
        return x

    def loss(self, local_logits, targets):
        return cross_entropy(local_logits, targets, self.vocab, self.tp_group)

    def shards(self):
        """(dense name, parameter, rows of it, placement) for every local tensor: placement None (replicated),
        ("tp", dim) or ("ep", 0) (this rank's block of the dense tensor along dim). Fused weights (qkv, gate+up)
        are several dense tensors: each is a row range of the local parameter."""
        out = []
        if self.first:
            out.append(("embed_tokens.weight", self.embed_weight, None, ("tp", 0)))
        for i, layer in enumerate(self.layers):
            pre = f"layers.{self.lo + i}."
            if isinstance(layer, ParallelMoELayer):
                out += [(pre + "norm.weight", layer.norm_weight, None, None),
                        (pre + "router", layer.moe.router, None, None),
                        (pre + "w1", layer.moe.w1, None, ("ep", 0)), (pre + "w2", layer.moe.w2, None, ("ep", 0))]
                continue
            nq, nkv, f = layer.n_q, layer.n_kv, layer.ffn
            out += [(pre + "input_layernorm.weight", layer.input_layernorm_weight, None, None),
                    (pre + "post_attention_layernorm.weight", layer.post_attention_layernorm_weight, None, None),
                    (pre + "self_attn.q_proj.weight", layer.qkv_weight, (0, nq), ("tp", 0)),
                    (pre + "self_attn.k_proj.weight", layer.qkv_weight, (nq, nq + nkv), ("tp", 0)),
                    (pre + "self_attn.v_proj.weight", layer.qkv_weight, (nq + nkv, nq + 2 * nkv), ("tp", 0)),
                    (pre + "self_attn.o_proj.weight", layer.o_weight, None, ("tp", 1)),
                    (pre + "mlp.gate_proj.weight", layer.gate_up_weight, (0, f), ("tp", 0)),
                    (pre + "mlp.up_proj.weight", layer.gate_up_weight, (f, 2 * f), ("tp", 0)),
                    (pre + "mlp.down_proj.weight", layer.down_weight, None, ("tp", 1))]
        if self.last:
            out += [("norm.weight", self.norm_weight, None, None),
                    ("lm_head.weight", self.lm_head_weight, None, ("tp", 0))]
        return out
