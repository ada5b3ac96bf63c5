"""Tensor- and sequence-parallel blocks built from `tpkit.models.DecoderLayer` (lectures, training profile).

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", Sec. 4.2.2):
under plain TP (Megatron, Shoeybi et al. 2019) the norm and residual regions hold the full (B, T, C)
activation on every rank. Sequence parallelism splits those regions along T (dim 1) and swaps each
all-reduce for a reduce-scatter (into the sequence region) + an all-gather (out of it):

    x_s (B,T/t,C) -norm-> AG -> column-parallel GEMMs -> ... -> row-parallel GEMM -> RS -> + x_s

Operators (forward / backward):
    GatherFromSequence      all-gather along T   / reduce-scatter along T
    ReduceScatterToSequence reduce-scatter along T / all-gather along T
    CopyToTP (f)            identity             / all-reduce        (plain TP; reference.tp_layers)
    ReduceFromTP (g)        all-reduce           / identity          (plain TP; reference.tp_layers)
    CopyToTP on a weight    identity             / all-reduce        (SP norm weights: each rank saw T/t tokens)
    SplitToSequence         keep block r         / all-gather along T (enter SP from a replicated tensor)

The model's edges (reference.sp_model): the vocab-parallel embedding's partial sums enter the sequence
region through ReduceScatterToSequence, the final norm runs on T/t positions, and the LM head (column-parallel
over the vocabulary) reads GatherFromSequence of it.

`all_gather_single` / `reduce_scatter_single` (formerly `*_into_tensor`, `*_tensor`) work on dim 0, so the sequence dim is moved to the front.
This module is the lecture's and the profile's; the week-5 lab asks students to write their own.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from reference.tp_layers import CopyToTP, ReduceFromTP
from tpkit.models import DecoderLayer, apply_rotary, causal_attention, rotary_cos_sin


def all_gather_seq(x, group=None):
    """(B, T/t, C) -> (B, T, C): every rank's sequence block, in rank order."""
    t = dist.get_world_size(group)
    xs = x.transpose(0, 1).contiguous()                                  # (T/t, B, C): dim 0 is split
    out = xs.new_empty((t * xs.shape[0],) + tuple(xs.shape[1:]))         # (T, B, C)
    dist.all_gather_single(out, xs, group=group)
    return out.transpose(0, 1).contiguous()                              # (B, T, C)


def reduce_scatter_seq(x, group=None):
    """(B, T, C) partial sums -> (B, T/t, C): this rank's block of the summed tensor."""
    t = dist.get_world_size(group)
    xs = x.transpose(0, 1).contiguous()                                  # (T, B, C)
    out = xs.new_empty((xs.shape[0] // t,) + tuple(xs.shape[1:]))        # (T/t, B, C)
    dist.reduce_scatter_single(out, xs, group=group)
    return out.transpose(0, 1).contiguous()                              # (B, T/t, C)


class GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, g):
        # every rank's GEMMs used all T positions, so dX_s is the SUM over ranks of their dX block
        return reduce_scatter_seq(g, ctx.group), None


class ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, g):
        # the partial sums all fed the same output: each rank needs the whole dY
        return all_gather_seq(g, ctx.group), None


class SplitToSequence(torch.autograd.Function):
    """Enter the sequence region from a REPLICATED tensor: keep block r, no communication.

    Megatron-LM's `_ScatterToSequenceParallelRegion` (after the embedding's all-reduce when a learned
    position embedding is added). Backward: what follows used only block r, but the replicated input fed
    every rank's block, so the input's grad is the all-gather of the blocks' grads (a slice alone would keep
    only this rank's positions).
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        t, r = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(t, dim=1)[r].contiguous()                          # (B, T/t, C)

    @staticmethod
    def backward(ctx, g):
        return all_gather_seq(g, ctx.group), None                         # (B, T, C)


class GatherLinearSaveLocal(torch.autograd.Function):
    """Megatron's SP column GEMM: Y = AG(x_s) W^T, saving only x_s; backward all-gathers x_s again for dW.

    Trades one more all-gather per column GEMM in backward for not keeping the (B, T, C) gathered input.
    """

    @staticmethod
    def forward(ctx, x_s, w, group):
        ctx.save_for_backward(x_s, w)
        ctx.group = group
        return F.linear(all_gather_seq(x_s, group), w)                     # (B, T, O/t)

    @staticmethod
    def backward(ctx, dy):
        x_s, w = ctx.saved_tensors
        x = all_gather_seq(x_s, ctx.group)                                  # the re-gather: (B, T, C)
        dx_s = reduce_scatter_seq(dy @ w, ctx.group)                        # (B, T/t, C)
        dw = dy.flatten(0, -2).t() @ x.flatten(0, -2)                       # (O/t, C)
        return dx_s, dw, None


def rms_norm(x, weight, eps):
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight


def _rows(w, t, r):
    return w.detach().chunk(t, dim=0)[r].clone()


def _cols(w, t, r):
    return w.detach().chunk(t, dim=1)[r].clone()


class ParallelDecoderLayer(nn.Module):
    """`DecoderLayer` split over a group: heads and FFN columns per rank; mode "tp" or "sp".

    tp: input/output (B, T, C) replicated; one all-reduce after attention and after the MLP.
    sp: input/output (B, T/t, C); AG before the column GEMMs, RS after the row GEMMs,
        norm-weight grads all-reduced. regather=True saves only the local block for the column
        GEMMs' dW and all-gathers it again in backward (Megatron's choice). overlap=True swaps AG+GEMM and GEMM+RS for the ring
        versions of `reference.overlap` (week 6).
    """

    def __init__(self, dense: DecoderLayer, group=None, mode: str = "sp", overlap: bool = False,
                 regather: bool = False):
        super().__init__()
        t, r = dist.get_world_size(group), dist.get_rank(group)
        att = dense.self_attn
        if att.num_kv_heads % t or dense.mlp.gate_proj.out_features % t:
            raise ValueError(f"kv heads ({att.num_kv_heads}) and FFN width must be divisible by t={t}")
        self.group, self.mode, self.overlap, self.regather, self.t = group, mode, overlap, regather, t
        self.head_dim, self.rope_theta, self.eps = att.head_dim, att.rope_theta, dense.input_layernorm.eps
        self.n_q = att.q_proj.out_features // t                           # local q features
        self.n_kv = att.k_proj.out_features // t
        self.input_layernorm_weight = nn.Parameter(dense.input_layernorm.weight.detach().clone())
        self.post_attention_layernorm_weight = nn.Parameter(dense.post_attention_layernorm.weight.detach().clone())
        # q, k, v fused per rank: one gather (or one ring) feeds all three GEMMs
        self.qkv_weight = nn.Parameter(torch.cat([_rows(att.q_proj.weight, t, r), _rows(att.k_proj.weight, t, r),
                                                  _rows(att.v_proj.weight, t, r)]))   # ((nh+2nkv)hs/t, C)
        self.o_weight = nn.Parameter(_cols(att.o_proj.weight, t, r))                 # (C, nh hs/t)
        self.ffn = dense.mlp.gate_proj.out_features // t
        self.gate_up_weight = nn.Parameter(torch.cat([_rows(dense.mlp.gate_proj.weight, t, r),
                                                      _rows(dense.mlp.up_proj.weight, t, r)]))  # (2F/t, C)
        self.down_weight = nn.Parameter(_cols(dense.mlp.down_proj.weight, t, r))     # (C, F/t)

    # column GEMM on the (gathered) input, row GEMM whose partial sums are reduced
    def _column(self, x, w):
        if self.mode == "tp":
            return F.linear(CopyToTP.apply(x, self.group), w)
        if self.overlap:
            from reference.overlap import all_gather_linear
            return all_gather_linear(x, w, self.group)
        if self.regather:
            return GatherLinearSaveLocal.apply(x, w, self.group)
        return F.linear(GatherFromSequence.apply(x, self.group), w)

    def _row(self, y, w):
        if self.mode == "tp":
            return ReduceFromTP.apply(F.linear(y, w), self.group)
        if self.overlap:
            from reference.overlap import linear_reduce_scatter
            return linear_reduce_scatter(y, w, self.group)
        return ReduceScatterToSequence.apply(F.linear(y, w), self.group)

    def _norm_weight(self, w):
        # SP: each rank's norm saw only T/t positions, so its weight grad is a partial sum
        return CopyToTP.apply(w, self.group) if self.mode == "sp" else w

    def forward(self, x):
        B, Tl, C = x.shape
        T = Tl * self.t if self.mode == "sp" else Tl
        hs = self.head_dim
        n = rms_norm(x, self._norm_weight(self.input_layernorm_weight), self.eps)
        qkv = self._column(n, self.qkv_weight)                                       # (B, T, (nh+2nkv)hs/t)
        q, k, v = qkv.split([self.n_q, self.n_kv, self.n_kv], dim=-1)
        q = q.reshape(B, T, -1, hs).transpose(1, 2)                                  # (B, nh/t, T, hs)
        k = k.reshape(B, T, -1, hs).transpose(1, 2)                                  # (B, nkv/t, T, hs)
        v = v.reshape(B, T, -1, hs).transpose(1, 2)
        cos, sin = rotary_cos_sin(torch.arange(T, device=x.device), hs, self.rope_theta, q.dtype)
        y = causal_attention(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
        y = y.transpose(1, 2).reshape(B, T, -1)                                      # (B, T, nh hs/t)
        h = x + self._row(y, self.o_weight)                                          # (B, T/t or T, C)
        n = rms_norm(h, self._norm_weight(self.post_attention_layernorm_weight), self.eps)
        gate, up = self._column(n, self.gate_up_weight).split(self.ffn, dim=-1)      # (B, T, F/t) each
        return h + self._row(F.silu(gate) * up, self.down_weight)
