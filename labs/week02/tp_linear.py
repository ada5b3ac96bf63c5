"""Column- and row-parallel linear layers (Megatron-LM, Shoeybi et al. 2019, Sec. 3)."""
import torch
import torch.distributed as dist


class CopyToParallelRegion(torch.autograd.Function):
    """f: identity forward; all-reduce backward (each rank's dX is a partial sum)."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("write this part: see the task above")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("write this part: see the task above")


class ReduceFromParallelRegion(torch.autograd.Function):
    """g: all-reduce forward (sum the partial outputs); identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("write this part: see the task above")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("write this part: see the task above")


class GatherFromParallelRegion(torch.autograd.Function):
    """All-gather along the last dim forward; keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("write this part: see the task above")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("write this part: see the task above")


class ScatterToParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("write this part: see the task above")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("write this part: see the task above")


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
        raise NotImplementedError("write this part: see the task above")

    def forward(self, x):
        # hint: f, then a local linear, then (if gather_output) the gather
        raise NotImplementedError("write this part: see the task above")


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
        raise NotImplementedError("write this part: see the task above")

    def forward(self, x):
        # hint: (scatter unless input_is_parallel), a local linear without bias, g, then the bias
        raise NotImplementedError("write this part: see the task above")
