"""Pipeline schedules, a 1F1B pipeline over send/recv, and a 3-D topology planner (week 9)."""
import torch
import torch.distributed as dist


def gpipe(p, m):
    """GPipe (Huang et al. 2019): every stage runs the m forwards, then the m backwards."""
    # hint: one list per stage: ("F", mb) for mb in 0..m-1, then ("B", mb) for mb in 0..m-1
    raise NotImplementedError("write this part: see the task above")


def one_f_one_b(p, m):
    """1F1B (Narayanan et al. 2021): warm-up forwards, then one F + one B, then the remaining Bs."""
    # hint: stage s runs min(p - s - 1, m) forwards first; in the steady state F(i) comes before B(i - warm)
    raise NotImplementedError("write this part: see the task above")


def run_pipeline(stage, micro_batches, targets, n_micro, act_shape, loss_fn, group=None):
    """One training step of this rank's stage in 1F1B order. Returns the mean loss on the last stage
    (None elsewhere) and leaves the gradient of that mean loss in the stage's parameters' .grad."""
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    first, last = rank == 0, rank == p - 1
    # hint: walk one_f_one_b(p, n_micro)[rank]; keep (input, output) of each micro-batch in a dict until its B
    raise NotImplementedError("write this part: see the task above")


from grader.topology import ClusterSpec, ModelSpec, Plan   # noqa: E402  (the given dataclasses)


def memory_per_gpu(model, cluster, tp, pp, dp):
    """Bytes per GPU of a (tp, pp, dp) layout: weights, grads, optimizer states, activations."""
    # hint: m = global_batch // (dp * micro_batch); activations = (L/pp) * min(pp, m) * s*b*h*34/tp
    raise NotImplementedError("write this part: see the task above")


def step_time(model, cluster, tp, pp, dp):
    """Estimated seconds per optimizer step of a (tp, pp, dp) layout."""
    # hint: (m + pp - 1) * (t_c + t_tp + t_pp) + t_dp, one bf16 activation is 2*b*s*h bytes
    raise NotImplementedError("write this part: see the task above")


def plan(model, cluster):
    """The fastest (tp, pp, dp) layout that fits in memory, as a Plan; None when nothing fits."""
    # hint: loop tp over divisors of gpus_per_node (not of all GPUs!), pp over divisors of n_layers
    raise NotImplementedError("write this part: see the task above")
