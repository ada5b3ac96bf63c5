"""Week 6: overlapped (ring) AG+GEMM and GEMM+RS, the column/row linears built on them, and the sequence-parallel
column linear whose backward overlaps its all-gather and reduce-scatter with GEMMs (Megatron-LM); t = 2 and 4.

Correctness is scored (dense reference at atol=1e-3), with the switchboard's counts and bytes of the collectives.
Bit-exactness vs the non-overlapped version (where the algorithm allows), recomputed on the rank, is a note
(inside the rank, not scored); the time overlap saves is not scored (a timing, reported by
`tpkit.timeline.overlap_efficiency`); Task 4's order of issue, GEMM and wait (rule 12) is measured on the rank: a
note too. Task 4 is scored on its values and the collectives' counts and bytes per phase.

What each rank receives (`_own_*`, Case.rank_inputs): the ring functions get its x block (the sequence block for
AG+GEMM, the input-feature block for GEMM+RS) and its weight shard, nothing of the other ranks'; the linears get the
dense weight from_dense is handed with the other ranks' rows (column, SP column) or columns (row) NaN, their input
block and their block of dY (fixture column_dense_weight: every output feature from the kept dense weight, then
its columns, full marks when ranks were handed everything; now dX = dY W reads the NaN rows).

Bit-exactness ("same_bits_as_plain"): the harness recomputes the non-overlapped version on the rank, in a
phase the contract ignores: all-gather then F.linear on each contiguous (B, T/t, C) block; or F.linear per
block then reduce_scatter. The ring AG moves bytes and never adds, so its GEMMs see identical inputs: equal
bits in exact arithmetic. The ring RS adds the partial sums in ring order; reduce_scatter (gloo emulates it
with an all-reduce) adds them in its own order. Two terms commute exactly (a + b == b + a), so equal bits at
t = 2; at t = 4 the order, and so the rounding, differs. A second exception is the CPU BLAS itself: the same
(2, 2, 16) GEMM on the same values gives different last bits when its input starts 4 bytes off a 16-byte
boundary (measured, torch 2.13 CPU), and at t = 4 the AG check also differed in our runs. So bits are compared
(a note) at t = 2 (where they held in every run) and only atol=1e-3 applies at t = 4.

Scored: values against the trusted reference and the switchboard's record of the collectives. "note (inside the
rank, not scored)" marks what the harness measures in the student's process: said beside the verdict, no points.
Such notes everywhere: Contract.params (the names and shapes a rank reports; a rank keeping more than its shard is
caught by its values, as it receives only its own part of every dense tensor, the rest NaN), ctx.hand (an input
written into) and a replaced harness function (grader/rank/seal.py).
Rules the lab's text states -> the check that enforces it (case: tensor or contract field):
 1. ring_all_gather_matmul returns Y = AllGather(x) W^T (B, T, O) and the gathered x -> ag_matmul: `y`, `x_full`
 2. at step k rank r holds the block of rank (r - k) mod t -> ag_matmul at t=4: `y` (fixture wrong_chunk_order)
 3. two buffers of its own, used in turn (never the caller's x_s) -> note (inside the rank, not scored):
    ctx.hand("x_s"), ctx.hand("weight") (fixture receives_into_input: full marks, with the note)
 4. matmul_reduce_scatter returns this rank's block of the sum (B, T/t, O) -> matmul_rs: `y`
 5. per ring t-1 sends and t-1 receives, no collective -> every case: Contract.counts
 6. the forward equals the non-overlapped version bit for bit (at t = 2, see above) -> ag_matmul, matmul_rs,
    note (inside the rank, not scored): `same_bits_as_plain`
 7. the column linear keeps rows r*O/t:(r+1)*O/t; forward ring AG+GEMM, backward GEMM+RS for dX and dW from the
    gathered X -> column_linear: Contract.params (note), counts forward/backward (one ring each), `y`, `dx`, `dW`
 8. the row linear keeps that block of columns; forward GEMM+RS, backward ring AG+GEMM of dY -> row_linear: the same
 9. the SP column linear keeps rows r*O/t:(r+1)*O/t; forward all-gathers x along T (one all-gather), backward
    re-gathers X for dW and reduce-scatters dX, nothing else; outputs and grads match the dense layer ->
    sp_column_backward: Contract.params (note), counts and bytes_sent per phase, `y`, `dx`, `dW`
    (fixture forgot_reduce_scatter)
10. forward saves only x_s, not the gathered X -> note (inside the rank, not scored): `saves_shard_only` (no saved
    tensor, nor ctx attribute, of the gathered size)
11. moving the waits changes no bits: output, dX and dW equal the non-overlapped version (all_gather_single, F.linear;
    dy @ weight, reduce_scatter_single; dy^T X) bit for bit -> note (inside the rank, not scored): `bits_y`,
    `bits_dx`, `bits_dW`, recomputed in the harness phase. Held at t = 2 and 4: both sides run the same gloo
    collectives on the same inputs and the same GEMMs on freshly allocated buffers.
12. the all-gather is posted (async_op=True) before the dgrad GEMM and waited after it; the reduce-scatter is posted
    before the wgrad GEMM and waited after it -> note (inside the rank, not scored; the checker cannot score the order
    from outside the rank yet): `overlap_ag`, `overlap_rs`: the order in which backward issued each collective, ran
    GEMMs (aten mm/addmm/bmm/baddbmm) and returned from Work.wait / wait_tensor, recorded on the rank
    (tpkit.timeline.IssueLog) (fixture serialized_backward_ag: full marks, with the note). Only the GEMM the rule
    names counts, recognised by what it reads and makes (grader.rank.week06.BackwardGemms): the dgrad GEMM reads all
    of dY and the weight and makes all of dX; the wgrad GEMM reads all of dY and of the re-gathered X and makes all of
    dW; views and data-moving copies of those buffers count as them (tpkit.timeline.Provenance) (fixtures, full marks
    with the note: dummy_gemm_under_collectives: a 1x1 torch.mm under each; sliced_gemm_under_collectives: one
    position's share; independent_backward: a correct backward written differently, full marks)
12 rules stated; 8 checked before this issue, 12 checked now (rule 12 by the named GEMMs since issue 23). Scored now:
1, 2, 4, 5, 7, 8 and 9 (values and the switchboard's record); 3, 6, 10, 11 and 12 are notes (inside the rank, not
scored).
Stated by the lab as reported, not graded: the ring's overlap (Tasks 1-3: post step k+1 before the GEMM of step k,
wait after it). Timing on a shared CPU is not a fair grade; the ungraded cell reports it (fixture
serialized_overlap passes by design). Task 4 measures the *order* of issue, GEMM and wait (rule 12), which is
deterministic, but on the rank: a note; whether the bytes really moved during the GEMM is a timing again, and not
graded.
"No bias" is the lab's scope, not a rule.
Course-wide rule, stated in the lab's introduction since issue 25: code may not write into the tensors it is given ->
note (inside the rank, not scored): ctx.hand on the ring functions' inputs and the linears' dense weight and input
(fixture receives_into_input: full marks, with the note).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from grader.judge.case import Case, Contract, poisoned, register, shard
from reference import backward

MODULE = "overlap_linear"
BITS_HINT = ("The ring moves bytes without arithmetic, so each block's GEMM sees the same input as 'all-gather, then "
             "F.linear on each (B, T/t, C) block': the result must be identical bit for bit. A difference means a "
             "block was computed from other data or by another kernel.")
HINTS = {
    "y": "Check which slot each step's GEMM goes to: at step k rank r holds the block of rank (r - k) mod t "
         "(and, for GEMM+RS, works on block (r - k - 1) mod t). A mismatch only at t=4 is a wrong ring direction.",
    "x_full": "The gathered input must hold rank j's block at positions j*T/t:(j+1)*T/t.",
    "dx": "Column: dX = dY W summed over ranks, this rank's block (GEMM+RS with W.t()). Row: dX = AllGather(dY) W.",
    "dW": "dW = dY^T X over all B*T rows: the gathered X (column) or the gathered dY (row).",
    "same_bits_as_plain": BITS_HINT,
}


def _inputs(cfg, gen):
    B, T, I, O = cfg["B"], cfg["T"], cfg["in"], cfg["out"]
    return {"x": torch.randn(B, T, I, generator=gen), "W": torch.randn(O, I, generator=gen) / math.sqrt(I),
            "dy": torch.randn(B, T, O, generator=gen)}


def _reference(cfg, d):
    x, w = d["x"].clone().requires_grad_(True), d["W"].clone().requires_grad_(True)
    y = F.linear(x, w)
    backward(y, d["dy"])
    return {"x": d["x"], "y": y.detach(), "dx": x.grad, "dW": w.grad}


# -- what each rank receives (only what a real TP/SP rank owns) ----------------------------------
def _own_ag(cfg, d, r, t):
    return {"x": shard(d["x"], r, t, 1), "W": shard(d["W"], r, t, 0)}        # (B, T/t, C), (O/t, C)


def _own_rs(cfg, d, r, t):
    return {"x": shard(d["x"], r, t, 2), "W": shard(d["W"], r, t, 1)}        # (B, T, I/t), (O, I/t)


def _own_linear(cfg, d, r, t):
    """The dense weight from_dense is handed, with the other ranks' rows (column) or columns (row) NaN; the
    layer's input block and its block of dY: the sequence in and out-feature columns out for the column layer,
    the mirror image for the row layer (the SP column linear of Task 4 is the column case)."""
    if cfg.get("kind") == "row":
        return {"x": shard(d["x"], r, t, 2), "W": poisoned(d["W"], r, t, 1), "dy": shard(d["dy"], r, t, 1)}
    return {"x": shard(d["x"], r, t, 1), "W": poisoned(d["W"], r, t, 0), "dy": shard(d["dy"], r, t, 2)}


# -- the two ring functions (forward only) --------------------------------------------------------
def _expect_ag(cfg, ref, r, t):
    out = {"y": shard(ref["y"], r, t, 2), "x_full": ref["x"]}
    if t == 2:
        out["same_bits_as_plain"] = torch.tensor([1])
    return out


def _expect_rs(cfg, ref, r, t):
    out = {"y": shard(ref["y"], r, t, 1)}
    if t == 2:
        out["same_bits_as_plain"] = torch.tensor([1])
    return out


def _ring_contract(phases, harness: dict | None = None):
    """One ring per phase; `harness`: the collectives of the grader's own plain version, run after the student's."""
    def contract(cfg, t):
        ring = {"send": t - 1, "recv": t - 1}
        return Contract(counts={**{p: dict(ring) for p in phases}, **({"harness": harness} if harness else {})},
                        why={p: "one ring: t-1 sends and t-1 receives per rank (batch_isend_irecv of one send and "
                                "one recv per step), and no collective." for p in phases})
    return contract


# -- the linears (forward + backward) -------------------------------------------------------------
def _expect_linear(cfg, ref, r, t):
    if cfg["kind"] == "column":
        return {"y": shard(ref["y"], r, t, 2), "dx": shard(ref["dx"], r, t, 1), "dW": shard(ref["dW"], r, t, 0)}
    return {"y": shard(ref["y"], r, t, 1), "dx": shard(ref["dx"], r, t, 2), "dW": shard(ref["dW"], r, t, 1)}


def _linear_contract(cfg, t):
    c = _ring_contract(("forward", "backward"))(cfg, t)
    c.params = {"weight": (cfg["out"] // t, cfg["in"]) if cfg["kind"] == "column" else (cfg["out"], cfg["in"] // t)}
    c.why = {"forward": "one ring (t-1 sends, t-1 receives): AG+GEMM for the column layer, GEMM+RS for the row layer.",
             "backward": "one ring: the backward of AG+GEMM is a GEMM+RS of dX, the backward of GEMM+RS an AG+GEMM "
                         "of dY; dW then needs no communication."}
    return c


def _cfg(**kw):
    d = {"B": 2, "T": 8, "in": 16, "out": 24}
    d.update(kw)
    return d


for name, cfg, seed in [("ag_matmul", _cfg(), 10), ("ag_matmul_hidden", _cfg(B=3, T=12, **{"in": 8, "out": 20}), None)]:
    register(Case(name=f"week06/{name}", module=MODULE, world_sizes=(2, 4), config=cfg, make_inputs=_inputs,
                  reference=_reference, run_rank="run_ag_matmul", expected=_expect_ag,
                  contract=_ring_contract(("forward",), harness={"all_gather": 1}), feedback=("same_bits_as_plain",), seed=seed, hidden=seed is None, title="ring AG+GEMM",
                  rank_inputs=_own_ag,
                  hints=HINTS))
for name, cfg, seed in [("matmul_rs", _cfg(), 11), ("matmul_rs_hidden", _cfg(B=1, T=12, **{"in": 20, "out": 8}), None)]:
    register(Case(name=f"week06/{name}", module=MODULE, world_sizes=(2, 4), config=cfg, make_inputs=_inputs,
                  reference=_reference, run_rank="run_matmul_rs", expected=_expect_rs,
                  contract=_ring_contract(("forward",), harness={"reduce_scatter": 1}), feedback=("same_bits_as_plain",), seed=seed, hidden=seed is None, title="GEMM+ring RS",
                  rank_inputs=_own_rs,
                  hints=HINTS))
for name, cfg, seed in [("column_linear", _cfg(kind="column"), 12), ("row_linear", _cfg(kind="row"), 13),
                        ("column_linear_hidden", _cfg(B=3, T=4, kind="column", **{"in": 12, "out": 8}), None),
                        ("row_linear_hidden", _cfg(B=1, T=12, kind="row", **{"in": 8, "out": 12}), None)]:
    register(Case(name=f"week06/{name}", module=MODULE, world_sizes=(2, 4), config=cfg, make_inputs=_inputs,
                  reference=_reference, run_rank="run_linear", expected=_expect_linear, contract=_linear_contract,
                  seed=seed, hidden=seed is None, rank_inputs=_own_linear, title="overlapped linear", hints=HINTS))


# -- Task 4: the sequence-parallel column linear with Megatron's backward overlap --------------------------
SP_HINTS = dict(HINTS)
SP_HINTS.update({
    "dx": "dX = dY W is a partial sum on every rank (each saw O/t outputs) for all T positions: reduce-scatter it "
          "along T (seq_first, reduce_scatter_single, batch_first) so that rank r keeps block r of the sum.",
    "dW": "dW = dY^T X over all B*T rows needs the whole sequence of X: all-gather x_s again in backward.",
    "bits_y": "1 = the output equals 'all_gather_single, then F.linear(X, weight)' bit for bit. Use exactly that.",
    "bits_dx": "1 = dX equals 'reduce_scatter_single of dy @ weight' bit for bit: moving a wait changes no bits; "
               "computing dX another way (or summing it yourself) can.",
    "bits_dW": "1 = dW equals dy.flatten(0, -2).t() @ X.flatten(0, -2) bit for bit, X the re-gathered input "
               "(another formula, e.g. (X^T dY)^T, may round differently).",
    "overlap_ag": "Codes: 1 = the all-gather of x_s was posted (async_op=True), the dgrad GEMM ran, then it was "
                  "waited (overlapped); 0 = the dgrad GEMM did not run between post and wait (async_op=False, "
                  "wait() right after posting, or dX computed after the wait; another GEMM there does not count); "
                  "2 = never waited; 3 = no all-gather was posted in backward. The dgrad GEMM is recognised by what "
                  "it reads and makes: dy and the weight (or views and copies of them), all of dX (B, T, C) in one "
                  "GEMM, as dy @ weight does.",
    "overlap_rs": "Codes: 1 = the reduce-scatter of dX was posted (async_op=True), the wgrad GEMM ran, then it was "
                  "waited (overlapped); 0 = the wgrad GEMM did not run between post and wait (serialised: post it "
                  "before the dW GEMM, wait after; another GEMM there does not count); 2 = never waited (its result "
                  "may not have arrived); 3 = no reduce-scatter was posted in backward. The wgrad GEMM is recognised "
                  "by what it reads and makes: dy and the X gathered in backward (or views and copies of them), "
                  "all of dW (O/t, C) in one GEMM.",
    "saves_shard_only": "1 = forward kept only x_s (B, T/t, C) for backward; 0 = it kept a tensor the size of the "
                        "gathered X (B, T, C), which the re-gather in backward exists to avoid.",
})


# measured by the rank (the order of its posts, GEMMs and waits; what its autograd kept; bits against the rank's own
# recomputation): feedback. Scored: the values and the switchboard's record of the collectives
SP_COLUMN_INSIDE = ("bits_y", "bits_dx", "bits_dW", "overlap_ag", "overlap_rs", "saves_shard_only")


def _expect_sp_column(cfg, ref, r, t):
    one = torch.tensor([1])
    return {"y": shard(ref["y"], r, t, 2), "dx": shard(ref["dx"], r, t, 1), "dW": shard(ref["dW"], r, t, 0),
            "bits_y": one, "bits_dx": one, "bits_dW": one, "overlap_ag": one, "overlap_rs": one,
            "saves_shard_only": one}


def _sp_column_contract(cfg, t):
    n_x = cfg["B"] * cfg["T"] * cfg["in"] * 4                 # bytes of the gathered X (B, T, C), fp32; dX the same
    ring = (t - 1) / t * n_x
    return Contract(counts={"forward": {"all_gather": 1}, "backward": {"all_gather": 1, "reduce_scatter": 1},
                            "harness": {"all_gather": 1, "reduce_scatter": 1}},   # the plain version, the grader's
                    bytes_sent={"forward": ring, "backward": 2 * ring},
                    params={"weight": (cfg["out"] // t, cfg["in"])},
                    why={"forward": "one all-gather of x along T: the GEMM needs the whole sequence.",
                         "backward": "forward kept only x_s, so dW needs X gathered again (one all-gather); dX is a "
                                     "partial sum over ranks of which rank r keeps block r (one reduce-scatter)."})


for name, cfg, seed in [("sp_column_backward", _cfg(), 14),
                        ("sp_column_backward_hidden", _cfg(B=3, T=4, **{"in": 12, "out": 8}), None)]:
    register(Case(name=f"week06/{name}", module=MODULE, world_sizes=(2, 4), config=cfg, make_inputs=_inputs,
                  reference=_reference, run_rank="run_sp_column", expected=_expect_sp_column, feedback=SP_COLUMN_INSIDE,
                  contract=_sp_column_contract, seed=seed, hidden=seed is None, rank_inputs=_own_linear,
                  title="SP column linear, backward overlap", hints=SP_HINTS))
