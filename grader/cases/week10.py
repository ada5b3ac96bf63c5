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
- packed_documents: a packed sequence of 2 to 4 documents (lengths multiples of 8 = 2t at t = 4, drawn with the
  inputs); rank r receives its tokens of q, k, v, dy (chunks r and 2t-1-r of every document, in document order)
  and cu_seqlens (the batch's document boundaries: every CP rank has them, they name no other rank's data).
- dp_cp_gradients: 4 ranks as (dp, cp) = (2, 2), rank = d * 2 + r: rank (d, r) receives its per-document tokens of
  sequence d (x, dy: (1, T/2, h)), the batch's cu_seqlens and the replicated weights W_q, W_k, W_v, W_o (h, h);
  it returns the four weight gradients after the student's reduction. Uses the student's DocRingAttention.
Hidden variants: sequence lengths divisible by 2t but not powers of two (24, 40), 3 heads; packings of 96 tokens. Every case, public ones
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
12. packed documents: query i sees key j iff same document and j <= i -> packed_documents: `y`, `dq`, `dk`, `dv`
    against dense attention with the block-diagonal causal mask (fixture doc_mask_ignores_documents)
13. every document cut into 2t chunks, rank r holds chunks r and 2t-1-r of each (doc_positions) -> `y`, `dq`,
    `dk`, `dv`: rank r receives its tokens in that order, a mask from other positions is wrong (fixture
    whole_sequence_chunks); the ring's passes and bytes as in rules 5, 6 and 9 -> the ring's Contract
14. CP beside DP: weight gradients are summed over the dp x cp ranks that hold the same weights -> dp_cp_gradients:
    `dW_q`, `dW_k`, `dW_v`, `dW_o` on every rank against the whole batch's gradient (fixtures grad_group_dp_only,
    grad_group_cp_only)
Course-wide rule: code may not write into the tensors it is given -> note (inside the rank, not scored): ctx.hand on
q, k, v.
"""
from __future__ import annotations

import torch

from grader.judge.case import Case, Contract, register
from grader.rank.week10 import DIVISIBLE, SAVED
from reference import backward
from reference.context_parallel import causal_attention, document_causal_attention, shard_docs, shard_seq

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

DOC_HINTS = {
    "y": "Query i sees key j only if both are in the same document (cu_seqlens[d] <= pos < cu_seqlens[d+1]) and "
         "j <= i, with i and j GLOBAL positions. Rank r's tokens are chunks r and 2t-1-r of EVERY document (each "
         "document cut into 2t chunks), document after document, not chunks of the whole sequence.",
    "dq": "The backward masks must be the forward's: document_mask(my positions, the source rank's positions).",
    "dk": "dK/dV travel with the K/V as in Task 2 (t passes, the last one home); the masks as in forward.",
    "dv": "dV = P^T dO with the document mask: masked pairs have P = 0."}


def _doc_inputs(cfg, gen):
    """q, k, v, dy and cu_seqlens of 2 to 4 documents, each length a multiple of 8 (2t for t = 2 and 4)."""
    n_docs = int(torch.randint(2, 5, (1,), generator=gen))
    cuts = (torch.randperm(cfg["T"] // 8 - 1, generator=gen)[:n_docs - 1] + 1).sort().values * 8
    return {**_inputs(cfg, gen), "cu_seqlens": torch.cat([torch.tensor([0]), cuts, torch.tensor([cfg["T"]])])}


def _doc_reference(cfg, d):
    q, k, v = (d[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
    y = document_causal_attention(q, k, v, d["cu_seqlens"])
    backward(y, d["dy"])
    return {"y": y.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "cu_seqlens": d["cu_seqlens"]}


for name, cfg, seed in [("packed_documents", dict(BASE, B=1, T=64, variant="ring", backward=True), 14),
                        ("packed_documents_hidden", dict(HIDDEN, B=2, T=96, variant="ring", backward=True), None)]:
    register(Case(name=f"week10/{name}", module=MODULE, world_sizes=(2, 4), config=cfg, make_inputs=_doc_inputs,
                  reference=_doc_reference, run_rank="run_packed",
                  rank_inputs=lambda cfg, d, r, t: {**{n: shard_docs(d[n], d["cu_seqlens"], r, t)
                                                       for n in ("q", "k", "v", "dy")}, "cu_seqlens": d["cu_seqlens"]},
                  expected=lambda cfg, ref, r, t: {n: shard_docs(ref[n], ref["cu_seqlens"], r, t)
                                                   for n in ("y", "dq", "dk", "dv")},
                  contract=_contract, seed=seed, hidden=seed is None, title="DocRingAttention (packed documents)",
                  hints=DOC_HINTS))

GRAD_HINTS = {f"dW_{n}": "CP ranks hold the same weights as their DP peers and see other tokens of the same sequence: "
                          "each rank's weight gradient is a partial sum over its own tokens, to be summed over dp x cp "
                          "(all the ranks holding the same weights), not over dp alone (or cp alone). If Task 4 "
                          "fails, fix it first: the layer runs your DocRingAttention over your CP group."
              for n in "qkvo"}


def _mesh_inputs(cfg, gen):
    """dp sequences x, dy (dp, T, h) sharing one packing cu_seqlens (document lengths multiples of 2 cp), and W."""
    dp, T, h, unit = cfg["dp"], cfg["T"], cfg["h"], 2 * cfg["cp"]
    cuts = (torch.randperm(T // unit - 1, generator=gen)[:int(torch.randint(1, 3, (1,), generator=gen))] + 1)
    out = {"x": torch.randn(dp, T, h, generator=gen), "dy": torch.randn(dp, T, h, generator=gen),
           "cu_seqlens": torch.cat([torch.tensor([0]), cuts.sort().values * unit, torch.tensor([T])])}
    return {**out, **{f"W_{n}": torch.randn(h, h, generator=gen) / h ** 0.5 for n in "qkvo"}}


def _mesh_reference(cfg, d):
    """The layer on one device over the whole batch, its loss a sum over every token: the weight gradients."""
    W = {n: d[f"W_{n}"].clone().requires_grad_(True) for n in "qkvo"}
    heads = lambda y: y.unflatten(-1, (cfg["nh"], -1)).transpose(1, 2)   # (dp, nh, T, hs)
    o = document_causal_attention(*(heads(d["x"] @ W[n]) for n in "qkv"), d["cu_seqlens"])
    backward(o.transpose(1, 2).flatten(2) @ W["o"], d["dy"])
    return {f"dW_{n}": W[n].grad for n in "qkvo"}


def _mesh_rank_inputs(cfg, d, rank, t):
    dp_rank, r = divmod(rank, cfg["cp"])
    mine = lambda y: shard_docs(y[dp_rank:dp_rank + 1].unsqueeze(1), d["cu_seqlens"], r, cfg["cp"]).squeeze(1)
    return {"x": mine(d["x"]), "dy": mine(d["dy"]), "cu_seqlens": d["cu_seqlens"],
            **{f"W_{n}": d[f"W_{n}"] for n in "qkvo"}}


for name, cfg, seed in [("dp_cp_gradients", {"dp": 2, "cp": 2, "T": 32, "h": 8, "nh": 2}, 15),
                        ("dp_cp_gradients_hidden", {"dp": 2, "cp": 2, "T": 48, "h": 12, "nh": 3}, None)]:
    register(Case(name=f"week10/{name}", module=MODULE, world_sizes=(4,), config=cfg, make_inputs=_mesh_inputs,
                  reference=_mesh_reference, rank_inputs=_mesh_rank_inputs, run_rank="run_dp_cp",
                  expected=lambda cfg, ref, r, t: ref, seed=seed, hidden=seed is None,
                  title="mesh_groups + sync_weight_grads (dp x cp)", hints=GRAD_HINTS))

register(Case(name="week10/ulysses_divisibility", module=MODULE, world_sizes=(2, 4), config={},
              make_inputs=lambda cfg, gen: {"unused": torch.zeros(1)}, reference=lambda cfg, inp: {},
              rank_inputs=lambda cfg, d, r, t: {}, run_rank="run_divisibility",
              expected=lambda cfg, ref, r, t: {DIVISIBLE: torch.tensor(1)},
              contract=lambda cfg, t: Contract(allowed_ops=set()), seed=13, title="ulysses_attention divisibility",
              hints={DIVISIBLE: "The task: raise ValueError (naming the head count and t) when nh % t != 0, before "
                                "any all-to-all: a head cannot be split across ranks."}))
