"""Week 9: pipeline schedules, a pipeline over send/recv, and the 3-D topology planner.

- schedule: the student's gpipe(p, m) / one_f_one_b(p, m) are executed by tpkit.pipeline.simulate
  (every action once, no dependency violation, bubble = (p-1)/(m+p-1), 1F1B keeps min(p-s, m)
  micro-batches in flight on stage s; GPipe m).
- pipeline: rank r of t runs stage r of the course model, handed its own layers' weights (never the seed they come
  from); loss and every stage's weight grads must match the single-device model; only send/recv; stage s sends one
  activation per micro-batch forward (s < t-1) and one input grad per micro-batch back (s > 0), posted in the order
  of its 1F1B schedule (the switchboard's record of its sends).
- planner: memory_per_gpu / step_time / plan against reference.planner (tpkit.costmodel underneath) on scenarios.
- zb_h1: the student's zb_h1(p, m) executed by tpkit.pipeline.simulate with several (t_f, t_b, t_w): no idle
  time beyond (p-1)(t_f + t_b - t_w) per stage, at most p micro-batches in flight.

Scored: values against the trusted reference and the switchboard's record of the collectives. "note (inside the
rank, not scored)" marks what the harness measures in the student's process: said beside the verdict, no points.
Such notes everywhere: ctx.hand (an input written into) and a replaced harness function (grader/rank/seal.py).
Rules the lab's text states -> the check that enforces it (case: tensor or contract field):
 Task 1 (schedule):
 1. one list per stage of ("F", mb) / ("B", mb) actions -> run_schedule's type check, then simulate
 2. F(mb) after stage s-1's F(mb); B(mb) after its own F(mb) and stage s+1's B(mb) -> `stuck at (stage,
    position)` (fixture schedule_b_before_f)
 3. every action exactly once -> `runs each F(mb) and B(mb) once`
 4. gpipe: all m forwards, then all m backwards, in micro-batch order 0..m-1 -> `actions per stage` (new: before,
    any order with GPipe's dependencies, bubble and peak passed; fixture gpipe_backward_reversed)
 5. one_f_one_b: min(p-s-1, m) warm-up forwards, then one forward and one backward (backwards in micro-batch
    order), then the remaining backwards -> `actions per stage` (new) and `peak activations in flight`
 6. the bubble is (p-1)/(m+p-1) -> `bubble fraction`
 7. 1F1B keeps at most min(p-s, m) activations on stage s, GPipe m -> `peak activations in flight`
 Task 2 (pipeline):
 8. one training step in the order of your one_f_one_b(p, n_micro)[rank] -> `the order of this stage's sends`, from
    the switchboard's record (fixture pipeline_gpipe_order: its middle stages at p=4); the order the stage's hooks saw
    (`order this stage ran its forwards and backwards`) is measured in the rank: note (inside the rank, not scored)
 9. one activation forward and one gradient back per stage boundary and micro-batch, point to point only ->
    `bytes sent by this stage`, `collectives other than send/recv` (fixture pipeline_no_grad_back)
10. the last stage's loss is loss_fn(out, targets[mb]) / n_micro, summed -> `loss`
11. None on every other stage -> `returns None on a stage other than the last` (new; fixture
    pipeline_loss_everywhere)
12. backward with the received gradient, input.grad sent back -> `weight grads of this stage (flattened)`, bytes
13. group_src / group_dst (ranks inside `group`) -> world_sizes (2, 4) on a 4-rank job (t=2 on ranks 2 and 3)
14. isend, waited at the end (a blocking send can wait for its neighbour's) -> the deadlock watch names a cycle
 Task 3 (planner):
15. memory_per_gpu's four terms, ceil(L/pp) layers on the fullest stage -> `memory_per_gpu GB (tp=..,pp=..,dp=..)`
    (30_layers at pp=4; fixture planner_layers_not_ceil)
16. step_time from the cost model (tpkit.costmodel: layer, TP all-reduces, sends, output layer, DP all-reduce) ->
    `step_time s (...)`, on H100/NDR, A100/HDR (a100_hdr) and H200 (hidden) clusters
17. tp divides gpus_per_node (TP inside a node) -> `plan keeps TP inside a node`, 4gpu_nodes `plan (tp, pp, dp)`
    (fixture planner_tp_across_nodes)
18. tp divides n_heads -> 12_heads `plan (tp, pp, dp)` (fixture planner_heads_ignored)
19. tp * pp * dp = all GPUs -> 40_gpus `plan (tp, pp, dp)` (fixture planner_idle_gpus)
20. dp * b divides the global batch -> batch_40 `plan (tp, pp, dp)` (fixture planner_batch_ignored)
21. memory total <= gpu_mem -> `plan fits in gpu_mem`, too_big (fixture planner_ignores_memory)
22. a later layout replaces the best only when faster by more than 1e-9 (relative) -> no check of its own: it keeps
    rounding from deciding between student and reference, and no scenario has two layouts that close
23. None if nothing fits -> too_big, 4gpu_nodes: `plan (tp, pp, dp); 0 = None`
24. a Plan(tp, pp, dp, m, memory, {"step": seconds}) -> `plan memory GB`, `plan step time s`, `plan m
    (micro-batches per pipeline)` (fixture planner_m_without_micro_batch)
 Task 4 (zero bubble, ZB-H1; checked as properties, so any order with them passes):
25. one list per stage of ("F", mb), ("B", mb) and ("W", mb) -> `splits the backward into B and W actions`
26. W(mb) after the stage's own B(mb); F and B as in task 1 -> `stuck at (stage, position)`
27. every F, B and W exactly once -> `runs each F(mb), B(mb) and W(mb) once`
28. with t_w <= t_f and t_w <= t_b, every stage idles at most (p-1)(t_f + t_b - t_w) -> `idle time per stage beyond ZB-H1's ...`
    for two cost sets (three hidden) (fixture zb_w_right_after_b)
29. at most p micro-batches in flight (F until W) on any stage -> `micro-batches in flight per stage beyond p`
    (fixture zb_all_w_at_the_end)
29 rules stated, 28 checked (22 only keeps the others deterministic).
Course-wide rule, stated in the lab's introduction since issue 25: code may not write into the tensors it is given ->
note (inside the rank, not scored): ctx.hand on the micro-batches and targets handed to run_pipeline.
"""
from __future__ import annotations

import torch

from grader.judge.case import Case, Contract, register
from grader.rank.week09 import (
    BUBBLE,
    EXTRA_IDLE,
    EXTRA_PEAK,
    GRADS,
    NONE_ELSEWHERE,
    ONCE,
    ONCE_FBW,
    ORDER,
    PEAK,
    RUN_ORDER,
    SCENARIOS,
    SCENARIOS_HIDDEN,
    SPLIT,
    STUCK,
    SCHEDULE,
    decode_schedule,
    encode_actions,
    loss_fn,
    planner_tensors,
    schedule_metrics,
    zb_h1_metrics,
)
from reference import planner, schedules
from tpkit import pipeline as pl
from tpkit.models import ForCausalLM, ModelConfig, init_weights

BYTES = "bytes sent by this stage"
OTHER = "collectives other than send/recv"


SENT_ORDER = ("the order of this stage's sends, as the switchboard saw them posted (0 = an activation to the next "
              "stage, 1 = a gradient to the previous one; -1 = none)")


def sends_of_schedule(actions, r: int, t: int) -> list[int]:
    """The sends a stage running `actions` posts, in its order: F(k) sends activation k on (not the last stage),
    B(k) sends gradient k back (not the first). A stage cannot send what it has not computed, so this order is the
    schedule's as far as messages show it (first and last stages send one kind only: their order is the
    micro-batches')."""
    return [0 if kind == "F" else 1 for kind, *_ in actions if (kind == "F" and r < t - 1) or (kind == "B" and r > 0)]


def _pipeline_record(cfg, record: list, r: int, t: int) -> dict:
    """What this stage sent, from the switchboard's record of its collectives: bytes in sends, anything that is not
    P2P, and the order it posted its sends in (the switchboard counts a rank's posts; their peer says the kind)."""
    sends = sorted((e for e in record if e.get("op") == "send"), key=lambda e: e.get("posted", 0))
    kinds = [0 if e.get("peer") == r + 1 else 1 if e.get("peer") == r - 1 else 2 for e in sends]
    n = 2 * cfg["micro_batches"]
    return {BYTES: torch.tensor(sum(e["sent"] for e in record), dtype=torch.float64),
            OTHER: torch.tensor(float(sum(e.get("op") not in ("send", "recv") for e in record)), dtype=torch.float64),
            SENT_ORDER: torch.tensor(kinds + [-1] * (n - len(kinds)))}


MODULE = "pipeline_lab"


# -- task 1: schedules -------------------------------------------------------------
def _expected_schedule(kind, p, m):
    ref = (schedules.gpipe if kind == "gpipe" else schedules.one_f_one_b)(p, m)
    return {STUCK: torch.tensor([-1, -1]), ONCE: torch.tensor(1),
            BUBBLE: torch.tensor(pl.bubble_formula(p, m), dtype=torch.float64),
            PEAK: torch.tensor([m if kind == "gpipe" else min(p - s, m) for s in range(p)]),
            ORDER: torch.stack([encode_actions(row, 2 * m) for row in ref])}


def _evaluate_schedules(cfg, got):
    """Run the schedules a rank returned (plain data) through the simulator, here in the trusted process."""
    out = {}
    for kind, p, m in cfg["schedules"]:
        key = f"{kind}(p={p},m={m}) "
        out.update({key + k: v for k, v in schedule_metrics(decode_schedule(got.get(key + SCHEDULE)), m).items()})
    return out


def _schedule_ref(cfg, inputs):
    out = {}
    for kind, p, m in cfg["schedules"]:
        out.update({f"{kind}(p={p},m={m}) {k}": v for k, v in _expected_schedule(kind, p, m).items()})
    return out


def _schedule_hints(schedules):
    h = {}
    for kind, p, m in schedules:
        key = f"{kind}(p={p},m={m}) "
        h[key + STUCK] = (
            "(stage, position) of the first action that can never run, [-1, -1] if the schedule completes. "
            "F(mb) on stage s needs F(mb) on stage s-1 earlier; B(mb) on stage s needs F(mb) on s and "
            "B(mb) on s+1. Run tpkit.pipeline.simulate(your_schedule).problems to see it.")
        h[key + ONCE] = "Every stage must run ('F', mb) and ('B', mb) exactly once for mb in 0..m-1."
        h[key + BUBBLE] = (f"Executed with F = 1 and B = 2 time units, the idle fraction must be "
                             f"(p-1)/(m+p-1) = {pl.bubble_formula(p, m):.4f}: a stage idles where it should work.")
        h[key + PEAK] = ("Activations stored per stage: GPipe keeps all m; 1F1B runs p-s-1 warm-up "
                                     "forwards on stage s, so at most min(p-s, m) are in flight.")
        h[key + ORDER] = ("[stage, position, 0] is the kind (0 = F, 1 = B), [stage, position, 1] the micro-batch. "
                          + ("GPipe: every stage runs F(0), ..., F(m-1), then B(0), ..., B(m-1), in micro-batch order."
                             if kind == "gpipe" else
                             "1F1B: stage s runs min(p-s-1, m) warm-up forwards F(0), F(1), ..., then alternates one "
                             "forward and one backward (F(i), then B(i - warm-up)), then drains the remaining "
                             "backwards; forwards and backwards each in micro-batch order."))
    return h


SCHEDULES = [("gpipe", 2, 4), ("gpipe", 4, 3), ("1f1b", 2, 4), ("1f1b", 4, 8), ("1f1b", 4, 2), ("1f1b", 3, 5)]
SCHEDULES_HIDDEN = [("gpipe", 3, 1), ("gpipe", 5, 6), ("1f1b", 1, 3), ("1f1b", 5, 3), ("1f1b", 3, 9),
                    ("1f1b", 6, 6)]
for name, scheds in [("schedule", SCHEDULES), ("schedule_hidden", SCHEDULES_HIDDEN)]:
    register(Case(name=f"week09/{name}", module=MODULE, world_sizes=(2,), config={"schedules": scheds},
                  make_inputs=lambda cfg, gen: {"unused": torch.zeros(1)}, reference=_schedule_ref,
                  run_rank="run_schedule", expected=lambda cfg, ref, r, t: ref, evaluate=_evaluate_schedules,
                  contract=lambda cfg, t: Contract(allowed_ops=set()), seed=0,
                  hidden=name.endswith("hidden"), title="GPipe and 1F1B schedules", hints=_schedule_hints(scheds)))


# -- task 2: a pipeline over send/recv ---------------------------------------------
def _pipe_inputs(cfg, gen):
    B, T, V = cfg["batch"], cfg["seq"], cfg["model"]["vocab_size"]
    return {"ids": torch.randint(0, V, (B, T), generator=gen), "targets": torch.randint(0, V, (B, T), generator=gen),
            "weight_seed": torch.randint(0, 2 ** 30, (1,), generator=gen)}


def build_model(cfg, seed):
    return init_weights(ForCausalLM(ModelConfig(**cfg["model"])), int(seed))


def _pipe_ref(cfg, inp):
    model = build_model(cfg, inp["weight_seed"])
    loss = loss_fn(model(inp["ids"]), inp["targets"])             # mean over all B*T tokens
    loss.backward()
    out = {"loss": loss.detach()}
    out.update({f"grad {n}": p.grad for n, p in model.named_parameters()})
    return out


def _act_bytes(cfg):
    m = cfg["micro_batches"]
    return cfg["batch"] // m * cfg["seq"] * cfg["model"]["hidden_size"] * 4     # one float32 (b, T, C)


def _expect_pipe(cfg, ref, r, t):
    model = build_model(cfg, 0)
    a, m = _act_bytes(cfg), cfg["micro_batches"]
    out = {"loss": ref["loss"]} if r == t - 1 else {}
    out[BYTES] = torch.tensor(float((r < t - 1) * m * a + (r > 0) * m * a), dtype=torch.float64)
    out[OTHER] = torch.tensor(0.0, dtype=torch.float64)
    out[GRADS] = torch.cat([ref[f"grad {n}"].flatten() for n in pl.stage_param_names(model, t, r)])
    out[RUN_ORDER] = encode_actions(schedules.one_f_one_b(t, m)[r], 2 * m)
    sends = sends_of_schedule(schedules.one_f_one_b(t, m)[r], r, t)
    out[SENT_ORDER] = torch.tensor(sends + [-1] * (2 * m - len(sends)))
    if r < t - 1:
        out[NONE_ELSEWHERE] = torch.tensor([1])
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
        RUN_ORDER: ("The order the stage really ran (F(k): its k-th forward returned; B(k): the gradient reached that "
                    "forward's output) must be one_f_one_b(p, n_micro)[rank]: min(p-s-1, m) warm-up forwards, then "
                    "one forward and one backward in turn, then the remaining backwards. All forwards before any "
                    "backward is GPipe's order: the same numbers, but every stage holds all m activations instead "
                    "of min(p-s, m)."),
        SENT_ORDER: ("Each send is posted when its tensor is ready: a stage following one_f_one_b(p, n_micro)[rank] "
                     "sends activation k right after F(k) and gradient k right after B(k). A middle stage that sends "
                     "every activation before any gradient ran GPipe's order (all m activations held, not "
                     "min(p-s, m)). Post each send as soon as its action is done."),
        NONE_ELSEWHERE: "run_pipeline returns the mean loss on the last stage and None on every other stage.",
    }


def _own_pipe(cfg, d, r, t):
    """Stage r of t: its own layers' weights (`w.<name in the dense model>`; never the seed they come from, which
    would rebuild every stage), the token ids only on the first stage, the targets only on the last (a middle stage
    has neither: everything it computes arrives over send/recv)."""
    stage = pl.split_stage(build_model(cfg, d["weight_seed"]), t, r)
    own = {f"w.{stage.full_name(n)}": p.detach().clone() for n, p in stage.named_parameters()}
    if r == 0:
        own["ids"] = d["ids"]
    if r == t - 1:
        own["targets"] = d["targets"]
    return own


_SMALL = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 4,
          "num_attention_heads": 2, "num_key_value_heads": 1}
for name, cfg, seed in [
        ("pipeline", {"model": _SMALL, "batch": 8, "seq": 4, "micro_batches": 4}, 0),
        ("pipeline_hidden", {"model": dict(_SMALL, hidden_size=24, num_hidden_layers=8, num_attention_heads=4,
                                           num_key_value_heads=2), "batch": 6, "seq": 5, "micro_batches": 3}, None)]:
    register(Case(name=f"week09/{name}", module=MODULE, world_sizes=(2, 4), config=cfg, make_inputs=_pipe_inputs,
                  reference=_pipe_ref, run_rank="run_pipeline", expected=_expect_pipe, contract=None,
                  rank_inputs=_own_pipe, from_record=_pipeline_record, feedback=(RUN_ORDER,),
                  seed=seed, hidden=seed is None, title="pipeline over send/recv", hints=_pipe_hints(cfg)))


# -- task 3: the planner ---------------------------------------------------------------
def _planner_hints(scenarios):
    h = {}
    for key, (model, cluster, layouts) in scenarios.items():
        for tp, pp, dp in layouts:
            h[f"{key} memory_per_gpu GB (tp={tp},pp={pp},dp={dp})"] = (
                "[weights, grads, optimizer, activations] in GB: 2P/(tp pp), 2P/(tp pp), 12P/(tp pp dp), "
                "ceil(L/pp) min(pp, m) s b h 34/tp with m = global_batch/(dp b).")
            h[f"{key} step_time s (tp={tp},pp={pp},dp={dp})"] = (
                "(m + pp - 1) t_mb + t_dp, t_mb = ceil(L/pp) (fwd + bwd + the layer's TP all-reduces) "
                "+ output layer / pp + 2 sends of the activation's 1/tp, each piece from tpkit.costmodel on "
                "cluster.gpu and cluster.nic.")
        h[f"{key} plan (tp, pp, dp); 0 = None"] = (
            "(tp, pp, dp) of the fastest layout that fits in memory, among those with tp dividing gpus_per_node "
            "and n_heads, tp*pp*dp = all GPUs and dp*micro_batch dividing global_batch (pp need not divide "
            "n_layers); (0, 0, 0) means plan() returned None because nothing fits.")
        h[f"{key} plan m (micro-batches per pipeline)"] = "Plan.micro_batches is m = global_batch / (dp * micro_batch)."
        h[f"{key} plan fits in gpu_mem (1 = yes)"] = "The plan's memory total must not exceed cluster.gpu_mem: reject layouts that do not fit."
        h[f"{key} plan keeps TP inside a node (1 = yes)"] = (
            "TP must stay inside a node (tp divides gpus_per_node): its collectives sit on the critical path of "
            "every layer and need NVLink bandwidth; PP and DP cross nodes.")
        h[f"{key} plan memory GB"] = "The plan's memory breakdown, as memory_per_gpu gives it for its degrees."
        h[f"{key} plan step time s"] = "The plan's time['step'], as step_time gives it for its degrees."
    return h


def _planner_ref(cfg, inp):
    return planner_tensors((planner.memory_per_gpu, planner.step_time, planner.plan), cfg["scenarios"])


for name, scenarios in [("planner", SCENARIOS), ("planner_hidden", SCENARIOS_HIDDEN)]:
    register(Case(name=f"week09/{name}", module=MODULE, world_sizes=(2,), config={"scenarios": list(scenarios)},
                  make_inputs=lambda cfg, gen: {"unused": torch.zeros(1)}, reference=_planner_ref,
                  run_rank="run_planner", expected=lambda cfg, ref, r, t: ref,
                  contract=lambda cfg, t: Contract(allowed_ops=set()), seed=0, hidden=name.endswith("hidden"),
                  title="3-D topology planner", hints=_planner_hints(scenarios)))


# -- task 4: zero bubble (ZB-H1) -------------------------------------------------------
def _zb_ref(cfg, inputs):
    out = {}
    for p, m in cfg["shapes"]:
        out.update(zb_h1_metrics(schedules.zb_h1(p, m), p, m, cfg["costs"]))
    return out


def _evaluate_zb(cfg, got):
    out = {}
    for p, m in cfg["shapes"]:
        out.update(zb_h1_metrics(decode_schedule(got.get(f"zb_h1(p={p},m={m}) {SCHEDULE}")), p, m, cfg["costs"]))
    return out


def _zb_hints(cfg):
    h = {}
    for p, m in cfg["shapes"]:
        for t_f, t_b, t_w in cfg["costs"]:
            key = f"zb_h1(p={p},m={m}) t_f,t_b,t_w={t_f:g},{t_b:g},{t_w:g}: "
            h[key + STUCK] = ("(stage, position) of the first action that can never run. W(mb) on stage s needs B(mb) on "
                              "the same stage; B(mb) needs F(mb) on s and B(mb) on s+1. "
                              "tpkit.pipeline.simulate(zb_h1(p, m), t_f=1, t_b=1, t_w=1).problems names it.")
            h[key + SPLIT] = ("A ZB-H1 schedule has ('W', mb) actions: B is the input gradient only, and W, the weight "
                              "gradient, is a separate action that nobody waits for.")
            h[key + ONCE_FBW] = "Every stage must run ('F', mb), ('B', mb) and ('W', mb) exactly once for mb in 0..m-1."
            h[key + EXTRA_IDLE] = (
                f"Executed with these costs, every stage may idle at most (p-1)(t_f + t_b - t_w) = "
                f"{(p - 1) * (t_f + t_b - t_w):g} units; the tensor is the idle time beyond that per stage. "
                "Running each W right after its B keeps 1F1B's bubble (p-1)(t_f + t_b + t_w): stage s must defer "
                "s of its W's and run them in the cool-down, where it would otherwise wait for gradients.")
            h[key + EXTRA_PEAK] = (
                "A micro-batch stays in flight from its F until its W. ZB-H1 keeps 1F1B's peak memory: at most p "
                "micro-batches on any stage (stage 0 of 1F1B holds p). Deferring more W's, or running more warm-up "
                "forwards, holds more.")
    return h


ZB_COSTS = [(1, 1, 1), (1, 2, 1)]
ZB_COSTS_HIDDEN = [(1, 1, 1), (2, 2, 1), (1, 1.5, 0.5)]
for name, cfg in [("zb_h1", {"shapes": [(4, 8), (2, 4), (3, 6)], "costs": ZB_COSTS}),
                  ("zb_h1_hidden", {"shapes": [(5, 10), (4, 4), (6, 7), (1, 3)], "costs": ZB_COSTS_HIDDEN})]:
    register(Case(name=f"week09/{name}", module=MODULE, world_sizes=(2,), config=cfg,
                  make_inputs=lambda cfg, gen: {"unused": torch.zeros(1)}, reference=_zb_ref,
                  run_rank="run_zb_h1", expected=lambda cfg, ref, r, t: ref, evaluate=_evaluate_zb,
                  contract=lambda cfg, t: Contract(allowed_ops=set()), seed=0, hidden=name.endswith("hidden"),
                  title="zero-bubble ZB-H1 schedule", hints=_zb_hints(cfg)))
