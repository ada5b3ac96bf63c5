"""Data parallelism last (the gradient plan), one 1F1B step, and the single-device run it must reproduce
(week 12 §3-§4)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from reference.capstone.layout import ParallelDims
from reference.capstone.stage import Stage
from reference.schedules import one_f_one_b
from tpkit.capstone_model import CapstoneConfig, LlamaMoE


def grad_plan(stage: Stage) -> dict[str, tuple[str, ...]]:
    """parameter name -> the groups its gradient is summed over (in this order). The rule: a gradient is summed
    over every group whose ranks hold the SAME value of the parameter but saw DIFFERENT tokens.
    - tp-sharded weights: each tp rank holds a different block -> only over dp (the replicas of that block);
    - replicated weights (norms, router): over dp; under SP also over tp (each tp rank saw T/t of the tokens);
    - experts: the ep ranks hold different experts and the all-to-all already brought every ep rank's tokens
      to them -> over edp (the replicas of the same experts), and under SP over tp too."""
    tp = ("tp",) if stage.dims.sp else ()
    kinds = {}
    for _, p, _, place in stage.shards():
        kinds[id(p)] = ("edp",) + tp if place == ("ep", 0) else ("dp",) + tp if place is None else ("dp",)
    return {n: kinds[id(p)] for n, p in stage.named_parameters()}


def reduce_grads(stage: Stage, groups: dict, plan: dict[str, tuple[str, ...]] | None = None):
    """One all-reduce (SUM) per group of the flattened grads that the plan sends there (a bucket, as DDP does)."""
    plan = grad_plan(stage) if plan is None else plan
    params = dict(stage.named_parameters())
    for dim in ("tp", "dp", "edp"):
        group, ranks = groups[dim]
        names = [n for n, dims in plan.items() if dim in dims]
        if len(ranks) == 1 or not names:
            continue
        flat = torch.cat([params[n].grad.flatten() for n in names])
        dist.all_reduce(flat, group=group)
        for n, piece in zip(names, flat.split([params[n].numel() for n in names])):
            params[n].grad.copy_(piece.view_as(params[n]))


def train_step(stage: Stage, ids, targets, n_micro: int, groups: dict, plan=None):
    """Forward and backward of this DP rank's batch (b_dp, T) in n_micro micro-batches through the pipeline,
    then the gradient reductions. The loss of each micro-batch is scaled by 1/(n_micro * dp), so the summed
    gradients are those of the mean over the global batch. Returns that mean loss on the last stage (all-reduced
    over dp), None elsewhere."""
    dims = stage.dims
    pp_group, pp_ranks = groups["pp"]
    s = pp_ranks.index(dist.get_rank())
    mb_ids, mb_tgt = ids.chunk(n_micro), targets.chunk(n_micro)
    act = (ids.shape[0] // n_micro, ids.shape[1] // (dims.tp if dims.sp else 1), stage.hidden)   # (b, T or T/t, C)
    saved, sends, losses = {}, [], []
    for kind, mb in one_f_one_b(dims.pp, n_micro)[s]:
        if kind == "F":
            x = mb_ids[mb]
            if not stage.first:
                x = torch.empty(act)
                dist.recv(x, group=pp_group, group_src=s - 1)
                x.requires_grad_(True)
            y = stage(x)
            if stage.last:
                y = stage.loss(y, mb_tgt[mb]) / (n_micro * dims.dp)
                losses.append(y.detach())
            else:
                sends.append(dist.isend(y.detach().contiguous(), group=pp_group, group_dst=s + 1))
            saved[mb] = (x, y)
        else:
            x, y = saved.pop(mb)
            if stage.last:
                y.backward()
            else:
                dy = torch.empty(act)
                dist.recv(dy, group=pp_group, group_src=s + 1)
                y.backward(dy)
            if not stage.first:
                sends.append(dist.isend(x.grad.contiguous(), group=pp_group, group_dst=s - 1))
    for w in sends:
        w.wait()
    reduce_grads(stage, groups, plan)
    if not stage.last:
        return None
    loss = torch.stack(losses).sum()
    dist.all_reduce(loss, group=groups["dp"][0])
    return loss


def data_of_rank(ids, targets, dims: ParallelDims, rank: int):
    """This rank's share of the global batch: dp rank d takes the d-th block of rows."""
    d = dims.coords(rank)["dp"]
    return ids.chunk(dims.dp)[d], targets.chunk(dims.dp)[d]


def make_optimizer(stage: nn.Module, lr: float = 0.05, momentum: float = 0.9):
    """SGD with momentum: elementwise, so each rank's shard follows the dense run exactly, and its momentum
    buffers are state a checkpoint must keep."""
    return torch.optim.SGD(stage.parameters(), lr=lr, momentum=momentum)


def dense_run(cfg: CapstoneConfig, seed: int, batches, lr: float = 0.05, momentum: float = 0.9, keep=()):
    """Train the dense model on `batches` [(ids, targets)] with the same optimizer: the per-step losses and
    {step: {name: weight}} after each step in `keep` and after the last."""
    from tpkit.capstone_model import init_capstone, lm_loss
    model = init_capstone(LlamaMoE(cfg), seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses, states = [], {}
    for i, (ids, tgt) in enumerate(batches, 1):
        loss = lm_loss(model(ids), tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if i in keep or i == len(batches):
            states[i] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, states


def dense_shard(state: dict, name: str, place, coords: dict, dims: ParallelDims) -> torch.Tensor:
    """The block of dense tensor `name` that a rank at `coords` holds under `place` (for comparisons)."""
    w = state[name]
    if place is None:
        return w
    dim_name, d = place
    return w.chunk(dims.tp if dim_name == "tp" else dims.ep, dim=d)[coords[dim_name]]


def batches(cfg: CapstoneConfig, n_steps: int, batch: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    V = cfg.model.vocab_size
    return [(torch.randint(0, V, (batch, seq), generator=g), torch.randint(0, V, (batch, seq), generator=g))
            for _ in range(n_steps)]
