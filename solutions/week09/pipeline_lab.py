"""Pipeline schedules, a 1F1B pipeline over send/recv, and a 3-D topology planner (week 9)."""
import torch
import torch.distributed as dist


def gpipe(p, m):
    """GPipe (Huang et al. 2019): every stage runs the m forwards, then the m backwards."""
    # hint: one list per stage: ("F", mb) for mb in 0..m-1, then ("B", mb) for mb in 0..m-1
    ### BEGIN SOLUTION
    return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(p)]
    ### END SOLUTION


def one_f_one_b(p, m):
    """1F1B (Narayanan et al. 2021): warm-up forwards, then one F + one B, then the remaining Bs."""
    # hint: stage s runs min(p - s - 1, m) forwards first; in the steady state F(i) comes before B(i - warm)
    ### BEGIN SOLUTION
    schedule = []
    for s in range(p):
        warm = min(p - s - 1, m)
        acts = [("F", i) for i in range(warm)]
        for i in range(warm, m):
            acts += [("F", i), ("B", i - warm)]
        acts += [("B", i) for i in range(m - warm, m)]
        schedule.append(acts)
    return schedule
    ### END SOLUTION


def run_pipeline(stage, micro_batches, targets, n_micro, act_shape, loss_fn, group=None):
    """One training step of this rank's stage in 1F1B order. Returns the mean loss on the last stage
    (None elsewhere) and leaves the gradient of that mean loss in the stage's parameters' .grad."""
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    first, last = rank == 0, rank == p - 1
    # hint: walk one_f_one_b(p, n_micro)[rank]; keep (input, output) of each micro-batch in a dict until its B
    ### BEGIN SOLUTION
    saved, losses, pending = {}, [], []
    for kind, mb in one_f_one_b(p, n_micro)[rank]:
        if kind == "F":
            if first:
                x = micro_batches[mb]                                   # (b, T) token ids
            else:
                x = torch.empty(act_shape)                              # (b, T, C)
                dist.recv(x, group=group, group_src=rank - 1)
                x.requires_grad_()                                      # we must send dL/dx back
            y = stage(x)
            if last:
                y = loss_fn(y, targets[mb]) / n_micro                   # the step's loss is the mean
                losses.append(y.detach())
            else:
                out = y.detach()
                pending.append((dist.isend(out, group=group, group_dst=rank + 1), out))
            saved[mb] = (x, y)
        else:
            x, y = saved.pop(mb)                                        # frees this micro-batch after B
            if last:
                y.backward()
            else:
                dy = torch.empty(act_shape)                             # dL/d(output) from the next stage
                dist.recv(dy, group=group, group_src=rank + 1)
                y.backward(dy)
            if not first:
                pending.append((dist.isend(x.grad, group=group, group_dst=rank - 1), x.grad))
    for work, _ in pending:                                             # the tensors stay alive until sent
        work.wait()
    return torch.stack(losses).sum() if last else None
    ### END SOLUTION


from grader.topology import ClusterSpec, ModelSpec, Plan   # noqa: E402  (the given dataclasses)


def memory_per_gpu(model, cluster, tp, pp, dp):
    """Bytes per GPU of a (tp, pp, dp) layout: weights, grads, optimizer states, activations."""
    # hint: m = global_batch // (dp * micro_batch); activations = (L/pp) * min(pp, m) * s*b*h*34/tp
    ### BEGIN SOLUTION
    P, L = model.n_params, model.n_layers
    m = model.global_batch // (dp * model.micro_batch)
    per_layer = model.seq_len * model.micro_batch * model.hidden * 34 / tp
    return {"weights": 2 * P / (tp * pp), "grads": 2 * P / (tp * pp), "optimizer": 12 * P / (tp * pp * dp),
            "activations": (L / pp) * min(pp, m) * per_layer}
    ### END SOLUTION


def step_time(model, cluster, tp, pp, dp):
    """Estimated seconds per optimizer step of a (tp, pp, dp) layout."""
    # hint: (m + pp - 1) * (t_c + t_tp + t_pp) + t_dp, one bf16 activation is 2*b*s*h bytes
    ### BEGIN SOLUTION
    P, L, b, s, h = model.n_params, model.n_layers, model.micro_batch, model.seq_len, model.hidden
    m = model.global_batch // (dp * b)
    act = 2 * b * s * h
    t_c = 6 * P * b * s / (tp * pp) / (cluster.peak_flops * cluster.mfu)
    t_tp = (L / pp) * 8 * (tp - 1) / tp * act / cluster.bw_intra
    t_pp = 2 * act / cluster.bw_inter if pp > 1 else 0.0
    t_dp = 2 * (dp - 1) / dp * 2 * P / (tp * pp) / cluster.bw_inter
    return (m + pp - 1) * (t_c + t_tp + t_pp) + t_dp
    ### END SOLUTION


def plan(model, cluster):
    """The fastest (tp, pp, dp) layout that fits in memory, as a Plan; None when nothing fits."""
    # hint: loop tp over divisors of gpus_per_node (not of all GPUs!), pp over divisors of n_layers
    ### BEGIN SOLUTION
    best = None
    for tp in range(1, cluster.gpus_per_node + 1):
        if cluster.gpus_per_node % tp or model.n_heads % tp:
            continue
        for pp in range(1, model.n_layers + 1):
            if model.n_layers % pp or cluster.n_gpus % (tp * pp):
                continue
            dp = cluster.n_gpus // (tp * pp)
            if model.global_batch % (dp * model.micro_batch):
                continue
            mem = memory_per_gpu(model, cluster, tp, pp, dp)
            if sum(mem.values()) > cluster.gpu_mem:
                continue
            t = step_time(model, cluster, tp, pp, dp)
            if best is None or t < best.time["step"] * (1 - 1e-9):
                best = Plan(tp, pp, dp, model.global_batch // (dp * model.micro_batch), mem, {"step": t})
    return best
    ### END SOLUTION
