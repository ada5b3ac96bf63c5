"""Week 9: pipeline schedules, a pipeline over send/recv, and the 3-D topology planner.

- schedule: the student's gpipe(p, m) / one_f_one_b(p, m) are executed by grader.pipeline.simulate
  (every action once, no dependency violation, bubble = (p-1)/(m+p-1), 1F1B keeps min(p-s, m)
  micro-batches in flight on stage s; GPipe m).
- pipeline: rank r of t runs stage r of the course model; loss and every stage's weight grads
  must match the single-device model; only send/recv; stage s sends one activation per
  micro-batch forward (s < t-1) and one input grad per micro-batch back (s > 0).
- planner: memory_per_gpu / step_time / plan against grader.topology on analytic scenarios.
"""
from __future__ import annotations

import math

import torch

from grader import pipeline as pl
from grader import topology as topo
from grader.case import Case, Contract, register
from grader.models import ForCausalLM, ModelConfig, init_weights

MODULE = "pipeline_lab"
# tensor names say what they hold: integer mismatches are reported without the hint text
STUCK = "stuck at (stage, position); -1 = never stuck"
ONCE = "runs each F(mb) and B(mb) once on every stage (1 = yes)"
BUBBLE = "bubble fraction"
PEAK = "peak activations in flight per stage"


# -- task 1: schedules -------------------------------------------------------------
def _expected_schedule(kind, p, m):
    return {STUCK: torch.tensor([-1, -1]), ONCE: torch.tensor(1),
            BUBBLE: torch.tensor(pl.bubble_formula(p, m), dtype=torch.float64),
            PEAK: torch.tensor([m if kind == "gpipe" else min(p - s, m) for s in range(p)])}


def _schedule_ref(cfg, inputs):
    out = {}
    for kind, p, m in cfg["schedules"]:
        out.update({f"{kind}(p={p},m={m}) {k}": v for k, v in _expected_schedule(kind, p, m).items()})
    return out


def _run_schedule(mod, cfg, inp, ctx):
    out = {}
    for kind, p, m in cfg["schedules"]:
        sched = getattr(mod, "one_f_one_b" if kind == "1f1b" else "gpipe")(p, m)
        if not isinstance(sched, (list, tuple)) or len(sched) != p:
            raise TypeError(f"{kind}(p={p}, m={m}) must return a list of {p} per-stage action lists; "
                            f"got {type(sched).__name__} of length {len(sched) if hasattr(sched, '__len__') else '?'}")
        tl = pl.simulate(sched, m=m)
        key = f"{kind}(p={p},m={m}) "
        out[key + STUCK] = torch.tensor(list(tl.stuck[:2]) if tl.stuck else [-1, -1])
        out[key + ONCE] = torch.tensor(int(not any("never" in q or "times" in q or "outside" in q
                                                                    for q in tl.problems)))
        out[key + BUBBLE] = torch.tensor(tl.bubble_fraction if not tl.stuck else math.nan, dtype=torch.float64)
        out[key + PEAK] = torch.tensor(tl.peak_in_flight)
    return out


def _schedule_hints(schedules):
    h = {}
    for kind, p, m in schedules:
        key = f"{kind}(p={p},m={m}) "
        h[key + STUCK] = (
            "(stage, position) of the first action that can never run, [-1, -1] if the schedule completes. "
            "F(mb) on stage s needs F(mb) on stage s-1 earlier; B(mb) on stage s needs F(mb) on s and "
            "B(mb) on s+1. Run grader.pipeline.simulate(your_schedule).problems to see it.")
        h[key + ONCE] = "Every stage must run ('F', mb) and ('B', mb) exactly once for mb in 0..m-1."
        h[key + BUBBLE] = (f"Executed with F = 1 and B = 2 time units, the idle fraction must be "
                             f"(p-1)/(m+p-1) = {pl.bubble_formula(p, m):.4f}: a stage idles where it should work.")
        h[key + PEAK] = ("Activations stored per stage: GPipe keeps all m; 1F1B runs p-s-1 warm-up "
                                     "forwards on stage s, so at most min(p-s, m) are in flight.")
    return h


SCHEDULES = [("gpipe", 2, 4), ("gpipe", 4, 3), ("1f1b", 2, 4), ("1f1b", 4, 8), ("1f1b", 4, 2), ("1f1b", 3, 5)]
SCHEDULES_HIDDEN = [("gpipe", 3, 1), ("gpipe", 5, 6), ("1f1b", 1, 3), ("1f1b", 5, 3), ("1f1b", 3, 9),
                    ("1f1b", 6, 6)]
for name, scheds in [("schedule", SCHEDULES), ("schedule_hidden", SCHEDULES_HIDDEN)]:
    register(Case(name=f"week09/{name}", module=MODULE, world_sizes=(2,), config={"schedules": scheds},
                  make_inputs=lambda cfg, gen: {"unused": torch.zeros(1)}, reference=_schedule_ref,
                  run_rank=_run_schedule, expected=lambda cfg, ref, r, t: ref,
                  contract=lambda cfg, t: Contract(allowed_ops=set()), seed=0,
                  hidden=name.endswith("hidden"), title="GPipe and 1F1B schedules", hints=_schedule_hints(scheds)))


# -- task 2: a pipeline over send/recv ---------------------------------------------
def _model(cfg, seed):
    mc = ModelConfig(**cfg["model"])
    return init_weights(ForCausalLM(mc), int(seed))


def _loss_fn(logits, target):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())   # (b*T, V) vs (b*T,)


def _pipe_inputs(cfg, gen):
    B, T, V = cfg["batch"], cfg["seq"], cfg["model"]["vocab_size"]
    return {"ids": torch.randint(0, V, (B, T), generator=gen), "targets": torch.randint(0, V, (B, T), generator=gen),
            "weight_seed": torch.randint(0, 2 ** 30, (1,), generator=gen)}


def _pipe_ref(cfg, inp):
    model = _model(cfg, inp["weight_seed"])
    loss = _loss_fn(model(inp["ids"]), inp["targets"])             # mean over all B*T tokens
    loss.backward()
    out = {"loss": loss.detach()}
    out.update({f"grad {n}": p.grad for n, p in model.named_parameters()})
    return out


def _act_bytes(cfg):
    m = cfg["micro_batches"]
    return cfg["batch"] // m * cfg["seq"] * cfg["model"]["hidden_size"] * 4     # one float32 (b, T, C)


BYTES = "bytes sent by this stage"
OTHER = "collectives other than send/recv"
GRADS = "weight grads of this stage (flattened)"


def _run_pipe(mod, cfg, inp, ctx):
    s, p, m = ctx.rank, ctx.world_size, cfg["micro_batches"]
    model = _model(cfg, inp["weight_seed"])
    stage = pl.split_stage(model, p, s)
    mbs = list(inp["ids"].chunk(m)) if s == 0 else None                 # m x (b, T)
    tgts = list(inp["targets"].chunk(m)) if s == p - 1 else None
    act_shape = (cfg["batch"] // m, cfg["seq"], cfg["model"]["hidden_size"])
    ctx.phase("step")
    loss = mod.run_pipeline(stage, mbs, tgts, m, act_shape, _loss_fn, group=ctx.group)
    # Stages legitimately issue different P2P sequences (stage 0 only sends activations, the last stage
    # only sends grads): summarise the ledger here so the collective-desync report does not misfire.
    entries = list(ctx.ledger.entries)
    ctx.ledger.entries.clear()
    grads = [prm.grad for _, prm in stage.named_parameters()]
    out = {}
    if s == p - 1:
        out["loss"] = loss.reshape(()) if isinstance(loss, torch.Tensor) else None
    out[BYTES] = torch.tensor(sum(e["sent"] for e in entries), dtype=torch.float64)
    out[OTHER] = torch.tensor(float(sum(e["op"] not in ("send", "recv") for e in entries)), dtype=torch.float64)
    out[GRADS] = None if any(g is None for g in grads) else torch.cat([g.flatten() for g in grads])
    return out


def _expect_pipe(cfg, ref, r, t):
    model = _model(cfg, 0)
    a, m = _act_bytes(cfg), cfg["micro_batches"]
    out = {"loss": ref["loss"]} if r == t - 1 else {}
    out[BYTES] = torch.tensor(float((r < t - 1) * m * a + (r > 0) * m * a), dtype=torch.float64)
    out[OTHER] = torch.tensor(0.0, dtype=torch.float64)
    out[GRADS] = torch.cat([ref[f"grad {n}"].flatten() for n in pl.stage_param_names(model, t, r)])
    return out


def _pipe_hints(cfg):
    return {
        "loss": "The loss is the mean over micro-batches of each micro-batch's mean loss (divide by n_micro).",
        BYTES: (f"Stage s sends one (b, T, C) float32 activation per micro-batch to s+1 (not the last stage) and "
                f"the gradient of its input back to s-1 (not the first stage): {_act_bytes(cfg)} bytes each. "
                f"Fewer bytes: an activation or a gradient was never sent."),
        OTHER: "A pipeline only passes activations forward and gradients back, point to point (send/recv, isend/irecv).",
        GRADS: ("Every parameter of the stage, in named_parameters() order, must hold the dense model's grad "
                "(missing: some .grad is None). A stage needs dL/d(output) from the next stage for every micro-batch "
                "(recv, then output.backward(grad)) and must send dL/d(input) back."),
    }


_SMALL = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 4,
          "num_attention_heads": 2, "num_key_value_heads": 1}
for name, cfg, seed in [
        ("pipeline", {"model": _SMALL, "batch": 8, "seq": 4, "micro_batches": 4}, 0),
        ("pipeline_hidden", {"model": dict(_SMALL, hidden_size=24, num_hidden_layers=8, num_attention_heads=4,
                                           num_key_value_heads=2), "batch": 6, "seq": 5, "micro_batches": 3}, None)]:
    register(Case(name=f"week09/{name}", module=MODULE, world_sizes=(2, 4), config=cfg, make_inputs=_pipe_inputs,
                  reference=_pipe_ref, run_rank=_run_pipe, expected=_expect_pipe, contract=None,
                  seed=seed, hidden=seed is None, title="pipeline over send/recv", hints=_pipe_hints(cfg)))


# -- task 3: the planner ---------------------------------------------------------------
GB = topo.GB
SCENARIOS = {
    "too_big": (topo.ModelSpec("1T", 1e12, 128, 25600, 160, 2048, global_batch=512), topo.ClusterSpec(n_nodes=1),
                [(8, 1, 1)]),
    "4gpu_nodes": (topo.ModelSpec("20B", 20e9, 8, 6144, 48, 2048, global_batch=32, micro_batch=1),
                   topo.ClusterSpec(n_nodes=8, gpus_per_node=4, gpu_mem=40 * GB), [(4, 4, 2)]),
    "70b_16x8": (topo.LLAMA_70B, topo.H100_16x8, [(8, 2, 8), (2, 8, 8)]),
    "1b_2x8": (topo.ModelSpec("1.3B", 1.3e9, 24, 2048, 16, 2048, global_batch=256), topo.ClusterSpec(n_nodes=2),
               [(1, 1, 16), (2, 4, 2)]),
}
SCENARIOS_HIDDEN = {
    "13b_4x8": (topo.ModelSpec("13B", 13e9, 40, 5120, 40, 4096, global_batch=512), topo.ClusterSpec(n_nodes=4),
                [(4, 2, 4), (1, 1, 32)]),
    "70b_2x8_40g": (topo.ModelSpec("70B", 70e9, 80, 8192, 64, 4096, global_batch=64),
                    topo.ClusterSpec(n_nodes=2, gpu_mem=40 * GB, mfu=0.5), [(8, 2, 1)]),
    "8b_2x4": (topo.ModelSpec("8B", 8e9, 32, 4096, 32, 8192, global_batch=64, micro_batch=2),
               topo.ClusterSpec(n_nodes=2, gpus_per_node=4, bw_inter=25 * GB), [(4, 1, 2), (2, 2, 2)]),
}
_KEYS = ("weights", "grads", "optimizer", "activations")


def _plan_tensors(pln, model, cluster):
    if pln is None:
        return {"plan keeps TP inside a node (1 = yes)": torch.tensor(1.0, dtype=torch.float64),
                "plan fits in gpu_mem (1 = yes)": torch.tensor(1.0, dtype=torch.float64),
                "plan (tp, pp, dp); 0 = None": torch.tensor([0, 0, 0]),
                "plan memory GB": torch.zeros(4, dtype=torch.float64),
                "plan step time s": torch.tensor(0.0, dtype=torch.float64)}
    tp, pp, dp = int(pln.tp), int(pln.pp), int(pln.dp)
    mem = [float(pln.memory[k]) / GB for k in _KEYS]
    inside = tp <= cluster.gpus_per_node and cluster.gpus_per_node % tp == 0
    return {"plan keeps TP inside a node (1 = yes)": torch.tensor(float(inside), dtype=torch.float64),
            "plan fits in gpu_mem (1 = yes)": torch.tensor(float(sum(mem) * GB <= cluster.gpu_mem), dtype=torch.float64),
            "plan (tp, pp, dp); 0 = None": torch.tensor([tp, pp, dp]),
            "plan memory GB": torch.tensor(mem, dtype=torch.float64),
            "plan step time s": torch.tensor(float(pln.time["step"]) if isinstance(pln.time, dict) else math.nan,
                                             dtype=torch.float64)}


def _planner_tensors(fns, scenarios):
    memory_per_gpu, step_time, plan = fns
    out = {}
    for key, (model, cluster, layouts) in scenarios.items():
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


def _planner_hints(scenarios):
    h = {}
    for key, (model, cluster, layouts) in scenarios.items():
        for tp, pp, dp in layouts:
            h[f"{key} memory_per_gpu GB (tp={tp},pp={pp},dp={dp})"] = (
                "[weights, grads, optimizer, activations] in GB: 2P/(tp pp), 2P/(tp pp), 12P/(tp pp dp), "
                "(L/pp) min(pp, m) s b h 34/tp with m = global_batch/(dp b).")
            h[f"{key} step_time s (tp={tp},pp={pp},dp={dp})"] = (
                "(m + pp - 1)(t_compute + t_tp + t_pp) + t_dp with the lecture's four terms.")
        h[f"{key} plan (tp, pp, dp); 0 = None"] = ("(tp, pp, dp) of the fastest layout that fits in memory; (0, 0, 0) means "
                                    "plan() returned None because nothing fits.")
        h[f"{key} plan fits in gpu_mem (1 = yes)"] = "The plan's memory total must not exceed cluster.gpu_mem: reject layouts that do not fit."
        h[f"{key} plan keeps TP inside a node (1 = yes)"] = (
            "TP must stay inside a node (tp divides gpus_per_node): its collectives sit on the critical path of "
            "every layer and need NVLink bandwidth; PP and DP cross nodes.")
        h[f"{key} plan memory GB"] = "The plan's memory breakdown, as memory_per_gpu gives it for its degrees."
        h[f"{key} plan step time s"] = "The plan's time['step'], as step_time gives it for its degrees."
    return h


def _planner_case(name, scenarios, seed):
    names = list(scenarios)

    def pick(cfg):
        return {k: SCENARIOS_ALL[k] for k in cfg["scenarios"]}

    def ref(cfg, inp):
        return _planner_tensors((topo.memory_per_gpu, topo.step_time, topo.plan), pick(cfg))

    def run(mod, cfg, inp, ctx):
        return _planner_tensors((mod.memory_per_gpu, mod.step_time, mod.plan), pick(cfg))

    register(Case(name=f"week09/{name}", module=MODULE, world_sizes=(2,), config={"scenarios": names},
                  make_inputs=lambda cfg, gen: {"unused": torch.zeros(1)}, reference=ref, run_rank=run,
                  expected=lambda cfg, r, rank, t: r, contract=lambda cfg, t: Contract(allowed_ops=set()),
                  seed=seed, hidden=name.endswith("hidden"), title="3-D topology planner",
                  hints=_planner_hints(scenarios)))


SCENARIOS_ALL = {**SCENARIOS, **SCENARIOS_HIDDEN}
_planner_case("planner", SCENARIOS, 0)
_planner_case("planner_hidden", SCENARIOS_HIDDEN, 0)
