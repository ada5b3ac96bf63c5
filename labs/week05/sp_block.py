"""Week 5: a sequence-parallel decoder layer (Korthikanti et al. 2022, Sec. 4.2.2)."""
import copy

import torch
import torch.distributed as dist
import torch.nn as nn


def all_gather_seq(x, group=None):
    """(B, T/t, C) -> (B, T, C): the blocks of all ranks, in rank order along dim 1."""
    # hint: transpose(0, 1).contiguous(), all_gather_single into a (t*T/t, B, C) buffer, transpose back
    ### BEGIN SOLUTION
    t = dist.get_world_size(group)
    xs = x.transpose(0, 1).contiguous()                                  # (T/t, B, C)
    out = xs.new_empty((t * xs.shape[0],) + tuple(xs.shape[1:]))         # (T, B, C)
    dist.all_gather_single(out, xs, group=group)
    return out.transpose(0, 1).contiguous()                              # (B, T, C)
    ### END SOLUTION


def reduce_scatter_seq(x, group=None):
    """(B, T, C) partial sums -> (B, T/t, C): this rank's block of the sum over ranks."""
    # hint: the mirror image of all_gather_seq, with reduce_scatter_single
    ### BEGIN SOLUTION
    t = dist.get_world_size(group)
    xs = x.transpose(0, 1).contiguous()                                  # (T, B, C)
    out = xs.new_empty((xs.shape[0] // t,) + tuple(xs.shape[1:]))        # (T/t, B, C)
    dist.reduce_scatter_single(out, xs, group=group)
    return out.transpose(0, 1).contiguous()                              # (B, T/t, C)
    ### END SOLUTION


class GatherFromSequence(torch.autograd.Function):
    """All-gather along T forward; reduce-scatter along T backward."""

    @staticmethod
    def forward(ctx, x, group):
        ### BEGIN SOLUTION
        ctx.group = group
        return all_gather_seq(x, group)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # hint: every rank used all T positions, so the grad of your block is a sum over ranks
        ### BEGIN SOLUTION
        return reduce_scatter_seq(grad, ctx.group), None
        ### END SOLUTION


class ReduceScatterToSequence(torch.autograd.Function):
    """Reduce-scatter along T forward; all-gather along T backward."""

    @staticmethod
    def forward(ctx, x, group):
        ### BEGIN SOLUTION
        ctx.group = group
        return reduce_scatter_seq(x, group)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        return all_gather_seq(grad, ctx.group), None
        ### END SOLUTION


def _rows(w, t, r):
    return nn.Parameter(w.detach().chunk(t, dim=0)[r].clone())


def _cols(w, t, r):
    return nn.Parameter(w.detach().chunk(t, dim=1)[r].clone())


class SPDecoderLayer(nn.Module):
    """`grader.models.DecoderLayer` with heads/FFN columns split over `group` and norms on T/t positions."""

    def __init__(self, dense, group=None):
        super().__init__()
        self.group = group
        self.input_layernorm = dense.input_layernorm
        self.self_attn = dense.self_attn
        self.post_attention_layernorm = dense.post_attention_layernorm
        self.mlp = dense.mlp

    @classmethod
    def from_dense(cls, dense, group=None):
        # hint: deep-copy the dense layer, swap each linear's weight for this rank's shard (_rows/_cols),
        # hint: and make each norm weight's gradient all-reduced across the group during backward
        ### BEGIN SOLUTION
        t, r = dist.get_world_size(group), dist.get_rank(group)
        dense = copy.deepcopy(dense)
        att, mlp = dense.self_attn, dense.mlp
        if att.num_kv_heads % t or mlp.gate_proj.out_features % t:
            raise ValueError(f"{att.num_kv_heads} kv heads and FFN width {mlp.gate_proj.out_features} "
                             f"must be divisible by t={t}")
        for lin in (att.q_proj, att.k_proj, att.v_proj, mlp.gate_proj, mlp.up_proj):
            lin.weight = _rows(lin.weight, t, r)        # column-parallel: a block of output features
        for lin in (att.o_proj, mlp.down_proj):
            lin.weight = _cols(lin.weight, t, r)        # row-parallel: a block of input features

        def all_reduce_grad(g):
            # each rank's norm saw T/t positions: the dense grad is the sum over ranks
            g = g.clone()
            dist.all_reduce(g, group=group)
            return g

        for norm in (dense.input_layernorm, dense.post_attention_layernorm):
            norm.weight.register_hook(all_reduce_grad)
        return cls(dense, group)
        ### END SOLUTION

    def forward(self, x):
        # hint: norm, gather, attention (ends in o_proj's partial sums), reduce-scatter, residual; same for the MLP
        ### BEGIN SOLUTION
        g = self.group
        a = self.self_attn(hidden_states=GatherFromSequence.apply(self.input_layernorm(x), g))   # (B, T, C) partial
        h = x + ReduceScatterToSequence.apply(a, g)                                                # (B, T/t, C)
        m = self.mlp(GatherFromSequence.apply(self.post_attention_layernorm(h), g))               # (B, T, C) partial
        return h + ReduceScatterToSequence.apply(m, g)                                             # (B, T/t, C)
        ### END SOLUTION


def pad_and_split(x, group=None):
    """Zero-pad dim 1 at the end to a multiple of t; return this rank's block (B, ceil(T/t), C)."""
    # hint: torch.nn.functional.pad pads the last dims first: (0, 0) for C, then (0, pad) for T
    ### BEGIN SOLUTION
    t, r = dist.get_world_size(group), dist.get_rank(group)
    pad = -x.shape[1] % t
    x = torch.nn.functional.pad(x, (0, 0, 0, pad))                     # (B, T + pad, C)
    return x.chunk(t, dim=1)[r].contiguous()                           # (B, (T + pad)/t, C)
    ### END SOLUTION
