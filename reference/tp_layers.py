"""Tensor-parallel linear layers for the lecture notebooks (Megatron-LM, Shoeybi et al. 2019, Sec. 3).

Lectures of later weeks import these; the labs' graded modules are the students' own.
For Y = X W^T + b with W of shape (out, in) and a group of t ranks:

- column-parallel: rank r keeps W_r = W[r-th block of out] (out/t, in). Y_r = X W_r^T + b_r is local.
  Backward: dW_r = dY_r^T X and db_r = sum dY_r are local; dX = sum_r dY_r W_r needs an all-reduce: the
  input goes through f (identity forward, all-reduce backward).
- row-parallel: rank r keeps W_r = W[:, r-th block of in] (out, in/t). Y = sum_r X_r W_r^T + b needs an
  all-reduce: the partial output goes through g (all-reduce forward, identity backward). Backward:
  dX_r = dY W_r and dW_r = dY^T X_r are local; b is replicated and added once, after the sum.

f and g are conjugate: each one's backward is the other one's forward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def group_info(group=None) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


class CopyToTP(torch.autograd.Function):
    """f: forward identity; backward all-reduce (each rank holds one term of dX = sum_r dY_r W_r)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """g: forward all-reduce (sum the partial products X_r W_r^T); backward identity (dY is replicated)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)                     # in place: nothing saved this tensor
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    """Forward all-gather along the last dim; backward keeps this rank's slice (no communication)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        rank, t = group_info(group)
        parts = [torch.empty_like(x) for _ in range(t)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)                     # (..., t * d)

    @staticmethod
    def backward(ctx, grad):
        rank, t = group_info(ctx.group)
        return grad.chunk(t, dim=-1)[rank].contiguous(), None  # (..., d)


class _SplitLastDim(torch.autograd.Function):
    """Forward keeps this rank's slice of the last dim; backward all-gathers the slices' grads."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        rank, t = group_info(group)
        return x.chunk(t, dim=-1)[rank].contiguous()       # (..., d / t)

    @staticmethod
    def backward(ctx, grad):
        rank, t = group_info(ctx.group)
        parts = [torch.empty_like(grad) for _ in range(t)]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=-1), None               # (..., d)


def copy_to_tp(x, group=None):
    return CopyToTP.apply(x, group)


def reduce_from_tp(x, group=None):
    return ReduceFromTP.apply(x, group)


def gather_last_dim(x, group=None):
    return _GatherLastDim.apply(x, group)


def split_last_dim(x, group=None):
    return _SplitLastDim.apply(x, group)


class ColumnParallelLinear(torch.nn.Module):
    """Y = X W^T + b with W's rows (output features) split over the group. weight: (out/t, in)."""

    def __init__(self, weight_shard, bias_shard=None, gather_output=False, group=None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight_shard)
        self.bias = None if bias_shard is None else torch.nn.Parameter(bias_shard)
        self.gather_output, self.group = gather_output, group

    @classmethod
    def from_dense(cls, linear: torch.nn.Linear, gather_output=False, group=None):
        """Rank r keeps the r-th of t row blocks of the dense layer (which every rank built identically)."""
        rank, t = group_info(group)
        assert linear.out_features % t == 0, f"out_features={linear.out_features} not divisible by t={t}"
        w = linear.weight.detach().chunk(t, dim=0)[rank].clone()
        b = None if linear.bias is None else linear.bias.detach().chunk(t, dim=0)[rank].clone()
        return cls(w, b, gather_output, group)

    def forward(self, x):                                   # x: (..., in), replicated
        x = copy_to_tp(x, self.group)                       # f: dX must be summed over ranks in backward
        y = F.linear(x, self.weight, self.bias)             # (..., out/t)
        return gather_last_dim(y, self.group) if self.gather_output else y


class RowParallelLinear(torch.nn.Module):
    """Y = X W^T + b with W's columns (input features) split over the group. weight: (out, in/t)."""

    def __init__(self, weight_shard, bias=None, input_is_parallel=True, group=None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight_shard)
        self.bias = None if bias is None else torch.nn.Parameter(bias)  # (out,), replicated
        self.input_is_parallel, self.group = input_is_parallel, group

    @classmethod
    def from_dense(cls, linear: torch.nn.Linear, input_is_parallel=True, group=None):
        rank, t = group_info(group)
        assert linear.in_features % t == 0, f"in_features={linear.in_features} not divisible by t={t}"
        w = linear.weight.detach().chunk(t, dim=1)[rank].clone()
        b = None if linear.bias is None else linear.bias.detach().clone()
        return cls(w, b, input_is_parallel, group)

    def forward(self, x):                                   # x: (..., in/t), or (..., in) if not parallel
        if not self.input_is_parallel:
            x = split_last_dim(x, self.group)               # (..., in/t)
        y = reduce_from_tp(F.linear(x, self.weight), self.group)  # g: sum of partial products, (..., out)
        return y if self.bias is None else y + self.bias    # the bias once, after the sum


class TensorParallelMLP(torch.nn.Module):
    """Megatron MLP: column-parallel fc1 -> GeLU on the local slice -> row-parallel fc2.

    One all-reduce in forward (g after fc2) and one in backward (f before fc1).
    """

    def __init__(self, fc1: ColumnParallelLinear, fc2: RowParallelLinear):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    @classmethod
    def from_dense(cls, fc1: torch.nn.Linear, fc2: torch.nn.Linear, group=None):
        return cls(ColumnParallelLinear.from_dense(fc1, gather_output=False, group=group),
                   RowParallelLinear.from_dense(fc2, input_is_parallel=True, group=group))

    def forward(self, x):                                   # (..., h)
        return self.fc2(F.gelu(self.fc1(x)))                # (..., f/t) inside, (..., h) out
