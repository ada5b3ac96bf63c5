"""Week 10: context parallelism (ring attention, Liu et al. 2023; DeepSpeed-Ulysses, Jacobs et al. 2023), t = 2, 4.

q, k, v, dy are (B, nh, T, hs); the sequence is dim 2; causal attention with scale 1/sqrt(hs). The reference is
dense causal attention (a masked softmax through autograd) on the full tensors, in the trusted process.
- ring_forward / ring_attention: rank r receives ONLY its two mirrored chunks r and 2t-1-r (of 2t) of q, k, v and
  dy (`rank_inputs`); it returns its two chunks of the output and of dq, dk, dv. Forward: t-1 ring passes of the
  K/V (send to r+1, receive from r-1); backward: t-1 passes of K/V and t of the travelling dK/dV. Bytes are
  exact; the number of messages per pass is free (K and V stacked into one, or two).
- ulysses: rank r receives the contiguous block r of q, k, v, dy; all-to-alls only: forward q, k, v to head shards
  (three, or one stacked) and the output back, backward the reverse of each; bytes exact.
- ulysses_divisibility: heads not divisible by t -> ValueError, before any collective.
Hidden variants: sequence lengths divisible by 2t but not powers of two (24, 40), 3 heads. Every case, public ones
too, draws its seed fresh at grading.

Scored: values against the trusted reference and the switchboard's record of the collectives. "note (inside the
rank, not scored)" marks what the harness measures in the student's process: said beside the verdict, no points.
Such notes everywhere: ctx.hand (an input written into) and a replaced harness function (grader/rank/seal.py).
Rules the lab's text states -> the check that enforces it (case: tensor or contract field):
 1. block_forward returns the block's softmax output and row log-sum-exp, the diagonal block masked causally
    -> ring_forward: `y` (fixture diag_unmasked)
 2. merge: l = logaddexp(l1, l2), o = e^{l1-l} o1 + e^{l2-l} o2 (exact) -> `y` (fixture merge_no_rescale)
 3. rank r holds chunks r and 2t-1-r; against rank src's chunks: earlier chunk full, same chunk causal, later
    chunk skipped -> `y`, `dq`, `dk`, `dv` (fixture contiguous_pairs)
 4. step s holds the K/V of rank (r-s) mod t: send to r+1, receive from r-1 -> `y` (a direction that does not
    match the source rank pairs the wrong chunks; a ring run consistently the other way is as correct and passes:
    fixture independent_reversed_ring_fused_qkv)
 5. only send/recv (or batch_isend_irecv), never an all-gather of K/V -> Contract.allowed_ops {send, recv}
    (fixture allgather_kv)
 6. forward: t-1 ring passes of the K/V (stacked, or k and v as two messages) -> bytes_sent forward (exact), and
    "all" (nothing sent in any other phase) (fixture extra_forward_pass)
 7. a rank's inputs are only its own chunks -> rank_inputs (rank r never receives another rank's K/V)
 8. save for backward only this rank's q, k, v, output and lse -> ring_attention, note (inside the rank, not scored):
    `SAVED` (fixture saves_all_kv: full marks, with the note)
 9. backward: dq stays; dK/dV accumulate in a buffer that travels with the K/V, one pass per step, the last one
    home to the owner -> `dq`, `dk`, `dv`, bytes_sent backward = (2t-1) K/V sizes (fixture no_final_dkv_pass;
    fixture independent_separate_kv: k and v as separate isend/irecv, another exact merge: full marks)
10. ulysses_attention: all-to-all from sequence shards to head shards, dense causal attention on the head group,
    all-to-all back -> ulysses: `y`, `dq`, `dk`, `dv` (fixture ulysses_wrong_split), allowed_ops {all_to_all},
    bytes_sent each way = 4 (t-1)/t local tensors (q, k, v as three all-to-alls or one stacked: fixture
    independent_reversed_ring_fused_qkv, which also runs the ring the other way round: full marks)
11. heads not divisible by t -> ValueError -> ulysses_divisibility (fixture no_divisibility_check)
Course-wide rule: code may not write into the tensors it is given -> note (inside the rank, not scored): ctx.hand on
q, k, v.
"""
from __future__ import annotations

import torch

from grader.judge.case import Case, Contract, register
from grader.rank.week10 import DIVISIBLE, SAVED
from reference import backward
from reference.context_parallel import causal_attention, shard_seq

MODULE = "cp_attention"
LAYOUT = ("Rank r holds chunks r and 2t-1-r of 2t (torch.chunk(2t) along dim 2), concatenated. Against rank src's "
          "chunks (src, 2t-1-src): an earlier chunk is a full block, the same chunk a causal block (mask j > i), a "
          "later chunk is skipped. At step s you hold the K/V of rank (r - s) mod t.")
MERGE = ("Merging two partial results: l = logaddexp(l1, l2), o = exp(l1 - l) o1 + exp(l2 - l) o2; both terms "
         "rescaled. lse is logsumexp of the block's scores (already scaled by 1/sqrt(hs)).")
HINTS = {
    "y": MERGE + " " + LAYOUT,
    "dq": "dQ stays on this rank: the sum of the block grads over all t steps. " + LAYOUT,
    "dk": "dK of a block is a sum over EVERY rank's queries: accumulate it in a buffer that travels with the K/V "
          "(one ring_pass per step) and pass it once more after the last step: it then reaches the block's owner.",
    "dv": "dV = P^T dO summed over every rank's queries: it travels with dK (the same stacked buffer).",
    SAVED: "Autograd may keep only this rank's q, k, v, output and log-sum-exp: the backward ring brings the K/V "
           "round again. Keeping the received K/V blocks costs the whole K/V on every rank, what CP is meant to avoid.",
}
U_HINTS = {n: "Ulysses: all_to_all_single splits dim 0: reshape (B, nh, T/t, hs) to (B, t, nh/t, T/t, hs), move the "
              "t groups of heads to the front, exchange, and put the received sequence blocks in rank order along T. "
              "The output goes back with the inverse; in backward each all-to-all's adjoint is the reverse one."
           for n in ("y", "dq", "dk", "dv")}


def _inputs(cfg, gen):
    shape = (cfg["B"], cfg["nh"], cfg["T"], cfg["hs"])
    return {n: torch.randn(*shape, generator=gen) for n in ("q", "k", "v", "dy")}


def _reference(cfg, d):
    q, k, v = (d[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
    y = causal_attention(q, k, v)
    backward(y, d["dy"])
    return {"y": y.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _balanced(cfg) -> bool:
    return cfg["variant"] == "ring"


def _rank_inputs(cfg, d, r, t):
    return {n: shard_seq(x, r, t, _balanced(cfg)) for n, x in d.items()}


def _expected(cfg, ref, r, t):
    keys = ("y", "dq", "dk", "dv") if cfg["backward"] else ("y",)
    out = {n: shard_seq(ref[n], r, t, _balanced(cfg)) for n in keys}
    if cfg["variant"] == "ring" and cfg["backward"]:
        out[SAVED] = torch.tensor(1)
    return out


def _contract(cfg, t):
    local = cfg["B"] * cfg["nh"] * cfg["T"] // t * cfg["hs"] * 4          # one (B, nh, T/t, hs) float32, bytes
    if cfg["variant"] == "ulysses":
        a2a = 4 * (t - 1) / t * local                                     # (t-1)/t of each tensor leaves the rank
        # bytes, not counts: q, k, v may go as three all-to-alls or one of the three stacked; the bytes are the same
        return Contract(allowed_ops={"all_to_all"}, bytes_sent={"forward": a2a, "backward": a2a, "all": 2 * a2a},
                        why={"forward": "q, k and v go from sequence to head shards and the output back: (t-1)/t of "
                                        "four local tensors leave the rank.",
                             "backward": "the adjoint of each all-to-all is the reverse all-to-all: dy to head "
                                         "shards, then dq, dk, dv back to sequence shards.",
                             "all": "the total of forward and backward: nothing may be sent outside them."})
    # bytes, not message counts: K and V may travel stacked (one send per step) or as two sends; either way a
    # step moves exactly one rank's K/V (and, in backward, one dK/dV buffer) to the next rank
    sent = {"forward": (t - 1) * 2 * local}
    if cfg["backward"]:
        sent["backward"] = (2 * t - 1) * 2 * local
    sent["all"] = sum(sent.values())                                      # and nothing in any other phase
    why = {"forward": "t-1 ring passes of this rank's (B, nh, T/t, hs) K and V to rank r+1 (stacked or as two "
                      "messages): the last step needs no pass.",
           "backward": "t-1 passes of the K/V (as forward) and t of the dK/dV that travel with them: the last pass "
                       "brings each block's summed grads home to its owner."}
    why["all"] = "the total of the phases above: nothing may be sent outside forward and backward."
    return Contract(allowed_ops={"send", "recv"}, bytes_sent=sent, why=why)


BASE = {"B": 2, "nh": 2, "T": 16, "hs": 8}
HIDDEN = {"B": 1, "nh": 3, "T": 24, "hs": 8}
for name, cfg, seed in [
        ("ring_forward", dict(BASE, variant="ring", backward=False), 10),
        ("ring_forward_hidden", dict(HIDDEN, variant="ring", backward=False), None),
        ("ring_attention", dict(BASE, T=32, variant="ring", backward=True), 11),
        ("ring_attention_hidden", dict(HIDDEN, T=40, variant="ring", backward=True), None),
        ("ulysses", dict(BASE, nh=4, variant="ulysses", backward=True), 12),
        ("ulysses_hidden", dict(HIDDEN, B=2, nh=8, T=40, variant="ulysses", backward=True), None)]:
    register(Case(name=f"week10/{name}", module=MODULE, world_sizes=(2, 4), config=cfg, make_inputs=_inputs,
                  reference=_reference, rank_inputs=_rank_inputs,
                  run_rank="run_ring" if cfg["variant"] == "ring" else "run_ulysses", expected=_expected,
                  contract=_contract, seed=seed, hidden=seed is None, feedback=(SAVED,),
                  title="RingAttention" if cfg["variant"] == "ring" else "ulysses_attention",
                  hints=HINTS if cfg["variant"] == "ring" else U_HINTS))

register(Case(name="week10/ulysses_divisibility", module=MODULE, world_sizes=(2, 4), config={},
              make_inputs=lambda cfg, gen: {"unused": torch.zeros(1)}, reference=lambda cfg, inp: {},
              rank_inputs=lambda cfg, d, r, t: {}, run_rank="run_divisibility",
              expected=lambda cfg, ref, r, t: {DIVISIBLE: torch.tensor(1)},
              contract=lambda cfg, t: Contract(allowed_ops=set()), seed=13, title="ulysses_attention divisibility",
              hints={DIVISIBLE: "The task: raise ValueError (naming the head count and t) when nh % t != 0, before "
                                "any all-to-all: a head cannot be split across ranks."}))
