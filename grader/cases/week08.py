"""Week 8: a generalized-TP / ZeRO-3 style linear chain with a one-ahead prefetch, on t = 2 and 4.

Each rank stores W_i[r] = the r-th block of rows (out_features) of every weight and processes its own
micro-batch (rank r takes rows r*N/t.. of x). Forward of layer i: all-gather W_i just before its GEMM
while the gather of W_{i+1} is already in flight; backward of layer i: all-gather W_i again (W_{i-1}
prefetched), dX = dY W_i locally, dW_i = dY^T X summed over ranks *and* split by rows with one
reduce-scatter. So per step: L all-gathers forward, L all-gathers + L reduce-scatters backward, each
of (t-1)/t of the full weight per rank, and at most two full weights alive at once. Task 3 (overlap*) keeps all
of that and moves only the waits: layer i's reduce-scatter is launched async after its dX and dW GEMMs and
waited by layer i-1's backward after *its* GEMMs (GTP's one-step-deferred finalize), layer 0's by finalize_grads().

What each rank receives (`_own`, Case.rank_inputs): its micro-batch of x and dY (rows r*N/t..), its rows of the
pre-seeded grads (Task 3), and the dense weights from_dense is handed with every other rank's rows NaN: a full
weight exists on a rank only as the result of its all-gather (fixture dense_weights_kept: a forward GEMM with the
kept dense weight instead of the gathered one now gives NaN).

Scored: values against the trusted reference and the switchboard's record of the collectives. "note (inside the
rank, not scored)" marks what the harness measures in the student's process: said beside the verdict, no points.
Such notes everywhere: Contract.params (the names and shapes a rank reports; a rank keeping more than its shard is
caught by its values, as it receives only its own part of every dense tensor, the rest NaN), ctx.hand (an input
written into) and a replaced harness function (grader/rank/seal.py).
Rules the lab's text states -> the check that enforces it (case: tensor or contract field):
 1. each rank stores 1/t of every weight, a block of output rows -> `dW{i}` rows; Contract.params `shards.i` (note)
 2. start(i) gathers into one full buffer, rank r's rows in block r -> forward*, chain*: `y`
 3. a weight is whole only around its GEMM, wait(i) forgets it so the buffer dies: the most full weights alive at
    once is 2 (the one in use, the one in flight) -> note (inside the rank, not scored): `peak_gathered_weights`
    (fixtures gather_all_upfront: 4, no_prefetch: 1; both full marks, with the note)
 4. forward: wait for weight i, start weight i+1 BEFORE the GEMM -> note (inside the rank, not scored): `at each
    forward GEMM: later weights already being gathered (1 = the next one)` (new: a dispatch mode sees gathers and
    GEMMs in order; fixture prefetch_after_gemm, whose peak is still 2)
 5. save only x for backward, never a full weight -> note (inside the rank, not scored):
    `full_weights_saved_for_backward`; a kept weight skips the backward re-gather, which rule 8's count scores
    (fixture keep_weight_for_backward fails there)
 6. a GELU between layers, none after the last -> `y`
 7. backward: wait for weight i (the last one cold), start weight i-1 before dX = dY W_i -> chain*, note (inside the
    rank, not scored): `at each backward GEMM: earlier weights already being gathered (1 = the previous one)` (new;
    fixture backward_no_prefetch, whose peak is still 2 from the forward)
 8. dX = dY W_i with the re-gathered weight -> chain*: `dx`, counts backward {all_gather: L}
 9. dW_i = dY^T X, summed over ranks and split by rows with one reduce-scatter -> chain*: `dW{i}`, counts backward
    {reduce_scatter: L} and no all-reduce (fixture grads_all_reduced)
10. one all-gather per weight per direction -> Contract.counts forward {all_gather: L} (and backward, rule 8)
11. the bytes each rank sends -> Contract.bytes_sent forward and backward
Task 3 (cases overlap*, run_overlap: GTPChainOverlap, then finalize_grads() inside the backward phase; rules 1-11
are checked there too, through the same fields):
12. launch(i, dw_full) starts dist.reduce_scatter_single(..., async_op=True) (or its deprecated name
    reduce_scatter_tensor: the same op) into an (out_i/t, in_i) result and keeps (result, dw_full, Work) pending;
    finalize(i) waits for that Work and adds the result to shards[i].grad (or sets it when None) -> overlap*:
    `dW{i}`, counts backward {reduce_scatter: L}, bytes; "adds": layers 0, 2, .. start with a known .grad
    (inputs G{i}, added to the expected grads), the others with None (fixtures grad_assigned, grad_add_only;
    new in issue 23)
13. backward of layer i: dX, then dW, then launch RS(dW_i), then finalize(i+1): at every backward dX GEMM and every dW
    GEMM but the first layer's, exactly the later layer's reduce-scatter is launched and not yet waited -> note
    (inside the rank, not scored; the checker cannot score the order from outside the rank yet): `at each backward dX
    GEMM: ...` and `at each backward dW GEMM, last layer first: ...` = [0, 1, ..., 1] (a dispatch mode sees each
    reduce-scatter's launch, and a wrapper of Work.wait sees its wait, matched by the Work's identity; the dW GEMM is
    the one that reads all of the layer's input x_i, named at its forward GEMM, or a view or copy of it, and makes the
    whole (out_i, in_i) grad; fixtures, full marks with the note: rs_waited_at_launch: all 0, rs_finalized_at_end: 0,
    1, 2, 3, finalize_before_dw: 1 at dX, 0 at dW (the dW count is new in issue 23); independent_overlap: a correct
    Task 3 written differently, full marks)
14. finalize_grads() waits for whatever is still pending (layer 0's): no reduce-scatter left unwaited -> `dW0` (an
    unwaited result never reaches .grad); `weight-grad reduce-scatters never waited` = 0: note (inside the rank, not
    scored)
14 rules stated; 9 checked before this issue (4 and 7 were not), 11 checked after it; 14 with Task 3 (12-14 new).
Scored now (values and the switchboard's counts and bytes per phase): 1, 2, 6, 8-12 and 14; notes (inside the rank,
not scored): 3, 4, 5, 7 and 13.
Course-wide rule, stated in the lab's introduction since issue 25: code may not write into the tensors it is given ->
note (inside the rank, not scored): ctx.hand on the dense weights handed to from_dense and the micro-batch.
"""
from __future__ import annotations

import math

import torch

from grader.judge.case import Case, Contract, poisoned, register, shard
from grader.rank.week08 import BWD_AHEAD, FWD_AHEAD, RS_INFLIGHT, RS_INFLIGHT_DW, RS_UNWAITED
from reference import backward

MODULE = "gtp_linear"
# measured by the rank (live Python objects, the order of its launches, GEMMs and waits): feedback, never scored.
# Scored: the values and the switchboard's record of the collectives (counts and bytes per phase)
INSIDE = ("peak_gathered_weights", "full_weights_saved_for_backward", FWD_AHEAD, BWD_AHEAD, RS_INFLIGHT,
          RS_INFLIGHT_DW, RS_UNWAITED)


def _inputs(cfg, gen):
    dims, N = cfg["dims"], cfg["N"]
    d = {"x": torch.randn(N, dims[0], generator=gen), "dy": torch.randn(N, dims[-1], generator=gen)}
    for i in range(len(dims) - 1):
        d[f"W{i}"] = torch.randn(dims[i + 1], dims[i], generator=gen) / math.sqrt(dims[i])
    if cfg.get("overlap"):      # the grads layers 0, 2, .. hold before backward: finalize must add to them
        for i in range(0, len(dims) - 1, 2):
            d[f"G{i}"] = torch.randn(dims[i + 1], dims[i], generator=gen)
    return d


def _own(cfg, d, r, t):
    """Its micro-batch of x and dY, its rows of the pre-seeded grads, and the dense weights from_dense is handed with
    the other ranks' rows NaN: a ZeRO-3 rank stores only its rows, and every other row must come by all-gather."""
    return {k: poisoned(v, r, t, 0) if k.startswith("W") else shard(v, r, t, 0) for k, v in d.items()}   # x, dy, G*


def _weights(cfg, inp):
    return [inp[f"W{i}"] for i in range(len(cfg["dims"]) - 1)]


def _reference(cfg, inp):
    """The dense chain on the whole batch: y = W_{L-1} gelu(... gelu(W_0 x))."""
    ws = [w.clone().requires_grad_(True) for w in _weights(cfg, inp)]
    x = inp["x"].clone().requires_grad_(True)
    h = x
    for i, w in enumerate(ws):
        h = h @ w.T
        if i < len(ws) - 1:
            h = torch.nn.functional.gelu(h)
    backward(h, inp["dy"])
    out = {"y": h.detach(), "dx": x.grad}
    out.update({f"dW{i}": w.grad + inp.get(f"G{i}", 0) for i, w in enumerate(ws)})   # plus any pre-seeded grad
    return out


def _expected(cfg, ref, r, t):
    L = len(cfg["dims"]) - 1
    ahead = torch.tensor([1] * (L - 1) + [0], dtype=torch.int64)     # the next weight in flight; none after the last
    out = {"y": shard(ref["y"], r, t, 0), "peak_gathered_weights": torch.tensor(2.0),
           "full_weights_saved_for_backward": torch.tensor(0.0), FWD_AHEAD: ahead}
    if cfg.get("overlap"):   # listed before the grads: an unwaited reduce-scatter also garbles them
        # backward runs layers L-1..0: at layer L-1's dX GEMM nothing is launched yet; at layer i's, the
        # reduce-scatter of layer i+1 is in flight (finalised after this GEMM); all are waited in the end
        out[RS_INFLIGHT] = torch.tensor([0] + [1] * (L - 1), dtype=torch.int64)
        out[RS_INFLIGHT_DW] = torch.tensor([0] + [1] * (L - 1), dtype=torch.int64)
        out[RS_UNWAITED] = torch.tensor(0.0)
    if cfg["backward"]:
        out[BWD_AHEAD] = ahead
        out["dx"] = shard(ref["dx"], r, t, 0)
        for i in range(len(cfg["dims"]) - 1):
            out[f"dW{i}"] = shard(ref[f"dW{i}"], r, t, 0)   # this rank's rows of the summed grad
    return out


def _contract(cfg, t):
    dims = cfg["dims"]
    L = len(dims) - 1
    full_bytes = sum(4 * dims[i + 1] * dims[i] for i in range(L))
    ag = (t - 1) / t * full_bytes
    counts = {"forward": {"all_gather": L}}
    sent = {"forward": ag}
    why = {"forward": f"one all-gather per weight ({L} weights), just before its GEMM; nothing else: the "
                      f"activations never leave the rank."}
    if cfg["backward"]:
        counts["backward"] = {"all_gather": L, "reduce_scatter": L}
        sent["backward"] = 2 * ag
        why["backward"] = (f"each weight is gathered again for dX = dY W ({L} all-gathers; the forward copy was "
                           f"freed) and its full weight grad is summed over ranks and split by rows with one "
                           f"reduce-scatter ({L}); an all-reduce would send twice the bytes and keep a full grad.")
        if cfg.get("overlap"):
            why["backward"] += (" Deferring the wait changes when each reduce-scatter finishes, not how many there "
                                "are: finalize_grads() waits, it launches nothing.")
    params = {f"shards.{i}": (dims[i + 1] // t, dims[i]) for i in range(L)}
    return Contract(counts=counts, bytes_sent=sent, params=params, why=why)


HINTS = {
    "peak_gathered_weights": ("The most full weights alive at once on a rank, measured at every all-gather: 2 = the "
                              "one in use + the one being prefetched. More means gathered weights are kept alive "
                              "(gathered up front, cached in a list, or stored on ctx); 1 means nothing is "
                              "prefetched (start the next gather before this GEMM)."),
    "full_weights_saved_for_backward": ("A gathered full weight was saved for backward (ctx.save_for_backward): "
                                        "save only the input x and gather the weight again in backward."),
    "y": "Rank r computes its own micro-batch with the full weight: check the gather order (rank r's shard "
         "lands in rows r*out/t..) and the GELU between layers (none after the last).",
    "dx": "dX = dY W_i with the full (re-gathered) weight; no collective on activations.",
    FWD_AHEAD: ("In forward, start the gather of weight i+1 BEFORE the GEMM of weight i (wait(i), start(i+1), then "
                "x @ w.T), so it travels while the GEMM runs: 1 at every weight but the last. 0 means the next gather "
                "starts after the GEMM (or only when it is needed); more than 1 means weights are gathered too early. "
                "(The GEMM is recognised by reading the gathered buffer itself, or a view of it such as w.T.)"),
    BWD_AHEAD: ("In backward (layers in reverse), start the gather of weight i-1 right after wait(i), BEFORE dX = dY W_i: "
                "1 at every weight but layer 0. 0 means backward never prefetches (every gather is cold) or starts "
                "it after the GEMM."),
}
HINTS[RS_INFLIGHT] = ("In backward, launch the reduce-scatter of dW_i asynchronously (async_op=True) after the dX and "
                      "dW GEMMs of layer i, and wait for it one layer later: layer i-1's backward calls finalize(i) "
                      "after its own GEMMs; finalize_grads() waits for layer 0's. Expected: 0 at the first backward "
                      "layer, then 1 (the later layer's reduce-scatter runs under this GEMM). 0 everywhere means "
                      "each reduce-scatter is waited at once (nothing overlaps); 2 or more means waits are put off "
                      "further (every full-size weight grad stays alive). Use work.wait() on the Work that "
                      "dist.reduce_scatter_single(..., async_op=True) returns.")
HINTS[RS_UNWAITED] = ("Every weight-grad reduce-scatter must be waited (work.wait()) before its result is read: "
                      "layer i-1's backward waits for layer i's, finalize_grads() for whatever is still pending.")
HINTS[RS_INFLIGHT_DW] = ("The stated order puts the later layer's reduce-scatter under this layer's dW GEMM as well: "
                         "dX, dW, launch(i), then finalize(i+1). 0 where 1 is expected means finalize(i+1) ran before "
                         "the dW GEMM; -1 means no dW GEMM was seen: the checker recognises it as the GEMM that reads "
                         "all of the layer's saved input x (or a view or copy of it) and makes the whole (out_i, in_i) "
                         "grad, as dY^T X does.")
OVERLAP_HINTS = dict(HINTS)
for _i in range(8):
    HINTS[f"dW{_i}"] = ("Each rank's grad shard is its rows of the dense grad summed over all ranks' micro-batches: "
                        "reduce-scatter the full dY^T X (op SUM), do not keep only the local product.")
    OVERLAP_HINTS[f"dW{_i}"] = HINTS[f"dW{_i}"] + (
        " finalize(i) ADDS the result to shards[i].grad (or sets it when it is None): the checker starts layers "
        "0, 2, .. with a known .grad, as a step that accumulates grads over micro-batches would; assigning "
        "p.grad = result throws it away.")

for name, cfg, seed in [
        ("forward", {"dims": [16, 32, 24, 32, 16], "N": 8, "backward": False}, 0),
        ("forward_hidden", {"dims": [12, 8, 16, 20], "N": 4, "backward": False}, None),
        ("chain", {"dims": [16, 32, 24, 32, 16], "N": 8, "backward": True}, 1),
        ("chain_hidden", {"dims": [8, 16, 12, 24, 8, 12], "N": 12, "backward": True}, None)]:
    register(Case(name=f"week08/{name}", module=MODULE, world_sizes=(2, 4), config=cfg, make_inputs=_inputs,
                  reference=_reference, run_rank="run_chain", expected=_expected, contract=_contract, seed=seed,
                  feedback=INSIDE,
                  rank_inputs=_own,
                  hidden=seed is None, title="GTP chain " + ("forward" if not cfg["backward"] else "forward + backward"),
                  hints=HINTS))
for name, cfg, seed in [
        ("overlap", {"dims": [16, 32, 24, 32, 16], "N": 8, "backward": True, "overlap": True}, 2),
        ("overlap_hidden", {"dims": [8, 16, 12, 24, 8, 12], "N": 12, "backward": True, "overlap": True}, None)]:
    register(Case(name=f"week08/{name}", module=MODULE, world_sizes=(2, 4), config=cfg, make_inputs=_inputs,
                  reference=_reference, run_rank="run_overlap", expected=_expected, contract=_contract, seed=seed,
                  feedback=INSIDE,
                  rank_inputs=_own,
                  hidden=seed is None, title="GTP chain, weight-grad reduce-scatter finalised one layer later",
                  hints=OVERLAP_HINTS))
