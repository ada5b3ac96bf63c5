"""A 3-D planner: memory per GPU and the step time the cost model (`tpkit.costmodel`) predicts, per layout.

Memory per GPU (bytes), P parameters, mixed-precision Adam with a distributed optimizer
(ZeRO-1: Rajbhandari et al. 2020 count 2 + 2 + 12 bytes per parameter):
    weights     2 P / (t p)              bf16 copy used by forward and backward
    grads       2 P / (t p)              bf16 gradients (/ d as well with zero=2: sharded like FSDP)
    optimizer  12 P / (t p d)            fp32 master weights, Adam m and v, sharded over DP
    activations ceil(L / p) * min(p, m) * s b h * 34 / t
                                         Korthikanti et al. 2022, Table 2, TP + SP + selective
                                         recompute; 1F1B keeps min(p, m) micro-batches in flight
                                         on the first stage, each holding ceil(L/p) layers (when p does
                                         not divide L the fullest stage sets memory and time).
Step time (seconds): nothing is assumed about the efficiency; every piece is bytes or FLOPs on named hardware.
Per micro-batch on one GPU of a stage:
    t_mb = ceil(L/p) (t_layer + t_tp + t_cp) + t_out / p + t_pp
    t_layer   forward + backward of one layer (GEMM roofline, attention, element-wise; `costmodel.layer_time`)
    t_tp      its 4 TP all-reduces (6 with full recompute) on NVLink, exposed (not overlapped)
    t_cp      K/V all-gather forward and backward, reduce-scatter of their gradients, exposed (Llama 3)
    t_out     the output layer, spread evenly over the stages (Llama 3 moves layers to balance it)
    t_pp      one activation shard b s h / (t cp) forward and its gradient back, per virtual stage, on a NIC
The step, 1F1B with v model chunks per GPU (interleaved, v = 1 plain), m = global_batch / (d b):
    T = (m + (p - 1) / v) t_mb + t_dp
    t_dp      all-reduce volume of the bf16 gradients 2 P / (t p) over the d x cp replicas, exposed
Ranks are numbered [TP, CP, PP, DP], TP innermost: a group has gpus_per_node / (the degrees inside it) members
per node, each with its own NIC. TP stays inside a node (t | gpus_per_node): its collectives sit on the critical
path of every layer.
"""
from __future__ import annotations

import math

from tpkit import costmodel as cm
from tpkit.topology import GB, ClusterSpec, ModelSpec, Plan, activation_bytes_per_layer


def memory_per_gpu(model: ModelSpec, cluster: ClusterSpec, tp: int, pp: int, dp: int, zero: int = 1) -> dict:
    P = model.n_params
    m = model.global_batch // (dp * model.micro_batch)
    act_layer = activation_bytes_per_layer(model.seq_len, model.micro_batch, model.hidden, model.n_heads, tp,
                                           dropout=model.dropout)
    return {"weights": 2 * P / (tp * pp),
            "grads": 2 * P / (tp * pp * (dp if zero >= 2 else 1)),
            "optimizer": 12 * P / (tp * pp * dp),
            "activations": math.ceil(model.n_layers / pp) * min(pp, m) * act_layer}


def step_time(model: ModelSpec, cluster: ClusterSpec, tp: int, pp: int, dp: int, cp: int = 1, v: int = 1,
              recompute: str = "selective", flash: bool = True) -> dict:
    """Seconds per optimizer step of a (tp, cp, pp, dp) layout, by piece, and the MFU it implies."""
    gpu, gpn, b = cm.GPUS[cluster.gpu], cluster.gpus_per_node, model.micro_batch
    m = model.global_batch // (dp * b)
    lt = cm.layer_time(model, gpu, tp, cp, recompute, flash)
    layers = math.ceil(model.n_layers / pp)
    t_tp = lt["tp_all_reduces"] * cm.collective_time("all_reduce", lt["tp_bytes"], tp, cluster)
    cp_per_node = max(1, min(cp, gpn // tp))                    # [TP, CP, PP, DP]: TP innermost
    t_cp = lt["cp_collectives"] * cm.collective_time("all_gather", lt["cp_bytes"], cp, cluster, per_node=cp_per_node)
    shard = lt["act_bytes"] / tp                                # each TP rank sends its 1/t (scatter-gather)
    t_pp = 2 * v * cm.collective_time("send", shard, 2, cluster, per_node=1) if pp > 1 else 0.0
    compute = layers * (lt["fwd"] + lt["bwd"]) + cm.output_layer_time(model, gpu, tp, cp) / pp
    t_mb = compute + layers * (t_tp + t_cp) + t_pp
    replicas = dp * cp                                          # the ranks holding the same weights
    t_dp = cm.collective_time("all_reduce", 2 * model.n_params / (tp * pp), replicas, cluster,
                              per_node=max(1, min(dp, gpn // (tp * cp * pp))) * cp_per_node)
    step = (m + (pp - 1) / v) * t_mb + t_dp
    tokens = model.global_batch * model.seq_len
    n_gpus = tp * cp * pp * dp
    return {"compute": m * compute, "tp": m * layers * t_tp, "cp": m * layers * t_cp, "pp": m * t_pp,
            "bubble": (pp - 1) / v * t_mb, "dp": t_dp, "step": step,
            "mfu": cm.model_flops_per_token(model, causal=flash) * tokens / (step * n_gpus * gpu.bf16)}


def candidates(model: ModelSpec, cluster: ClusterSpec):
    """Every (tp, pp, dp) the hardware and the model allow, fitting in memory or not."""
    n = cluster.n_gpus
    for tp in range(1, cluster.gpus_per_node + 1):
        if cluster.gpus_per_node % tp or model.n_heads % tp:
            continue                       # TP inside a node, whole heads per rank
        for pp in range(1, model.n_layers + 1):
            if n % (tp * pp):
                continue
            dp = n // (tp * pp)
            if model.global_batch % (dp * model.micro_batch):
                continue
            yield tp, pp, dp


def evaluate(model: ModelSpec, cluster: ClusterSpec, tp: int, pp: int, dp: int, zero: int = 1) -> Plan:
    return Plan(tp, pp, dp, model.global_batch // (dp * model.micro_batch),
                memory_per_gpu(model, cluster, tp, pp, dp, zero), step_time(model, cluster, tp, pp, dp))


def plan(model: ModelSpec, cluster: ClusterSpec, zero: int = 1) -> Plan | None:
    """The fastest layout that fits in memory; None if none fits. Layouts are tried in (tp, pp) order and a
    later one replaces the best only when faster by more than 1e-9 (relative), so rounding never decides."""
    best = None
    for tp, pp, dp in candidates(model, cluster):
        pl = evaluate(model, cluster, tp, pp, dp, zero)
        if pl.memory_total > cluster.gpu_mem:
            continue
        if best is None or pl.step_time < best.step_time * (1 - 1e-9):
            best = pl
    return best


def table(model: ModelSpec, cluster: ClusterSpec, top: int = 10, zero: int = 1) -> str:
    """All candidates, fitting first then fastest: the planner's reasoning, printable."""
    rows = [evaluate(model, cluster, *c, zero) for c in candidates(model, cluster)]
    rows.sort(key=lambda pl: (pl.memory_total > cluster.gpu_mem, pl.step_time))
    out = [f"{'tp':>3} {'pp':>3} {'dp':>4} {'m':>5} {'weights':>8} {'grads':>6} {'optim':>6} {'activ':>6} "
           f"{'total GB':>8} {'fits':>4} {'step s':>7} {'bubble s':>8} {'tp s':>6} {'dp s':>6} {'MFU':>5}"]
    for pl in rows[:top]:
        mem = {k: v / GB for k, v in pl.memory.items()}
        out.append(f"{pl.tp:>3} {pl.pp:>3} {pl.dp:>4} {pl.micro_batches:>5} {mem['weights']:>8.1f} "
                   f"{mem['grads']:>6.1f} {mem['optimizer']:>6.1f} {mem['activations']:>6.1f} "
                   f"{pl.memory_total / GB:>8.1f} {'yes' if pl.memory_total <= cluster.gpu_mem else 'no':>4} "
                   f"{pl.step_time:>7.2f} {pl.time['bubble']:>8.2f} {pl.time['tp']:>6.2f} {pl.time['dp']:>6.2f} "
                   f"{pl.time['mfu']:>5.1%}")
    return "\n".join(out)
