"""A top-k routed MoE layer, dense and expert-parallel (EP), and EP with expert tensor parallelism (ETP).

Routing (per token x, router weight W_r (E, H)):
    p = softmax(W_r x)                          (E,)   router probabilities
    experts, top = topk(p, k)                   (k,)   ties have probability 0 with random weights
    gates = top / sum(top)                      renormalised over the k chosen: GShard's top-2 gating
                                                (Lepikhin et al. 2020, Alg. 1), Megatron-LM's default (softmax
                                                over the top-k logits, moe_utils.topk_routing_with_score_function)
    capacity = ceil(C * N * k / E)              per expert, over the N tokens of one rank (Megatron's get_capacity);
                                                C = None: dropless, every assignment kept (Megatron's default)
    an expert keeps its first `capacity` assignments in token order; the rest are dropped (the token gets
    nothing from that expert; the other gate is not rescaled)
    aux = E * sum_i f_i P_i                     Switch Transformer (Fedus et al. 2021, Eq. 4-6) for top-k:
                                                f_i = assignments to i / (N k) (before drops), P_i = mean_n p_i
    y = sum_{kept j} gates_j * FFN_{experts_j}(x),  FFN_e(x) = W2_e gelu(W1_e x)

EP over t ranks: rank r holds experts r*E/t:(r+1)*E/t and its own N tokens. Forward: route locally, drop,
sort the kept assignments by expert, exchange the per-expert counts (one even all-to-all of E integers),
dispatch the rows (all_to_all_single with the counts as split sizes), run the local experts, combine (the
reverse all-to-all), scale by the gates and sum per token. Backward: the combine's backward is the dispatch's
all-to-all and vice versa (AllToAll swaps its split sizes); the counts need none.

Production pieces (week 11 §7-§11): grouped_ffn (all local experts in two torch._grouped_mm calls over rows sorted
by expert), AllGatherMoE (Megatron-LM's `allgather` dispatcher), route_biased and expert_bias_update (DeepSeek-V3's
auxiliary-loss-free balancing), z_loss (ST-MoE).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from reference.sp_layers import GatherFromSequence, ReduceScatterToSequence


def capacity(n_tokens: int, k: int, n_experts: int, factor: float) -> int:
    """Slots per expert for n_tokens tokens routed top-k: ceil(factor * n_tokens * k / n_experts)."""
    return math.ceil(factor * n_tokens * k / n_experts)


@dataclass
class Routing:
    experts: torch.Tensor   # (N, k) long: the chosen experts, best first
    gates: torch.Tensor     # (N, k): renormalised top-k probabilities (differentiable)
    keep: torch.Tensor      # (N, k) bool: False where the expert was full
    aux: torch.Tensor       # (): Switch's load-balancing loss, differentiable through P_i


def route(logits: torch.Tensor, k: int, factor: float | None) -> Routing:
    """Top-k routing of (N, E) logits with capacity `factor`, drops in token order; factor None: dropless."""
    N, E = logits.shape
    probs = logits.softmax(-1)                                   # (N, E)
    top, experts = probs.topk(k, dim=-1)                         # (N, k)
    gates = top / top.sum(-1, keepdim=True)
    onehot = F.one_hot(experts, E)                               # (N, k, E)
    # place of each assignment in its expert's queue: token order (a token never picks an expert twice)
    place = ((onehot.flatten(0, 1).cumsum(0).view(N, k, E) - 1) * onehot).sum(-1)   # (N, k)
    # dropless: a token never picks an expert twice, so no queue is longer than N
    keep = place < (N if factor is None else capacity(N, k, E, factor))
    f = onehot.sum((0, 1)).float() / (N * k)                     # (E,) fraction of assignments, no grad
    aux = E * (f * probs.mean(0)).sum()
    return Routing(experts, gates, keep, aux)


def expert_ffn(x, w1, w2):
    """One expert: (M, H) -> (M, H) with w1 (F, H), w2 (H, F)."""
    return F.gelu(x @ w1.T) @ w2.T


def dense_moe(x, w_router, w1, w2, k: int, factor: float, n_groups: int):
    """The single-device MoE: x (G*N, H) is n_groups blocks of N tokens (one per EP rank), each routed with its
    own capacity. Every expert runs on every token (E x the FLOPs) and the gate matrix picks: nothing here
    depends on how the experts are placed. Returns (y (G*N, H), aux per group (G,))."""
    logits = x @ w_router.T                                      # (G*N, E)
    E = w_router.shape[0]
    weight, aux = [], []
    for lg in logits.chunk(n_groups):
        r = route(lg, k, factor)
        weight.append(torch.zeros_like(lg).scatter_add(1, r.experts, r.gates * r.keep))   # (N, E)
        aux.append(r.aux)
    out = torch.stack([expert_ffn(x, w1[e], w2[e]) for e in range(E)], 1)                 # (G*N, E, H)
    return torch.einsum("ne,neh->nh", torch.cat(weight), out), torch.stack(aux)


class AllToAll(torch.autograd.Function):
    """Rows to ranks: in_splits[s] rows of x go to rank s, out_splits[s] rows arrive from rank s (rank order).
    Backward: every row's grad goes back to the rank it came from, i.e. the same all-to-all with the split
    sizes swapped (the adjoint of a permutation of rows is its inverse)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (list(out_splits), list(in_splits)), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))                        # (R, H)
        dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=group)
        return out

    @staticmethod
    def backward(ctx, dy):
        out_splits, in_splits = ctx.splits
        dx = dy.new_empty((sum(in_splits),) + tuple(dy.shape[1:]))                         # (M, H)
        dist.all_to_all_single(dx, dy.contiguous(), in_splits, out_splits, group=ctx.group)
        return dx, None, None, None


def exchange_counts(counts: torch.Tensor, group=None) -> torch.Tensor:
    """counts (E,): rows this rank sends to each expert -> (t, E/t): rows rank s sends to each local expert.
    The receivers must know their split sizes before the rows move: one even all-to-all of E integers."""
    t = dist.get_world_size(group)
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts.contiguous(), group=group)
    return recv.view(t, -1)


def dispatch_plan(r: Routing, n_experts: int):
    """The kept assignments sorted by expert (token order within one): (token, choice, expert) index vectors
    and the per-expert counts (E,)."""
    tok, choice = r.keep.nonzero(as_tuple=True)                  # token-major order
    e = r.experts[tok, choice]
    order = torch.sort(e, stable=True).indices
    return tok[order], choice[order], e[order], torch.bincount(e, minlength=n_experts)


def local_experts(xin, recv_counts, w1, w2):
    """Rows arrive grouped by source rank, then by local expert (t, L blocks): sort them by expert (stable, Megatron's
    second permutation), run all experts in one grouped GEMM, put the results back in arrival order."""
    which = torch.arange(recv_counts.shape[1], device=recv_counts.device).repeat(recv_counts.shape[0])
    row_expert = torch.repeat_interleave(which, recv_counts.flatten())                    # (R,) local expert of each row
    order = torch.sort(row_expert, stable=True).indices                                   # (R,)
    out = grouped_ffn(xin[order], recv_counts.sum(0), w1, w2)                             # (R, H) sorted by expert
    return torch.empty_like(out).index_copy(0, order, out)


class EPMoE(nn.Module):
    """Rank r of t holds the router (replicated) and experts r*E/t:(r+1)*E/t: w1 (E/t, F, H), w2 (E/t, H, F)."""

    def __init__(self, w_router, w1, w2, k: int, factor: float, group=None):
        super().__init__()
        self.router = nn.Parameter(w_router.detach().clone())                             # (E, H)
        self.w1 = nn.Parameter(w1.detach().clone())                                       # (E/t, F, H)
        self.w2 = nn.Parameter(w2.detach().clone())                                       # (E/t, H, F)
        self.k, self.factor, self.group = k, factor, group

    def forward(self, x):                                        # x (N, H): this rank's tokens
        t = dist.get_world_size(self.group)
        E = self.router.shape[0]
        r = route(x @ self.router.T, self.k, self.factor)
        tok, choice, _, counts = dispatch_plan(r, E)             # dropped assignments never leave the rank
        recv_counts = exchange_counts(counts, self.group)        # (t, E/t)
        send, recv = counts.view(t, -1).sum(1).tolist(), recv_counts.sum(1).tolist()
        xin = AllToAll.apply(x[tok], recv, send, self.group)     # (R, H) dispatch
        out = local_experts(xin, recv_counts, self.w1, self.w2)  # (R, H)
        back = AllToAll.apply(out, send, recv, self.group)       # (M, H) combine: the reverse all-to-all
        w = r.gates[tok, choice].unsqueeze(1)                    # (M, 1)
        return torch.zeros_like(x).index_add(0, tok, back * w)   # (N, H)


class _GatherRowsV(torch.autograd.Function):
    """All-gather of uneven row blocks over a TP group (rank order), written as an all_to_all_single so the
    ledger counts its uneven bytes. Backward: the reduce-scatter-v (each block's grad summed on its owner)."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        me = dist.get_rank(group)
        out = x.new_empty((sum(sizes), x.shape[1]))
        dist.all_to_all_single(out, x.repeat(len(sizes), 1), sizes, [sizes[me]] * len(sizes), group=group)
        return out

    @staticmethod
    def backward(ctx, dy):
        return _scatter_sum(dy, ctx.sizes, ctx.group), None, None


def _scatter_sum(y, sizes, group):
    me = dist.get_rank(group)
    parts = y.new_empty((len(sizes) * sizes[me], y.shape[1]))
    dist.all_to_all_single(parts, y.contiguous(), [sizes[me]] * len(sizes), sizes, group=group)
    return parts.view(len(sizes), sizes[me], -1).sum(0)


class _ScatterRowsV(torch.autograd.Function):
    """Reduce-scatter-v of row-parallel partial sums over a TP group; backward: the all-gather-v."""

    @staticmethod
    def forward(ctx, y, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _scatter_sum(y, sizes, group)

    @staticmethod
    def backward(ctx, dy):
        return _GatherRowsV.apply(dy, ctx.sizes, ctx.group), None, None


class ETPMoE(EPMoE):
    """EP over ep_group x expert TP over tp_group (Megatron's expert_tensor_parallel_size): rank (e, p) holds
    experts e*E/ep:(e+1)*E/ep, w1 rows and w2 columns p*F/tp:(p+1)*F/tp. After the EP dispatch the TP group
    all-gathers its rows (every TP rank of an expert needs all of them), each computes a partial FFN output
    (row-parallel w2) and a reduce-scatter sums them back to the rank that received the rows."""

    def __init__(self, w_router, w1, w2, k, factor, ep_group, tp_group):
        super().__init__(w_router, w1, w2, k, factor, ep_group)
        self.tp_group = tp_group

    def forward(self, x):                                        # x (N, H): this rank's sequence shard
        ep, tp = dist.get_world_size(self.group), dist.get_world_size(self.tp_group)
        E = self.router.shape[0]
        r = route(x @ self.router.T, self.k, self.factor)
        tok, choice, _, counts = dispatch_plan(r, E)
        recv_counts = exchange_counts(counts, self.group)        # (ep, E/ep)
        send, recv = counts.view(ep, -1).sum(1).tolist(), recv_counts.sum(1).tolist()
        xin = AllToAll.apply(x[tok], recv, send, self.group)     # (R, H)
        peers = recv_counts.new_empty((tp * ep, recv_counts.shape[1]))                     # (tp*ep, E/ep)
        dist.all_gather_single(peers, recv_counts, group=self.tp_group)
        sizes = peers.view(tp, -1).sum(1).tolist()               # rows each TP peer received
        xall = _GatherRowsV.apply(xin, sizes, self.tp_group)     # (sum R_p, H)
        part = local_experts(xall, peers, self.w1, self.w2)      # (sum R_p, H) partial sums over F/tp
        out = _ScatterRowsV.apply(part, sizes, self.tp_group)    # (R, H)
        back = AllToAll.apply(out, send, recv, self.group)
        w = r.gates[tok, choice].unsqueeze(1)
        return torch.zeros_like(x).index_add(0, tok, back * w)


def grouped_ffn(x, counts, w1, w2):
    """All L local experts at once on rows sorted by expert: x (M, H), counts (L,) rows per expert, w1 (L, F, H),
    w2 (L, H, F) -> (M, H). torch._grouped_mm(A, B, offs) multiplies rows offs[l-1]:offs[l] of A by B[l]: one
    kernel for every expert, however uneven the counts (torchtitan's GroupedExperts; Megatron's GroupedMLP)."""
    offs = counts.cumsum(0).to(torch.int32)                      # (L,) end row of each expert's block
    h = F.gelu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs))                   # (M, F)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)                       # (M, H)


class AllGatherMoE(EPMoE):
    """Megatron-LM's `allgather` dispatcher (MoEAllGatherTokenDispatcher) over an EP group of t ranks with N tokens
    each: all-gather every token and its (N, E) combine weights, run MY experts on the tokens routed to them, scale by
    the gates on the expert side, and reduce-scatter: each token's partial outputs are summed on its owner. No
    counts, no split sizes (nothing to wait for on the host), but every rank receives all tN tokens."""

    def forward(self, x):                                        # x (N, H): this rank's tokens, N equal on all ranks
        t, me = dist.get_world_size(self.group), dist.get_rank(self.group)
        E, L = self.router.shape[0], self.w1.shape[0]
        r = route(x @ self.router.T, self.k, self.factor)
        weight = x.new_zeros(x.shape[0], E).scatter_add(1, r.experts, r.gates * r.keep)      # (N, E), any E vs H
        xs = GatherFromSequence.apply(x.unsqueeze(0), self.group)[0]                      # (tN, H)
        ws = GatherFromSequence.apply(weight.unsqueeze(0), self.group)[0]                 # (tN, E)
        out = torch.zeros_like(xs)
        for l in range(L):
            g = ws[:, me * L + l]                                # (tN,) my expert l's gate for every token
            idx = g.nonzero().squeeze(1)
            out = out.index_add(0, idx, g[idx, None] * expert_ffn(xs[idx], self.w1[l], self.w2[l]))
        return ReduceScatterToSequence.apply(out.unsqueeze(0), self.group)[0]             # (N, H)


def route_biased(logits, k: int, bias):
    """DeepSeek-V3's routing (Eq. 13-16): s = sigmoid(logits) (N, E); the k experts with the largest s + bias are
    chosen, but the gates are the ORIGINAL scores renormalised over them: the bias steers selection only and gets no
    gradient. Dropless. Returns (experts (N, k), gates (N, k))."""
    s = logits.sigmoid()                                         # (N, E) affinities
    experts = (s + bias).topk(k, dim=-1).indices                 # (N, k) selection with the bias
    top = s.gather(1, experts)                                   # (N, k) weights without it
    return experts, top / top.sum(-1, keepdim=True)


def expert_bias_update(bias, load, rate: float):
    """DeepSeek-V3 Sec. 2.1.2 (Megatron-LM's get_updated_expert_bias, torchtitan's optimizer hook): after each step
    b_i += rate * sign(mean load - load_i): overloaded experts become less attractive, underloaded ones more. `load`
    (E,) must be the global count (all-reduced over the data-parallel ranks) so every rank applies the same update."""
    return bias + rate * torch.sign(load.float().mean() - load.float())


def z_loss(logits):
    """ST-MoE's router z-loss (Zoph et al. 2022, Eq. 5): mean over tokens of logsumexp(logits)^2. It pulls the
    logits towards 0 (d/dz_j = 2 lse p_j / N: the likeliest expert's logit most), which keeps the router's
    exponentials and their round-off small in bf16."""
    return logits.logsumexp(-1).square().mean()
