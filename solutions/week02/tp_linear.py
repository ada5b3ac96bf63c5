"""Column- and row-parallel linear layers (Megatron-LM, Shoeybi et al. 2019, Sec. 3)."""
import torch
import torch.distributed as dist


class CopyToParallelRegion(torch.autograd.Function):
    """f: identity forward; all-reduce backward (each rank's dX is a partial sum)."""

    @staticmethod
    def forward(ctx, x, group):
        ### BEGIN SOLUTION
        ctx.group = group
        return x.view_as(x)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
        ### END SOLUTION


class ReduceFromParallelRegion(torch.autograd.Function):
    """g: all-reduce forward (sum the partial outputs); identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        ### BEGIN SOLUTION
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        return grad, None
        ### END SOLUTION


class GatherFromParallelRegion(torch.autograd.Function):
    """All-gather along the last dim forward; keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x, group):
        ### BEGIN SOLUTION
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)                         # (..., out)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        rank, world = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return grad.chunk(world, dim=-1)[rank].contiguous(), None  # (..., out/t)
        ### END SOLUTION


class ScatterToParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ### BEGIN SOLUTION
        ctx.group = group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        return x.chunk(world, dim=-1)[rank].contiguous()        # (..., in/t)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=-1), None                   # (..., in)
        ### END SOLUTION


class ColumnParallelLinear(torch.nn.Module):
    """Y = X W^T + b with W split by rows (output features) across the group."""

    def __init__(self, weight, bias, gather_output=True, group=None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)                # (out/t, in)
        self.bias = None if bias is None else torch.nn.Parameter(bias)  # (out/t,)
        self.gather_output = gather_output
        self.group = group

    @classmethod
    def from_dense(cls, linear, gather_output=True, group=None):
        # hint: rank r keeps the r-th of t equal blocks of rows of linear.weight (and of linear.bias)
        ### BEGIN SOLUTION
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if linear.out_features % world:
            raise ValueError(f"out_features={linear.out_features} is not divisible by the group size {world}")
        w = linear.weight.detach().chunk(world, dim=0)[rank].clone()
        b = None if linear.bias is None else linear.bias.detach().chunk(world, dim=0)[rank].clone()
        return cls(w, b, gather_output, group)
        ### END SOLUTION

    def forward(self, x):
        # hint: f, then a local linear, then (if gather_output) the gather
        ### BEGIN SOLUTION
        x = CopyToParallelRegion.apply(x, self.group)
        y = torch.nn.functional.linear(x, self.weight, self.bias)  # (..., out/t)
        if self.gather_output:
            y = GatherFromParallelRegion.apply(y, self.group)      # (..., out)
        return y
        ### END SOLUTION


class RowParallelLinear(torch.nn.Module):
    """Y = X W^T + b with W split by columns (input features) across the group."""

    def __init__(self, weight, bias, input_is_parallel=False, group=None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)                # (out, in/t)
        self.bias = None if bias is None else torch.nn.Parameter(bias)  # (out,), replicated
        self.input_is_parallel = input_is_parallel
        self.group = group

    @classmethod
    def from_dense(cls, linear, input_is_parallel=False, group=None):
        # hint: rank r keeps the r-th block of columns of linear.weight; the bias stays whole
        ### BEGIN SOLUTION
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if linear.in_features % world:
            raise ValueError(f"in_features={linear.in_features} is not divisible by the group size {world}")
        w = linear.weight.detach().chunk(world, dim=1)[rank].clone()
        b = None if linear.bias is None else linear.bias.detach().clone()
        return cls(w, b, input_is_parallel, group)
        ### END SOLUTION

    def forward(self, x):
        # hint: (scatter unless input_is_parallel), a local linear without bias, g, then the bias
        ### BEGIN SOLUTION
        if not self.input_is_parallel:
            x = ScatterToParallelRegion.apply(x, self.group)    # (..., in/t)
        y = torch.nn.functional.linear(x, self.weight)         # (..., out), a partial sum
        y = ReduceFromParallelRegion.apply(y, self.group)
        if self.bias is not None:
            y = y + self.bias                                  # once, after the sum
        return y
        ### END SOLUTION
