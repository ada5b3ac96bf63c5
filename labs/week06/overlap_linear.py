"""Week 6: ring AG+GEMM and GEMM+RS (overlap P2P with compute) and the linears built on them."""
import torch
import torch.distributed as dist
import torch.nn.functional as F


def ring_peers(group=None):
    """(t, r, global rank of r+1, global rank of r-1): P2P ops take global ranks."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    glob = (lambda i: i) if group is None else (lambda i: dist.get_global_rank(group, i))
    return t, r, glob((r + 1) % t), glob((r - 1) % t)


def post_ring_step(send, recv, group=None):
    """Post send(send -> r+1) and recv(recv <- r-1) together; return their Work handles (not waited)."""
    # hint: dist.batch_isend_irecv([dist.P2POp(dist.isend, ...), dist.P2POp(dist.irecv, ...)])
    ### BEGIN SOLUTION
    _, _, nxt, prv = ring_peers(group)
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, group),
                                   dist.P2POp(dist.irecv, recv, prv, group)])
    ### END SOLUTION


def ring_all_gather_matmul(x_s, weight, group=None):
    """x_s (B, T/t, C), weight (O, C) -> (Y (B, T, O), gathered x (B, T, C))."""
    # hint: bufs = [x_s, empty_like]; step k holds block (r - k) % t; post k+1, GEMM k, wait
    ### BEGIN SOLUTION
    t, r, _, _ = ring_peers(group)
    B, Tc, C = x_s.shape
    y = x_s.new_empty(B, t * Tc, weight.shape[0])                   # (B, T, O)
    x_full = x_s.new_empty(B, t * Tc, C)                            # (B, T, C)
    bufs = [x_s.contiguous(), torch.empty_like(x_s)]
    for k in range(t):
        src = (r - k) % t
        cur = bufs[k % 2]
        works = post_ring_step(cur, bufs[(k + 1) % 2], group) if k < t - 1 else []   # prefetch step k+1 ...
        y[:, src * Tc:(src + 1) * Tc] = F.linear(cur, weight)                       # ... behind GEMM k
        x_full[:, src * Tc:(src + 1) * Tc] = cur
        for w in works:
            w.wait()
    return y, x_full
    ### END SOLUTION


def matmul_reduce_scatter(x, weight, group=None):
    """x (B, T, I), weight (O, I) -> this rank's block (B, T/t, O) of sum over ranks of x @ weight.T."""
    # hint: for k in range(t): GEMM of block (r-k-1) % t; if k > 0: wait, add the received sum; if k < t-1: post it
    ### BEGIN SOLUTION
    t, r, _, _ = ring_peers(group)
    Tc = x.shape[1] // t
    works, recv = [], None
    for k in range(t):
        c = (r - k - 1) % t
        part = F.linear(x[:, c * Tc:(c + 1) * Tc], weight)         # (B, T/t, O), overlaps step k-1's transfer
        if k > 0:
            for w in works:
                w.wait()
            part = part + recv
        if k < t - 1:
            recv = torch.empty_like(part)
            works = post_ring_step(part.contiguous(), recv, group)
    return part
    ### END SOLUTION


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_s, weight, group):
        ### BEGIN SOLUTION
        y, x_full = ring_all_gather_matmul(x_s, weight, group)
        ctx.save_for_backward(x_full, weight)
        ctx.group = group
        return y
        ### END SOLUTION

    @staticmethod
    def backward(ctx, dy):
        # hint: dX block = matmul_reduce_scatter(dy, W.t()); dW = dy^T x_full over all (B*T) rows
        ### BEGIN SOLUTION
        x_full, weight = ctx.saved_tensors
        dx_s = matmul_reduce_scatter(dy, weight.t(), ctx.group)       # (B, T/t, C)
        dw = dy.flatten(0, -2).t() @ x_full.flatten(0, -2)            # (O/t, C)
        return dx_s, dw, None
        ### END SOLUTION


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group):
        ### BEGIN SOLUTION
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return matmul_reduce_scatter(x, weight, group)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, dy_s):
        # hint: dx, dy_full = ring_all_gather_matmul(dy_s, W.t()); dW = dy_full^T x
        ### BEGIN SOLUTION
        x, weight = ctx.saved_tensors
        dx, dy = ring_all_gather_matmul(dy_s, weight.t(), ctx.group)  # (B, T, I/t), (B, T, O)
        dw = dy.flatten(0, -2).t() @ x.flatten(0, -2)                 # (O, I/t)
        return dx, dw, None
        ### END SOLUTION


class OverlapColumnParallelLinear(torch.nn.Module):
    def __init__(self, weight, group=None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)                      # (O/t, C)
        self.group = group

    @classmethod
    def from_dense(cls, linear, group=None):
        ### BEGIN SOLUTION
        t, r = dist.get_world_size(group), dist.get_rank(group)
        if linear.out_features % t:
            raise ValueError(f"out_features={linear.out_features} is not divisible by t={t}")
        return cls(linear.weight.detach().chunk(t, dim=0)[r].clone(), group)
        ### END SOLUTION

    def forward(self, x_s):
        return _AllGatherMatmul.apply(x_s, self.weight, self.group)


class OverlapRowParallelLinear(torch.nn.Module):
    def __init__(self, weight, group=None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)                      # (O, I/t)
        self.group = group

    @classmethod
    def from_dense(cls, linear, group=None):
        ### BEGIN SOLUTION
        t, r = dist.get_world_size(group), dist.get_rank(group)
        if linear.in_features % t:
            raise ValueError(f"in_features={linear.in_features} is not divisible by t={t}")
        return cls(linear.weight.detach().chunk(t, dim=1)[r].clone(), group)
        ### END SOLUTION

    def forward(self, x):
        return _MatmulReduceScatter.apply(x, self.weight, self.group)
