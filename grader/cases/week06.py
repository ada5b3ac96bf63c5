"""Week 6: overlapped (ring) AG+GEMM and GEMM+RS, and the column/row linears built on them; t = 2 and 4.

Correctness is graded (dense reference at atol=1e-3, plus bit-exactness vs the non-overlapped version
where the algorithm allows); overlap is not: it is a timing, reported by `tpkit.timeline.overlap_efficiency`.

Bit-exactness ("same_bits_as_plain"): the harness recomputes the non-overlapped version on the rank, in a
phase the contract ignores: all-gather then F.linear on each contiguous (B, T/t, C) block; or F.linear per
block then reduce_scatter. The ring AG moves bytes and never adds, so its GEMMs see identical inputs: equal
bits in exact arithmetic. The ring RS adds the partial sums in ring order; reduce_scatter (gloo emulates it
with an all-reduce) adds them in its own order. Two terms commute exactly (a + b == b + a), so equal bits at
t = 2; at t = 4 the order, and so the rounding, differs. A second exception is the CPU BLAS itself: the same
(2, 2, 16) GEMM on the same values gives different last bits when its input starts 4 bytes off a 16-byte
boundary (measured, torch 2.13 CPU), and at t = 4 the AG check also differed in our runs. So bits are graded
at t = 2 (where they held in every run) and only atol=1e-3 applies at t = 4.

Rules the lab's text states -> the check that enforces it (case: tensor or contract field):
 1. ring_all_gather_matmul returns Y = AllGather(x) W^T (B, T, O) and the gathered x -> ag_matmul: `y`, `x_full`
 2. at step k rank r holds the block of rank (r - k) mod t -> ag_matmul at t=4: `y` (fixture wrong_chunk_order)
 3. two buffers of its own, used in turn (never the caller's x_s) -> ctx.hand("x_s"), ctx.hand("weight")
    (fixture receives_into_input)
 4. matmul_reduce_scatter returns this rank's block of the sum (B, T/t, O) -> matmul_rs: `y`
 5. per ring t-1 sends and t-1 receives, no collective -> every case: Contract.counts
 6. the forward equals the non-overlapped version bit for bit (at t = 2, see above) -> ag_matmul, matmul_rs:
    `same_bits_as_plain`
 7. the column linear keeps rows r*O/t:(r+1)*O/t; forward ring AG+GEMM, backward GEMM+RS for dX and dW from the
    gathered X -> column_linear: Contract.params, counts forward/backward (one ring each), `y`, `dx`, `dW`
 8. the row linear keeps that block of columns; forward GEMM+RS, backward ring AG+GEMM of dY -> row_linear: the same
8 rules stated; 8 checked before this issue, 8 checked now.
Stated by the lab as reported, not graded: the overlap itself (post step k+1 before the GEMM of step k, wait
after it). Timing on a shared CPU is not a fair grade; the ungraded cell reports it (fixture serialized_overlap
passes by design). "No bias" is the lab's scope, not a rule.
Course-wide rule (not in this lab's text): code may not write into the tensors it is given -> the ring functions'
inputs (before) and now also the linears' dense weight and input: ctx.hand.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from grader.case import Case, Contract, register

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
    y.backward(d["dy"])
    return {"x": d["x"], "y": y.detach(), "dx": x.grad, "dW": w.grad}


def _shard(t, r, n, dim):
    return t.chunk(n, dim=dim)[r].contiguous()


# -- the two ring functions (forward only) --------------------------------------------------------
def _expect_ag(cfg, ref, r, t):
    out = {"y": _shard(ref["y"], r, t, 2), "x_full": ref["x"]}
    if t == 2:
        out["same_bits_as_plain"] = torch.tensor([1])
    return out


def _expect_rs(cfg, ref, r, t):
    out = {"y": _shard(ref["y"], r, t, 1)}
    if t == 2:
        out["same_bits_as_plain"] = torch.tensor([1])
    return out


def _ring_contract(phases):
    def contract(cfg, t):
        ring = {"send": t - 1, "recv": t - 1}
        return Contract(counts={p: dict(ring) for p in phases},
                        why={p: "one ring: t-1 sends and t-1 receives per rank (batch_isend_irecv of one send and "
                                "one recv per step), and no collective." for p in phases})
    return contract


# -- the linears (forward + backward) -------------------------------------------------------------
def _expect_linear(cfg, ref, r, t):
    if cfg["kind"] == "column":
        return {"y": _shard(ref["y"], r, t, 2), "dx": _shard(ref["dx"], r, t, 1), "dW": _shard(ref["dW"], r, t, 0)}
    return {"y": _shard(ref["y"], r, t, 1), "dx": _shard(ref["dx"], r, t, 2), "dW": _shard(ref["dW"], r, t, 1)}


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
                  contract=_ring_contract(("forward",)), seed=seed, hidden=seed is None, title="ring AG+GEMM",
                  hints=HINTS))
for name, cfg, seed in [("matmul_rs", _cfg(), 11), ("matmul_rs_hidden", _cfg(B=1, T=12, **{"in": 20, "out": 8}), None)]:
    register(Case(name=f"week06/{name}", module=MODULE, world_sizes=(2, 4), config=cfg, make_inputs=_inputs,
                  reference=_reference, run_rank="run_matmul_rs", expected=_expect_rs,
                  contract=_ring_contract(("forward",)), seed=seed, hidden=seed is None, title="GEMM+ring RS",
                  hints=HINTS))
for name, cfg, seed in [("column_linear", _cfg(kind="column"), 12), ("row_linear", _cfg(kind="row"), 13),
                        ("column_linear_hidden", _cfg(B=3, T=4, kind="column", **{"in": 12, "out": 8}), None),
                        ("row_linear_hidden", _cfg(B=1, T=12, kind="row", **{"in": 8, "out": 12}), None)]:
    register(Case(name=f"week06/{name}", module=MODULE, world_sizes=(2, 4), config=cfg, make_inputs=_inputs,
                  reference=_reference, run_rank="run_linear", expected=_expect_linear, contract=_linear_contract,
                  seed=seed, hidden=seed is None, title="overlapped linear", hints=HINTS))
