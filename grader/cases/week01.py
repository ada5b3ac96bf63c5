"""Week 1: ring reduce-scatter, all-gather and all-reduce from point-to-point ops, t = 2, 3, 4.

The student's API (module `ring_collectives`), every function returns a NEW tensor and leaves
its input unchanged:
- ring_reduce_scatter(x, group=None) -> 1-D tensor: this rank's chunk of the sum over ranks of
  x.flatten(), where the chunks are `torch.tensor_split(flat, t)` (any numel works; the first
  numel % t chunks are one element longer).
- ring_all_gather(x, group=None) -> torch.cat([x_0, ..., x_{t-1}], dim=0); every rank passes the
  same shape.
- ring_all_reduce(x, group=None) -> the sum over ranks, x's shape; any numel.

A ring (Patarasuk & Yuan 2009; Thakur et al. 2005) sends per rank (t-1)/t N bytes for
reduce-scatter and all-gather and 2(t-1)/t N for all-reduce (N = bytes of the full tensor):
the optimum, because each rank must receive (t-1)/t of the data in each phase.

Inputs: one (4, ...) stack per case; rank r of a group of size t receives row r only (its own tensor, as
each process of a real job holds only its own data), never the other ranks' rows: the sum or the gathered
tensor cannot be made without the ring. The dense results are computed here, in the trusted process, from
the stack (cumulative sums, so row t-1 is the sum of the first t ranks' inputs).

Scored: values against the trusted reference and the switchboard's record of the collectives. "note (inside the
rank, not scored)" marks what the harness measures in the student's process: said beside the verdict, no points.
Such notes everywhere: ctx.hand (an input written into) and a replaced harness function (grader/rank/seal.py).
Rules the lab's text states -> the check that enforces it (case: tensor or contract field):
 1. ring_reduce_scatter returns chunk r of the sum -> reduce_scatter: `y`
 2. chunks are torch.tensor_split pieces, any numel -> reduce_scatter_uneven (201 at t=4 splits 51,50,50,50,
    torch.chunk would give 51,51,51,48): `y`; hidden reduce_scatter_hidden (1001)
 3. ring_all_gather returns the chunks in rank order along dim 0 -> all_gather: `y`
 4. ring_all_reduce returns the sum, shaped like x, any numel -> all_reduce: `y`; hidden all_reduce_hidden
    (1003) and all_reduce_2d_hidden (37 x 29), not divisible by 2, 3 or 4
 5. return a new tensor, leave x unchanged -> every case, note (inside the rank, not scored): ctx.hand("x") (fixture
    reduce_scatter_in_place: full marks, with the note)
 6. only send/recv traffic, no dist.all_reduce -> every case: Contract.allowed_ops (fixture uses_all_reduce)
 7. bytes sent per rank = the ring optimum within 1% -> every case: Contract.bytes_sent["all"]
 8. use `group` (t=3 runs on ranks 1-3 of a 4-rank job, t=2 on ranks 2-3) -> world_sizes (2, 3, 4) on a
    4-rank job: a global rank or world size breaks the smaller sizes; the default group is refused
 9. a ring step that cannot deadlock (non-blocking ops) -> every case: the deadlock watch names the ranks waiting
    in their sends (fixture deadlock_send_first)
9 rules stated; 9 checked before this issue (rule 5 by an `x_unchanged` tensor), 9 checked now (8 scored, rule 5 a
note).
Course-wide rule (not in this lab's text): a rank holds only its own input -> every case: `_own_row`
(fixture peek_caller_frame).
Every case's seed, public ones too, is drawn fresh at grading in the trusted process (grader/judge/job.py
draw_seeds) and never reaches a rank (fixture seed_oracle: an answer rebuilt from the public seed fails).
"""
from __future__ import annotations

import torch

from grader.judge.case import Case, Contract, register

MODULE = "ring_collectives"
T_MAX = 4
P2P_ONLY = {"send", "recv"}


def _inputs(cfg, gen):
    return {"x": torch.randn(T_MAX, *cfg["shape"], generator=gen)}


def _own_row(cfg, inp, r, t):
    """Rank r's own tensor, x_r: the others' rows of the stack stay in the trusted process."""
    return {"x": inp["x"][r].clone()}


def _reference(cfg, inp):
    x = inp["x"]
    return {"x": x.clone(), "partial_sums": x.cumsum(0)}  # partial_sums[t-1] = x_0 + ... + x_{t-1}


def _numel(cfg) -> int:
    n = 1
    for s in cfg["shape"]:
        n *= s
    return n


def _expect_rs(cfg, ref, r, t):
    full = ref["partial_sums"][t - 1].flatten()
    return {"y": torch.tensor_split(full, t)[r].contiguous()}


def _expect_ag(cfg, ref, r, t):
    return {"y": ref["x"][:t].flatten(0, 1).contiguous()}


def _expect_ar(cfg, ref, r, t):
    return {"y": ref["partial_sums"][t - 1]}


def _contract(factor_name):
    def contract(cfg, t):
        n_bytes = 4 * _numel(cfg)                       # float32
        if factor_name == "all_gather":
            n_bytes *= t                                # N = the gathered tensor
        factor = 2 * (t - 1) / t if factor_name == "all_reduce" else (t - 1) / t
        how = {"reduce_scatter": "(t-1)/t N: t-1 steps, each sending one of t chunks",
               "all_gather": "(t-1)/t N: t-1 steps, each forwarding one of t chunks",
               "all_reduce": "2(t-1)/t N: a reduce-scatter phase then an all-gather phase"}[factor_name]
        return Contract(allowed_ops=P2P_ONLY, bytes_sent={"all": factor * n_bytes},
                        why={"forward": f"a ring {factor_name.replace('_', '-')} sends {how}."})
    return contract


_RING = ("On a ring, rank r sends to (r + 1) mod t and receives from (r - 1) mod t, both in the same step "
         "(batch_isend_irecv, or isend + recv). ")
HINTS = {
    "ring_reduce_scatter": _RING + "In reduce-scatter, at step s rank r sends its partial sum of chunk (r - s - 1) mod t "
        "and ADDS the received chunk (r - s - 2) mod t to its own copy (its own input is already in it: add it once); "
        "after t - 1 steps chunk r (of torch.tensor_split(x.flatten(), t)) holds the full sum.",
    "ring_all_gather": _RING + "In all-gather, at step s rank r forwards chunk (r - s) mod t (the one it received "
        "in the step before) and stores chunk (r - s - 1) mod t; the result is the chunks in rank order.",
    "ring_all_reduce": _RING + "All-reduce = reduce-scatter then all-gather of the reduced chunks; if "
        "reduce-scatter and all-gather pass on their own, look at how the two phases are joined (padding, order).",
}

# (name, function, shape, seed); hidden variants draw a fresh seed and use sizes not divisible by 2, 3 or 4
_SPECS = [
    ("reduce_scatter", "ring_reduce_scatter", [24, 5], 10),
    ("reduce_scatter_uneven", "ring_reduce_scatter", [201], 13),   # t=4: tensor_split 51,50,50,50; chunk 51,51,51,48
    ("reduce_scatter_hidden", "ring_reduce_scatter", [1001], None),
    ("all_gather", "ring_all_gather", [6, 4], 11),
    ("all_gather_hidden", "ring_all_gather", [7, 3, 5], None),
    ("all_reduce", "ring_all_reduce", [12, 10], 12),
    ("all_reduce_hidden", "ring_all_reduce", [1003], None),
    ("all_reduce_2d_hidden", "ring_all_reduce", [37, 29], None),
]
_EXPECT = {"ring_reduce_scatter": (_expect_rs, "reduce_scatter"), "ring_all_gather": (_expect_ag, "all_gather"),
           "ring_all_reduce": (_expect_ar, "all_reduce")}

for _name, _fn, _shape, _seed in _SPECS:
    _exp, _kind = _EXPECT[_fn]
    register(Case(name=f"week01/{_name}", module=MODULE, world_sizes=(2, 3, 4), config={"shape": _shape, "fn": _fn},
                  make_inputs=_inputs, reference=_reference, run_rank="run_ring", expected=_exp,
                  contract=_contract(_kind), seed=_seed, hidden=_seed is None, title=_fn, rank_inputs=_own_row,
                  hints={"y": HINTS[_fn]}))
