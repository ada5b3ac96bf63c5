"""A 3-D (TP x PP x DP) planner: memory per GPU and an estimated step time for each layout.

Memory per GPU (bytes), P parameters, mixed-precision Adam with a distributed optimizer
(ZeRO-1: Rajbhandari et al. 2020 count 2 + 2 + 12 bytes per parameter):
    weights     2 P / (t p)              bf16 copy used by forward and backward
    grads       2 P / (t p)              bf16 gradients
    optimizer  12 P / (t p d)            fp32 master weights, Adam m and v, sharded over DP
    activations (L / p) * min(p, m) * s b h * 34 / t
                                         Korthikanti et al. 2022, Table 2, TP + SP + selective
                                         recompute; 1F1B keeps min(p, m) micro-batches in flight
                                         on the first stage, each holding L/p layers.
Step time (seconds), t_c = 6 P b s / (t p) / (peak * mfu) per micro-batch per GPU:
    T = (m + p - 1) * (t_c + t_tp + t_pp) + t_dp
    t_tp = (L/p) * 8 (t-1)/t * 2 b s h / bw_tp        4 AR-equivalents fwd+bwd per layer (Megatron)
    t_pp = 2 * 2 b s h / bw_inter  (p > 1)             one activation forward, one grad back
    t_dp = 2 (d-1)/d * 2 P / (t p) / bw_inter          RS + AG of the bf16 gradients (not overlapped)
m = global_batch / (d b) micro-batches per pipeline. TP stays inside a node (t | gpus_per_node):
its collectives sit on the critical path of every layer and need NVLink bandwidth.
"""
from __future__ import annotations

from tpkit.topology import GB, ClusterSpec, ModelSpec, Plan, activation_bytes_per_layer


def memory_per_gpu(model: ModelSpec, cluster: ClusterSpec, tp: int, pp: int, dp: int) -> dict:
    P, L = model.n_params, model.n_layers
    m = model.global_batch // (dp * model.micro_batch)
    act_layer = activation_bytes_per_layer(model.seq_len, model.micro_batch, model.hidden, model.n_heads, tp)
    return {"weights": 2 * P / (tp * pp),
            "grads": 2 * P / (tp * pp),
            "optimizer": 12 * P / (tp * pp * dp),
            "activations": (L / pp) * min(pp, m) * act_layer}


def step_time(model: ModelSpec, cluster: ClusterSpec, tp: int, pp: int, dp: int) -> dict:
    P, L, b, s, h = model.n_params, model.n_layers, model.micro_batch, model.seq_len, model.hidden
    m = model.global_batch // (dp * b)
    act = 2 * b * s * h                                                # one bf16 (b, s, h) activation
    t_c = 6 * P * b * s / (tp * pp) / (cluster.peak_flops * cluster.mfu)
    t_tp = (L / pp) * 8 * (tp - 1) / tp * act / cluster.bw_intra
    t_pp = 2 * act / cluster.bw_inter if pp > 1 else 0.0
    t_dp = 2 * (dp - 1) / dp * 2 * P / (tp * pp) / cluster.bw_inter
    per_mb = t_c + t_tp + t_pp
    return {"compute": m * t_c, "tp": m * t_tp, "pp": m * t_pp, "bubble": (pp - 1) * per_mb, "dp": t_dp,
            "step": (m + pp - 1) * per_mb + t_dp}


def candidates(model: ModelSpec, cluster: ClusterSpec):
    """Every (tp, pp, dp) the hardware and the model allow, fitting in memory or not."""
    n = cluster.n_gpus
    for tp in range(1, cluster.gpus_per_node + 1):
        if cluster.gpus_per_node % tp or model.n_heads % tp:
            continue                       # TP inside a node, whole heads per rank
        for pp in range(1, model.n_layers + 1):
            if model.n_layers % pp or n % (tp * pp):
                continue
            dp = n // (tp * pp)
            if model.global_batch % (dp * model.micro_batch):
                continue
            yield tp, pp, dp


def evaluate(model: ModelSpec, cluster: ClusterSpec, tp: int, pp: int, dp: int) -> Plan:
    return Plan(tp, pp, dp, model.global_batch // (dp * model.micro_batch),
                memory_per_gpu(model, cluster, tp, pp, dp), step_time(model, cluster, tp, pp, dp))


def plan(model: ModelSpec, cluster: ClusterSpec) -> Plan | None:
    """The fastest layout that fits in memory (ties: smaller tp, then smaller pp); None if none fits."""
    best = None
    for tp, pp, dp in candidates(model, cluster):
        pl = evaluate(model, cluster, tp, pp, dp)
        if pl.memory_total > cluster.gpu_mem:
            continue
        if best is None or pl.step_time < best.step_time * (1 - 1e-9):
            best = pl
    return best


def table(model: ModelSpec, cluster: ClusterSpec, top: int = 10) -> str:
    """All candidates, fitting first then fastest: the planner's reasoning, printable."""
    rows = [evaluate(model, cluster, *c) for c in candidates(model, cluster)]
    rows.sort(key=lambda pl: (pl.memory_total > cluster.gpu_mem, pl.step_time))
    out = [f"{'tp':>3} {'pp':>3} {'dp':>4} {'m':>5} {'weights':>8} {'grads':>6} {'optim':>6} {'activ':>6} "
           f"{'total GB':>8} {'fits':>4} {'step s':>7} {'bubble s':>8} {'tp s':>6} {'dp s':>6}"]
    for pl in rows[:top]:
        mem = {k: v / GB for k, v in pl.memory.items()}
        out.append(f"{pl.tp:>3} {pl.pp:>3} {pl.dp:>4} {pl.micro_batches:>5} {mem['weights']:>8.1f} "
                   f"{mem['grads']:>6.1f} {mem['optimizer']:>6.1f} {mem['activations']:>6.1f} "
                   f"{pl.memory_total / GB:>8.1f} {'yes' if pl.memory_total <= cluster.gpu_mem else 'no':>4} "
                   f"{pl.step_time:>7.2f} {pl.time['bubble']:>8.2f} {pl.time['tp']:>6.2f} {pl.time['dp']:>6.2f}")
    return "\n".join(out)
