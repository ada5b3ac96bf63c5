"""Week 9 on a rank: call the student's gpipe / one_f_one_b / zb_h1 and return the schedules as plain data
(the trusted side runs tpkit.pipeline.simulate on them: where it gets stuck, whether every action ran once,
the bubble, the peak activations in flight, the order); or run stage `rank` of the
course model through the student's run_pipeline and return the loss (last stage), what the other stages
returned, the bytes this stage sent, any collective other than send/recv, the stage's weight grads and the
order in which the stage really ran its forwards and backwards (hooks on the stage: F(k) when its k-th
forward returns, B(k) when the gradient reaches the output of that forward); or call the student's
memory_per_gpu / step_time / plan on the planner scenarios. The tensor names, the model, the loss, the
action encoding and the scenarios live here, and the trusted side imports them."""
from __future__ import annotations

import math

import torch

from tpkit import pipeline as pl
from tpkit import topology as topo
from tpkit.models import ForCausalLM, ModelConfig

# tensor names say what they hold: integer mismatches are reported without the hint text
STUCK = "stuck at (stage, position); -1 = never stuck"
ONCE = "runs each F(mb) and B(mb) once on every stage (1 = yes)"
BUBBLE = "bubble fraction"
PEAK = "peak activations in flight per stage"
GRADS = "weight grads of this stage (flattened)"
ORDER = "actions per stage as (0 = F / 1 = B, micro-batch); -1 = none"
RUN_ORDER = "order this stage ran its forwards and backwards: (0 = F / 1 = B, micro-batch); -1 = none"
NONE_ELSEWHERE = "returns None on a stage other than the last (1 = yes)"


def encode_actions(actions, length: int) -> torch.Tensor:
    """[(kind, mb), ...] -> a (max(length, n), 2) int tensor of (0 = F / 1 = B, mb), padded with -1: a missing
    action shows where it is missing, an extra one as a longer tensor."""
    rows = [({"F": 0, "B": 1, "W": 2}.get(a[0], -2), int(a[1])) for a in actions]
    out = torch.full((max(length, len(rows)), 2), -1, dtype=torch.int64)
    if rows:
        out[:len(rows)] = torch.tensor(rows, dtype=torch.int64)
    return out


# -- task 1: schedules -------------------------------------------------------------
# A schedule is plain data: the rank only calls the student's function and hands the actions over; the trusted
# process runs the simulator on them (`schedule_metrics`), where the student's code cannot reach it.
SCHEDULE = "schedule (kind 0 = F / 1 = B / 2 = W, micro-batch, chunk) per stage; kind -1 = padding"
_KIND = {"F": 0, "B": 1, "W": 2}


def encode_schedule(sched, p: int, m: int, name: str) -> torch.Tensor:
    """A schedule as a (p, L, 3) int64 tensor of (kind, mb, chunk) rows padded with kind -1; a malformed one is
    the student's error, said here (the trusted side then only decodes)."""
    if not isinstance(sched, (list, tuple)) or len(sched) != p:
        raise TypeError(f"{name} must return a list of {p} per-stage action lists; got {type(sched).__name__} of "
                        f"length {len(sched) if hasattr(sched, '__len__') else '?'}")
    rows = [[pl.normalize_action(a) for a in stage] for stage in sched]
    cap = 6 * max(m, 1) + 16
    for s, row in enumerate(rows):
        if len(row) > cap:
            raise ValueError(f"{name}: stage {s} has {len(row)} actions; a schedule of m={m} micro-batches has at "
                             f"most 3m")
    out = torch.full((p, max([len(r) for r in rows] + [1]), 3), -1, dtype=torch.int64)
    for s, row in enumerate(rows):
        if row:
            out[s, :len(row)] = torch.tensor([(_KIND[k], mb, c) for k, mb, c in row], dtype=torch.int64)
    return out


def decode_schedule(enc) -> list[list[tuple]]:
    """The trusted side's inverse of encode_schedule, checking the type of what a rank returned."""
    if not isinstance(enc, torch.Tensor) or enc.dtype != torch.int64 or enc.dim() != 3 or enc.shape[-1] != 3:
        raise ValueError("the schedule a rank returned is not a (p, L, 3) int64 tensor")
    return [[("FBW"[k], mb, c) for k, mb, c in row.tolist() if k in (0, 1, 2)] for row in enc]


def schedule_metrics(sched, m: int) -> dict:
    """What the trusted side reads off a GPipe/1F1B schedule by running it: where it gets stuck, whether every
    action ran once, the bubble, the peak activations in flight and the first 2m actions per stage."""
    tl = pl.simulate(sched, m=m)
    return {STUCK: torch.tensor(list(tl.stuck[:2]) if tl.stuck else [-1, -1]),
            ONCE: torch.tensor(int(not any("never" in q or "times" in q or "outside" in q for q in tl.problems))),
            BUBBLE: torch.tensor(tl.bubble_fraction if not tl.stuck else math.nan, dtype=torch.float64),
            PEAK: torch.tensor(tl.peak_in_flight),
            ORDER: torch.stack([encode_actions(list(row)[:2 * m], 2 * m) for row in sched])}


def run_schedule(mod, cfg, inp, ctx):
    out = {}
    for kind, p, m in cfg["schedules"]:
        fn = "one_f_one_b" if kind == "1f1b" else "gpipe"
        out[f"{kind}(p={p},m={m}) {SCHEDULE}"] = encode_schedule(getattr(mod, fn)(p, m), p, m, f"{fn}(p={p}, m={m})")
    return out


# -- task 2: a pipeline over send/recv ---------------------------------------------
def loss_fn(logits, target):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())   # (b*T, V) vs (b*T,)


def own_stage(cfg, inp, p, s):
    """Stage s of p holding the weights this rank is handed (`w.<name in the dense model>`), nothing else."""
    stage = pl.split_stage(ForCausalLM(ModelConfig(**cfg["model"])), p, s)
    with torch.no_grad():
        for n, prm in stage.named_parameters():
            prm.copy_(inp[f"w.{stage.full_name(n)}"])
    return stage


def run_pipeline(mod, cfg, inp, ctx):
    s, p, m = ctx.rank, ctx.world_size, cfg["micro_batches"]
    stage = own_stage(cfg, inp, p, s)
    mbs = [ctx.hand(f"micro_batches[{i}]", c) for i, c in enumerate(inp["ids"].chunk(m))] if s == 0 else None
    tgts = [ctx.hand(f"targets[{i}]", c) for i, c in enumerate(inp["targets"].chunk(m))] if s == p - 1 else None
    act_shape = (cfg["batch"] // m, cfg["seq"], cfg["model"]["hidden_size"])
    # the order as run: F(k) when the stage's k-th forward returns, B(k) when the gradient reaches its output
    ran, n_fwd = [], [0]

    def seen_forward(module, args, output):
        k = n_fwd[0]
        n_fwd[0] += 1
        ran.append(("F", k))
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad, k=k: ran.append(("B", k)))
    hook = stage.register_forward_hook(seen_forward)
    ctx.phase("step")
    try:
        loss = mod.run_pipeline(stage, mbs, tgts, m, act_shape, loss_fn, group=ctx.group)
    finally:
        hook.remove()
    grads = [prm.grad for _, prm in stage.named_parameters()]
    out = {}
    if s == p - 1:
        out["loss"] = loss.reshape(()) if isinstance(loss, torch.Tensor) else None
    else:
        out[NONE_ELSEWHERE] = torch.tensor([int(loss is None)])
    out[RUN_ORDER] = encode_actions(ran, 2 * m)
    out[GRADS] = None if any(g is None for g in grads) else torch.cat([g.flatten() for g in grads])
    return out


# -- task 3: the planner ---------------------------------------------------------------
GB = topo.GB
SCENARIOS = {
    "too_big": (topo.ModelSpec("1T", 1e12, 128, 25600, 160, 2048, global_batch=512), topo.ClusterSpec(n_nodes=1),
                [(8, 1, 1)]),
    # 128K-token sequences: the activations fit only with tp >= 8, which 4-GPU nodes cannot hold (None); a planner
    # letting TP cross nodes answers tp = 8 or 16
    "4gpu_nodes": (topo.ModelSpec("20B, 128K tokens", 20e9, 8, 6144, 48, 131072, global_batch=32, micro_batch=1),
                   topo.ClusterSpec(n_nodes=8, gpus_per_node=4, gpu_mem=40 * GB), [(4, 4, 2)]),
    "70b_16x8": (topo.LLAMA_70B, topo.H100_16x8, [(8, 2, 8), (2, 8, 8)]),
    "1b_2x8": (topo.ModelSpec("1.3B", 1.3e9, 24, 2048, 16, 2048, global_batch=256), topo.ClusterSpec(n_nodes=2),
               [(1, 1, 16), (2, 4, 2)]),
    # one scenario per rule of the search that the ones above never exercise (a planner breaking it answers
    # differently here): tp must divide n_heads (tp=8 would be faster; 12 heads) ...
    "12_heads": (topo.ModelSpec("30B, 12 heads", 30e9, 24, 6144, 12, 8192, global_batch=16),
                 topo.ClusterSpec(n_nodes=4), [(4, 8, 1)]),
    # ... when pp does not divide L the fullest stage holds ceil(L/pp) layers (30 layers on pp=4: 8, not 7.5) ...
    "30_layers": (topo.ModelSpec("7B, 30 layers", 7e9, 30, 4096, 32, 2048, global_batch=48),
                  topo.ClusterSpec(n_nodes=1), [(2, 4, 1), (2, 2, 2)]),
    # ... dp * b must divide the global batch (dp=8 with b=2 would be faster; 40 sequences), and m = 40/(dp b) ...
    "batch_40": (topo.ModelSpec("7B, batch 40", 7e9, 32, 4096, 32, 2048, global_batch=40, micro_batch=2),
                 topo.ClusterSpec(n_nodes=2), [(4, 1, 4)]),
    # ... tp * pp * dp must use every GPU (on 40 GPUs with 16 layers and a batch of 48 only pp = 5 or 10 does, with
    # uneven stages; a planner that leaves GPUs idle answers (4, 8, 1) on 32 of them) ...
    "40_gpus": (topo.ModelSpec("30B", 30e9, 16, 8192, 64, 2048, global_batch=48), topo.ClusterSpec(n_nodes=5), []),
    # ... and other hardware: A100s on HDR 200 (the step time reads the GPU and the NIC from the cost model)
    "a100_hdr": (topo.ModelSpec("13B", 13e9, 40, 5120, 40, 2048, global_batch=256),
                 topo.ClusterSpec(n_nodes=4, gpu="A100", nic="IB HDR 200"), [(4, 2, 4), (8, 1, 4)]),
}
SCENARIOS_HIDDEN = {
    "13b_4x8": (topo.ModelSpec("13B", 13e9, 40, 5120, 40, 4096, global_batch=512), topo.ClusterSpec(n_nodes=4),
                [(4, 2, 4), (1, 1, 32)]),
    "70b_2x8_40g": (topo.ModelSpec("70B", 70e9, 80, 8192, 64, 4096, global_batch=64),
                    topo.ClusterSpec(n_nodes=2, gpu_mem=40 * GB, gpu="H200"), [(8, 2, 1)]),
    "8b_2x4": (topo.ModelSpec("8B", 8e9, 32, 4096, 32, 8192, global_batch=64, micro_batch=2),
               topo.ClusterSpec(n_nodes=2, gpus_per_node=4, nic="IB HDR 200", nics_per_node=4), [(4, 1, 2), (2, 2, 2)]),
}
SCENARIOS_ALL = {**SCENARIOS, **SCENARIOS_HIDDEN}
_KEYS = ("weights", "grads", "optimizer", "activations")


def _plan_tensors(pln, model, cluster):
    if pln is None:
        return {"plan keeps TP inside a node (1 = yes)": torch.tensor(1.0, dtype=torch.float64),
                "plan fits in gpu_mem (1 = yes)": torch.tensor(1.0, dtype=torch.float64),
                "plan (tp, pp, dp); 0 = None": torch.tensor([0, 0, 0]),
                "plan m (micro-batches per pipeline)": torch.tensor([0]),
                "plan memory GB": torch.zeros(4, dtype=torch.float64),
                "plan step time s": torch.tensor(0.0, dtype=torch.float64)}
    tp, pp, dp = int(pln.tp), int(pln.pp), int(pln.dp)
    mem = [float(pln.memory[k]) / GB for k in _KEYS]
    inside = tp <= cluster.gpus_per_node and cluster.gpus_per_node % tp == 0
    return {"plan keeps TP inside a node (1 = yes)": torch.tensor(float(inside), dtype=torch.float64),
            "plan fits in gpu_mem (1 = yes)": torch.tensor(float(sum(mem) * GB <= cluster.gpu_mem), dtype=torch.float64),
            "plan (tp, pp, dp); 0 = None": torch.tensor([tp, pp, dp]),
            "plan m (micro-batches per pipeline)": torch.tensor([int(pln.micro_batches)]),
            "plan memory GB": torch.tensor(mem, dtype=torch.float64),
            "plan step time s": torch.tensor(float(pln.time["step"]) if isinstance(pln.time, dict) else math.nan,
                                             dtype=torch.float64)}


def planner_tensors(fns, scenario_names):
    """(memory_per_gpu, step_time, plan) on the named scenarios: the rank calls it with the student's
    functions, the trusted side with the reference planner's."""
    memory_per_gpu, step_time, plan = fns
    out = {}
    for key in scenario_names:
        model, cluster, layouts = SCENARIOS_ALL[key]
        for k, v in _plan_tensors(plan(model, cluster), model, cluster).items():
            out[f"{key} {k}"] = v
        for tp, pp, dp in layouts:
            mem = memory_per_gpu(model, cluster, tp, pp, dp)
            out[f"{key} memory_per_gpu GB (tp={tp},pp={pp},dp={dp})"] = torch.tensor(
                [float(mem[k]) / GB for k in _KEYS], dtype=torch.float64)
            st = step_time(model, cluster, tp, pp, dp)
            out[f"{key} step_time s (tp={tp},pp={pp},dp={dp})"] = torch.tensor(
                float(st["step"] if isinstance(st, dict) else st), dtype=torch.float64)
    return out


def run_planner(mod, cfg, inp, ctx):
    return planner_tensors((mod.memory_per_gpu, mod.step_time, mod.plan), cfg["scenarios"])


# -- task 4: zero bubble (ZB-H1) ---------------------------------------------------------
SPLIT = "splits the backward into B and W actions (1 = yes)"
ONCE_FBW = "runs each F(mb), B(mb) and W(mb) once on every stage (1 = yes)"
EXTRA_IDLE = "idle time per stage beyond ZB-H1's (p-1)(t_f + t_b - t_w)"
EXTRA_PEAK = "micro-batches in flight per stage beyond p (1F1B's peak)"


def zb_h1_metrics(sched, p: int, m: int, costs) -> dict:
    """What a ZB-H1 schedule must show, as tensors that are zero (or one) when it does: properties, not one
    particular order, so every schedule with ZB-H1's bubble at 1F1B's peak memory passes."""
    out = {}
    for t_f, t_b, t_w in costs:
        tl = pl.simulate(sched, m=m, t_f=t_f, t_b=t_b, t_w=t_w)
        key = f"zb_h1(p={p},m={m}) t_f,t_b,t_w={t_f:g},{t_b:g},{t_w:g}: "
        out[key + STUCK] = torch.tensor(list(tl.stuck[:2]) if tl.stuck else [-1, -1])
        out[key + SPLIT] = torch.tensor(int(tl.split))
        out[key + ONCE_FBW] = torch.tensor(int(not any("never" in q or "times" in q or "outside" in q
                                                       for q in tl.problems)))
        bound = (p - 1) * (t_f + t_b - t_w)
        idle = torch.tensor(tl.idle if not tl.stuck else [math.nan] * p, dtype=torch.float64)
        out[key + EXTRA_IDLE] = (idle - bound).clamp(min=0)
        out[key + EXTRA_PEAK] = (torch.tensor(tl.peak_in_flight) - p).clamp(min=0)
    return out


def run_zb_h1(mod, cfg, inp, ctx):
    return {f"zb_h1(p={p},m={m}) {SCHEDULE}": encode_schedule(mod.zb_h1(p, m), p, m, f"zb_h1(p={p}, m={m})")
            for p, m in cfg["shapes"]}
