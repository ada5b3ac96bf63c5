"""Week 12: the capstone, a tiny Llama-MoE (tpkit.capstone_model) trained in 4-D on 4 ranks, saved in one layout
and resumed in another (lecture: reference/capstone.py, notebooks/week12_capstone.ipynb).

- degrees: the student's ParallelDims on scenarios (pure data, t = 2 only because a case needs ranks): which it
  refuses with ValueError, and the groups of every dim (tp, pp, dp, ep, edp) of the valid ones. No collective.
- train: layout A for a few steps: the loss at every step (last stage) and every rank's weight shards after them,
  against the single-device run computed here; the switchboard's record of which group each gradient all-reduce
  ran on and how many bytes it carried, and the bytes the stages sent each other.
- resume: train (layout A), save with torch.distributed.checkpoint, build layout B with every weight NaN, load,
  train on: the losses of both layouts and the weights after each, against ONE single-device run.

Grading runs on 4 ranks (the graded layouts: TP2 x PP2 -> TP2 x DP2 x EP2, hidden DP4 x EP2 (edp 2) -> TP4), the
lecture on 8 (TP2 x PP2 x DP2 x EP2 -> TP4 x DP2). The fork launcher and the switchboard run 8 ranks (that resume
passes as a check in 15 s on 2 busy cores, measured), but 4 keep the whole graded job (5 checks, hidden included)
at about 10 s for a class, and let a 4-GPU node run it: every dimension above 1 still meets PP, TP, DP and EP.

atol 1e-4 (not the course's 1e-3), for the weights and losses: float32 reorderings of the sums (a TP all-reduce,
the DP bucket) move them by < 1e-5 after 8 steps, while a lost momentum buffer or a gradient summed over a wrong
group moves the weights by more than 1e-3 but some losses by less.

Scored: values against the trusted reference and the switchboard's record. The rank's word about itself
(Contract.params, ctx.hand, the seal) is a note, never scored.
Rules the lab's text states -> the check that enforces it (case: tensor or field):
 1. ParallelDims refuses degrees < 1, non-int degrees, ep not dividing dp, tp*pp*dp != world -> degrees: VALID
 2. the mesh is (pp, dp, tp), tp fastest; ep borrows dp (dp_i = edp_i * ep + ep_i) -> degrees: groups of each dim
 3. build_groups: every rank makes every group -> train, resume (a rank that skips one deadlocks its peers)
 4. the stage holds blocks s*n/pp:(s+1)*n/pp, its TP shards (week 3), vocab rows (week 4), its experts (week 11)
    -> train: WEIGHTS (every kind); a rank receives only its own blocks, NaN elsewhere (fixture stage_wrong_tp_group)
 5. loss of each micro-batch / (n_micro * dp); returned loss all-reduced over dp -> train: LOSSES
 6. tp-sharded and replicated grads summed over dp, experts over edp, one all-reduce per group -> train, resume:
    GRAD_BYTES from the record, WEIGHTS (fixtures experts_reduced_over_dp, norms_not_reduced)
 7. the pipeline over send/recv on the pp group: one activation forward and one gradient back per micro-batch and
    stage boundary -> train: PIPE_BYTES from the record (the order, 1F1B or GPipe, is week 9's check, not this one's)
 8. every collective of a layout runs on one of its groups -> train, resume: STRAY from the record
 9. the checkpoint holds weights, momentum buffers and the step, under dense names with global offsets; loading
    it in another layout continues the run exactly -> resume: LOSSES and WEIGHTS of layout B (fixture
    checkpoint_without_momentum); load_checkpoint returns the step (GradingError otherwise)
9 rules stated, 9 checked.
"""
from __future__ import annotations

import math

import torch

from grader.judge.case import Case, register
from grader.rank.week12 import (GRAD_BYTES, KINDS, LAYOUTS, LOSSES, PIPE_BYTES, STRAY, VALID, WEIGHTS, block,
                                capstone_config, coords, group_of, groups_name, kind, stage_names)
from reference import capstone as cap

MODULE = "capstone_lab"
DIMS = ("tp", "pp", "dp", "ep", "edp")


# -- task 1: the degrees ------------------------------------------------------------------------------------
SCENARIOS = {"tp2_pp2_dp2_ep2": (2, 2, 2, 2, 8), "tp1_pp1_dp4_ep2": (1, 1, 4, 2, 4), "tp2_pp1_dp2_ep1": (2, 1, 2, 1, 4),
             "wrong_world": (2, 2, 2, 1, 4), "ep_not_dividing_dp": (2, 1, 3, 2, 6), "zero_tp": (0, 2, 2, 1, 0),
             "float_pp": (2, 2.0, 1, 1, 4)}
HIDDEN_SCENARIOS = {"tp4_pp2_dp2_ep2": (4, 2, 2, 2, 16), "tp1_pp2_dp4_ep4": (1, 2, 4, 4, 8),
                    "ep_too_big": (1, 1, 2, 4, 2), "negative_dp": (1, 1, -2, 1, -2)}


def _degrees_expected(cfg, ref, r, t):
    out = {VALID: torch.tensor([int(_valid(*s)) for s in cfg["scenarios"].values()])}
    for key in cfg["show_groups"]:
        tp, pp, dp, ep, world = cfg["scenarios"][key]
        for dim in DIMS:
            firsts = {}
            for rank in range(world):
                firsts.setdefault(tuple(group_of(rank, dim, tp, pp, dp, ep)), None)
            out[groups_name(key, dim)] = torch.tensor(sorted(firsts), dtype=torch.int64)
    return out


def _valid(tp, pp, dp, ep, world) -> bool:
    ints = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (tp, pp, dp, ep))
    return ints and dp % ep == 0 and tp * pp * dp == world


def _degrees_hints(cfg):
    h = {VALID: ("ParallelDims(tp, pp, dp, ep, world_size) raises ValueError when a degree is not an int >= 1, when "
                 "ep does not divide dp, or when tp*pp*dp is not the world size; in the order of the scenarios: "
                 + ", ".join(cfg["scenarios"]) + ".")}
    for key in cfg["show_groups"]:
        for dim in DIMS:
            h[groups_name(key, dim)] = (
                "The mesh is (pp, dp, tp), tp fastest: rank = (pp_i*dp + dp_i)*tp + tp_i, and ep splits dp as "
                "dp_i = edp_i*ep + ep_i. A group along a dim holds the ranks whose other coordinates are equal "
                "(dp: same pp, tp; ep: same pp, tp, edp; edp: same pp, tp, ep), groups in order of their first rank.")
    return h


for name, scen, seed in [("degrees", SCENARIOS, 0), ("degrees_hidden", HIDDEN_SCENARIOS, None)]:
    cfg = {"scenarios": scen, "show_groups": [k for k, s in scen.items() if _valid(*s)]}
    register(Case(name=f"week12/{name}", module=MODULE, world_sizes=(2,), config=cfg,
                  make_inputs=lambda cfg, gen: {}, reference=lambda cfg, d: {}, run_rank="run_degrees",
                  expected=_degrees_expected, seed=seed, hidden=seed is None, title="ParallelDims",
                  hints=_degrees_hints(cfg)))


# -- task 2-4: train, save, resume ------------------------------------------------------------------------
def _steps(cfg):
    return cfg["steps_a"] + cfg["steps_b"]


def _inputs(cfg, gen):
    V, N = cfg["model"]["vocab_size"], _steps(cfg)
    return {"weight_seed": torch.randint(0, 2 ** 30, (1,), generator=gen),
            "ids": torch.randint(0, V, (N, cfg["batch"], cfg["seq"]), generator=gen),
            "targets": torch.randint(0, V, (N, cfg["batch"], cfg["seq"]), generator=gen)}


def _reference(cfg, d):
    data = list(zip(d["ids"], d["targets"]))
    losses, states = cap.dense_run(capstone_config(cfg), int(d["weight_seed"]), data, cfg["lr"], cfg["momentum"],
                                   keep=(cfg["steps_a"],))
    return {"losses": torch.tensor(losses), "state_a": states[cfg["steps_a"]], "state_b": states[_steps(cfg)]}


def _place(cfg, X, r):
    tp, pp, dp, ep = cfg[X]
    return coords(r, tp, pp, dp, ep), {"tp": tp, "ep": ep}


def _rank_inputs(cfg, d, r, t):
    """Layout A's blocks of the initial weights this rank holds, and the data shares its stages need in A and B."""
    from tpkit.capstone_model import LlamaMoE, init_capstone
    ccfg = capstone_config(cfg)
    init = dict(init_capstone(LlamaMoE(ccfg), int(d["weight_seed"])).named_parameters())
    c, degrees = _place(cfg, "a", r)
    own = {f"w.{n}": block(init[n].detach(), n, c, degrees).clone() for n in stage_names(ccfg, cfg["a"][1], c["pp"])}
    lo = 0
    for X in LAYOUTS:
        n = cfg[f"steps_{X}"]
        if not n:
            continue
        c, _ = _place(cfg, X, r)
        pp, dp = cfg[X][1], cfg[X][2]
        share = slice(c["dp"] * cfg["batch"] // dp, (c["dp"] + 1) * cfg["batch"] // dp)
        if c["pp"] == 0:
            own[f"ids_{X}"] = d["ids"][lo:lo + n, share].clone()
        if c["pp"] == pp - 1:
            own[f"tgt_{X}"] = d["targets"][lo:lo + n, share].clone()
        lo += n
    return own


def _expected(cfg, ref, r, t):
    """Per layout: what the record must show first (it explains the numbers), then the losses and the weights."""
    ccfg, out, lo = capstone_config(cfg), {}, 0
    for X in LAYOUTS:
        n = cfg[f"steps_{X}"]
        if not n:
            continue
        tp, pp, dp, ep = cfg[X]
        c, degrees = _place(cfg, X, r)
        names = sorted(stage_names(ccfg, pp, c["pp"]))
        for dim in _reduce_dims(r, tp, pp, dp, ep):
            # ep = 1: the experts' replicas (edp) are the dp group itself, one group in the record
            reduced = [m for m in names if dim == "dp" and (ep == 1 or kind(m) != KINDS[2])
                       or dim == "edp" and kind(m) == KINDS[2]]
            if reduced:
                out[GRAD_BYTES.format(dim=dim, X=X.upper())] = torch.tensor(
                    4.0 * sum(block(ref["state_a"][m], m, c, degrees).numel() for m in reduced), dtype=torch.float64)
        if pp > 1:
            act = cfg["batch"] // dp * cfg["seq"] * cfg["model"]["hidden_size"] * 4      # n_micro of (b/n_micro, T, C)
            out[PIPE_BYTES.format(X=X.upper())] = torch.tensor(
                float(act * ((c["pp"] < pp - 1) + (c["pp"] > 0))), dtype=torch.float64)
        out[STRAY.format(X=X.upper())] = torch.tensor(0)
        if c["pp"] == pp - 1:
            out[LOSSES.format(X=X.upper())] = ref["losses"][lo:lo + n]
        for k in KINDS:
            parts = [block(ref[f"state_{X}"][m], m, c, degrees).flatten() for m in names if kind(m) == k]
            out[WEIGHTS.format(X=X.upper(), kind=k)] = torch.cat(parts) if parts else torch.zeros(0)
        lo += n
    return out


def _record(cfg, record: list, r: int, t: int) -> dict:
    """Per layout, from the switchboard's record of this rank: the bytes of the all-reduces (more than one element:
    gradients, not the loss) on its dp and edp groups per step, the bytes it sent over its pp group per step, and
    how many collectives ran on a group that is none of this layout's."""
    out = {}
    for X in LAYOUTS:
        n = cfg[f"steps_{X}"]
        if not n:
            continue
        tp, pp, dp, ep = cfg[X]
        mine = [e for e in record if e.get("phase") == f"layout_{X}"]
        groups = {dim: sorted(group_of(r, dim, tp, pp, dp, ep)) for dim in DIMS}
        on = lambda e, dim: sorted(e.get("members", [])) == groups[dim]           # noqa: E731
        for dim in _reduce_dims(r, tp, pp, dp, ep):
            got = sum(e["bytes"] for e in mine
                      if e["op"] == "all_reduce" and on(e, dim) and math.prod(e.get("shape", [])) > 1)
            out[GRAD_BYTES.format(dim=dim, X=X.upper())] = torch.tensor(got / n, dtype=torch.float64)
        if pp > 1:
            got = sum(e["bytes"] for e in mine if e["op"] == "send" and on(e, "pp"))
            out[PIPE_BYTES.format(X=X.upper())] = torch.tensor(got / n, dtype=torch.float64)
        out[STRAY.format(X=X.upper())] = torch.tensor(sum(not any(on(e, dim) for dim in DIMS) for e in mine))
    return out


def _reduce_dims(r, tp, pp, dp, ep) -> list[str]:
    """The gradient groups whose bytes the record can tell apart: dp when it has more than one rank, edp when it
    has more than one rank and is not the dp group itself (ep > 1)."""
    return [dim for dim in ("dp", "edp") if len(group_of(r, dim, tp, pp, dp, ep)) > 1 and (dim == "dp" or ep > 1)]


def _hints(cfg):
    h = {}
    for X in ("A", "B"):
        resumed = (" After a resume: load_checkpoint must restore the weights AND the momentum buffers."
                   if X == "B" else "")
        h[LOSSES.format(X=X)] = ("The mean loss over the global batch: each micro-batch's loss / (n_micro * dp) before "
                                 "backward, summed, all-reduced over dp." + resumed)
        h[WEIGHTS.format(X=X, kind="tp-sharded")] = (
            "TP-sharded weights: a rank's block is chunk tp_i of the dense tensor (rows of q/k/v/gate/up/embed/"
            "lm_head, columns of o/down); their grads are summed over dp only (a tp rank's block is its own)."
            + resumed)
        h[WEIGHTS.format(X=X, kind="replicated")] = (
            "Replicated weights (the RMSNorm weights, the router) live on every dp replica: their grads must be "
            "all-reduced over dp like every other weight, or the replicas drift apart." + resumed)
        h[WEIGHTS.format(X=X, kind="experts")] = (
            "Experts: rank ep_i holds experts chunk ep_i; the all-to-all already brought every ep rank's tokens to "
            "them, so their grads are summed over edp (the replicas of the same experts), never over dp." + resumed)
        for dim in ("dp", "edp"):
            h[GRAD_BYTES.format(dim=dim, X=X)] = (
                f"The record of your all-reduces on this rank's {dim} group, per step, against 4 bytes per element of "
                "every local gradient the plan sums there: dp for tp-sharded and replicated weights, edp for experts. "
                "Fewer bytes: a gradient was left out (or reduced over another group); more: one was reduced twice.")
        h[PIPE_BYTES.format(X=X)] = ("Each stage sends one (b/n_micro, T, C) float32 activation per micro-batch "
                                     "forward (not the last stage) and one gradient back (not the first), over the pp "
                                     "group.")
        h[STRAY.format(X=X)] = ("Every collective of a layout must run on one of the groups build_groups made for it "
                                "(tp, pp, dp, ep, edp): the default group, or a group of the wrong layout, is not one.")
    return h


_MODEL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
          "num_attention_heads": 8, "num_key_value_heads": 4}
_BASE = {"model": _MODEL, "moe": {"n_experts": 4, "top_k": 2, "expert_size": 32}, "batch": 8, "seq": 8,
         "n_micro": 2, "lr": 0.05, "momentum": 0.9}
for name, layouts, seed in [("train", {"a": [2, 2, 1, 1], "b": [2, 2, 1, 1], "steps_a": 4, "steps_b": 0}, 0),
                            ("resume", {"a": [2, 2, 1, 1], "b": [2, 1, 2, 2], "steps_a": 4, "steps_b": 4}, 1),
                            ("resume_hidden", {"a": [1, 1, 4, 2], "b": [4, 1, 1, 1], "steps_a": 3, "steps_b": 3},
                             None)]:
    cfg = {**_BASE, **layouts}
    register(Case(name=f"week12/{name}", module=MODULE, world_sizes=(4,), config=cfg, make_inputs=_inputs,
                  rank_inputs=_rank_inputs, reference=_reference, run_rank="run_capstone", expected=_expected,
                  from_record=_record, atol=1e-4, seed=seed, hidden=seed is None, timeout=60,
                  title="4-D training and resume", hints=_hints(cfg)))
