"""Week 11: expert parallelism for a top-k routed MoE layer, t = 2 and 4 (lecture: reference/expert_parallel.py).

Rank r of t holds N tokens of its own, the router weight (replicated) and experts r*E/t:(r+1)*E/t; the trusted
process holds every token and expert and computes the dense MoE (every expert on every token, the gate matrix
picks) with the same routing: softmax, top-k (best first), gates renormalised over the k, capacity
ceil(C*N*k/E) per expert over ONE rank's N tokens, the assignments past it dropped in token order.
- routing: the pure function on this rank's (N, E) logits: experts, gates, keep, Switch's aux loss and the
  grad of the logits from random upstream grads of the gates and the aux loss. No collective.
- all_to_all: exchange_counts (one even all-to-all of E counts) and AllToAll (all_to_all_single with split
  sizes; backward: the same with the splits swapped) on random rows sorted by expert.
- ep_dropless: the same layer with capacity_factor None (dropless): nothing dropped, every assignment dispatched.
- route_biased: DeepSeek-V3's auxiliary-loss-free selection on this rank's logits with the (replicated) expert bias:
  experts, gates and the grad of the logits from a random upstream grad of the gates. No collective.
- ep_layer: EPMoE forward and backward: y, dx, the router grad from this rank's tokens (the data-parallel
  all-reduce that sums it over ranks is not part of the layer), each rank's expert-weight grads (its slice of
  the dense grads over ALL ranks' tokens); 3 all-to-alls forward (counts, dispatch, combine), 2 backward.

Scored: values against the trusted reference and the switchboard's record of the collectives. "note (inside the
rank, not scored)" marks what the harness measures in the student's process: said beside the verdict, no points.
Such notes everywhere: Contract.params (the names and shapes a rank reports; a rank keeping more than its shard is
caught by its values, as it receives only its own part of every dense tensor, the rest NaN), ctx.hand (an input
written into) and a replaced harness function (grader/rank/seal.py).
Rules the lab's text states -> the check that enforces it (case: tensor or contract field):
 1. softmax over the E logits, top-k best first -> routing: `experts`
 2. gates renormalised over the k chosen -> routing: `gates`, `dlogits` (fixture gates_not_renormalised)
 3. capacity = ceil(C*N*k/E) over this rank's N tokens -> routing: `keep` (fixture capacity_floor)
 4. an expert keeps its first `capacity` assignments in token order, drops the rest -> routing: `keep`
    (fixture drop_lowest_prob)
 5. aux = E * sum_i f_i P_i, f_i over the k*N assignments before drops, P_i the mean probability -> routing:
    `aux`, `dlogits` (fixture aux_after_drops)
 6. route communicates nothing -> routing: Contract.allowed_ops = {}
 7. exchange_counts: (t, E/t), row s = what rank s sends to each of my experts, one all-to-all -> all_to_all:
    `recv_counts`, Contract.counts forward {all_to_all: 2} (fixture counts_not_exchanged)
 8. AllToAll forward: all_to_all_single with the split sizes; rows in source-rank order -> all_to_all: `y`,
    `dispatch split sizes (record)`, `bytes of rows sent by this rank (record)`, from the switchboard's record
 9. AllToAll backward: the reverse all-to-all (splits swapped) -> all_to_all: `dx`, Contract.counts backward
    {all_to_all: 1} (fixture backward_no_comm)
10. use `group` in every collective -> world_sizes (2, 4) on a 4-rank job (t=2 on ranks 2 and 3)
11. EPMoE holds `router` (E, H) and only its experts, `w1` (E/t, F, H), `w2` (E/t, H, F) -> ep_layer:
    `dw1`, `dw2`, Contract.params (note); a rank receives only those (rank_inputs)
12. dropped assignments never leave the rank; kept ones go to their expert's rank -> ep_layer: `dispatch split
    sizes (record)`, `bytes of rows sent by this rank (record)` (fixture drop_after_dispatch)
13. y = sum of the kept gates times the experts' outputs -> ep_layer: `y`, `dx`, `drouter` (fixture gates_detached)
14. forward: counts + dispatch + combine all-to-alls, backward: the 2 reverse ones, nothing else (the router
    grad is not all-reduced here) -> ep_layer: Contract.counts, `drouter` (fixture router_grad_allreduced)
15. capacity_factor None: dropless, every assignment kept and dispatched -> ep_dropless: `y`, `dx`, `dispatch split
    sizes (record)`, `bytes of rows sent by this rank (record)` (fixture dropless_still_drops)
16. route_biased: sigmoid scores, top-k of scores + bias (best first) -> route_biased: `experts` (fixtures
    bias_ignored, softmax_scores)
17. the gates: the chosen scores WITHOUT the bias, renormalised; the bias gets no grad -> route_biased: `gates`,
    `dlogits` (fixture bias_in_gates)
17 rules stated, 17 checked.
Course-wide rule: code may not write into the tensors it is given -> every case, note (inside the rank, not scored):
ctx.hand on the inputs.
"""
from __future__ import annotations

import torch

from grader.judge.case import Case, Contract, register
from reference import backward
from reference.expert_parallel import dense_moe, route, route_biased

MODULE = "moe_ep"
ROW_HINT = ("Rows go to ranks in rank order: in_splits[s] rows to rank s, out_splits[s] from rank s "
            "(dist.all_to_all_single(out, x, output_split_sizes, input_split_sizes, group=group)).")
SPLITS = "dispatch split sizes (record): rows sent to each rank, then rows received from each"
SENT = "bytes of rows sent by this rank (record): forward, backward"
LEDGER_HINT = ("The split sizes and bytes are the record of your all-to-alls of (rows, H) tensors. Only "
               "the KEPT assignments are sent, each to the rank that holds its expert (rank r holds experts "
               "r*E/t:(r+1)*E/t); drop before the dispatch, not after it.")


def all_to_all_record(cfg, record: list, r: int, t: int) -> dict:
    """What this rank's all-to-alls of (rows, H) tensors moved: bytes sent per phase, the first one's splits."""
    rows = [e for e in record if e.get("op") == "all_to_all" and len(e.get("shape", [])) == 2
            and e["shape"][1] == cfg["H"]]
    out = {SENT: torch.tensor([sum(e["sent"] for e in rows if e.get("phase") == ph) for ph in ("forward", "backward")],
                              dtype=torch.float64)}
    if rows and rows[0].get("phase") == "forward":
        out[SPLITS] = torch.tensor(list(rows[0].get("in_splits", [])) + list(rows[0].get("out_splits", [])),
                                   dtype=torch.int64)
    return out


# -- task 1: routing ---------------------------------------------------------------------------------
def _routing_inputs(cfg, gen):
    n, E = 4 * cfg["N"], cfg["E"]
    return {"logits": 2 * torch.randn(n, E, generator=gen), "dgates": torch.randn(n, cfg["k"], generator=gen),
            "daux": torch.randn(1, generator=gen)}


def _block(x, r, n):
    return x[r * n:(r + 1) * n]


def _routing_rank_inputs(cfg, d, r, t):
    return {"logits": _block(d["logits"], r, cfg["N"]), "dgates": _block(d["dgates"], r, cfg["N"]), "daux": d["daux"]}


def _routing_reference(cfg, d):
    out = {}
    for r in range(4):
        logits = _block(d["logits"], r, cfg["N"]).clone().requires_grad_(True)
        rt = route(logits, cfg["k"], cfg["C"])
        ((rt.gates * _block(d["dgates"], r, cfg["N"])).sum() + rt.aux * d["daux"][0]).backward()
        out.update({f"experts{r}": rt.experts, f"gates{r}": rt.gates.detach(), f"keep{r}": rt.keep.long(),
                    f"aux{r}": rt.aux.detach(), f"dlogits{r}": logits.grad})
    return out


def _routing_expected(cfg, ref, r, t):
    return {k: ref[f"{k}{r}"] for k in ("experts", "gates", "keep", "aux", "dlogits")}


ROUTING_HINTS = {
    "experts": "softmax over the E logits, then torch.topk(probs, k, dim=-1): the k experts, best first.",
    "gates": "Renormalise the k chosen probabilities so they sum to 1 per token (gates = top / top.sum(-1)).",
    "keep": "capacity = ceil(C * N * k / E) over THIS rank's N tokens (math.ceil); an expert keeps its first "
            "`capacity` assignments in token order and drops the rest, whatever their probabilities.",
    "aux": "aux = E * sum_i f_i * P_i: f_i = assignments to expert i / (N * k), counted BEFORE drops; P_i = the "
           "mean over tokens of the softmax probability of i.",
    "dlogits": "The grad flows through the renormalised gates and through P_i (f_i is a count: no grad).",
}
for name, cfg, seed in [("routing", {"N": 12, "E": 8, "k": 2, "C": 1.1}, 11),
                        ("routing_hidden", {"N": 15, "E": 4, "k": 2, "C": 1.0}, None)]:
    register(Case(name=f"week11/{name}", module=MODULE, world_sizes=(2, 4), config=cfg, make_inputs=_routing_inputs,
                  rank_inputs=_routing_rank_inputs, reference=_routing_reference, run_rank="run_routing",
                  expected=_routing_expected, contract=lambda cfg, t: Contract(allowed_ops=set()), seed=seed,
                  hidden=seed is None, title="route", hints=ROUTING_HINTS))


# -- task 2: the counts and the rows -----------------------------------------------------------------
def _a2a_inputs(cfg, gen):
    E, H, m = cfg["E"], cfg["H"], cfg["max_count"]
    counts = torch.randint(0, m + 1, (4, E), generator=gen)
    counts[0, -1] = 0                                      # an empty expert, always
    return {"counts": counts, "x": torch.randn(4, E * m, H, generator=gen),
            "dy": torch.randn(4, 4 * E * m, H, generator=gen)}


def _per_rank(counts, t):
    """(src, dst) rows: what rank s sends to rank d when rank d holds experts d*E/t:(d+1)*E/t."""
    return counts[:t].view(t, t, -1).sum(2)


def _a2a_rank_inputs(cfg, d, r, t):
    M, R = int(d["counts"][r].sum()), int(_per_rank(d["counts"], t)[:, r].sum())
    return {"counts": d["counts"][r].clone(), "x": d["x"][r, :M], "dy": d["dy"][r, :R]}


def _a2a_expected(cfg, d, r, t):
    counts, row = d["counts"], cfg["H"] * 4
    rows = _per_rank(counts, t)                            # (t, t)
    starts = torch.cat([torch.zeros(t, 1, dtype=torch.long), rows.cumsum(1)], 1)     # row offsets per source
    y = torch.cat([d["x"][s, starts[s, r]:starts[s, r + 1]] for s in range(t)])
    dx = []
    for dst in range(t):                                   # my rows at dst come after those of ranks < r
        off = int(rows[:r, dst].sum())
        dx.append(d["dy"][dst, off:off + rows[r, dst]])
    sent = float(rows[r].sum() - rows[r, r]) * row, float(rows[:, r].sum() - rows[r, r]) * row
    return {"recv_counts": counts[:t, r * cfg["E"] // t:(r + 1) * cfg["E"] // t], "y": y, "dx": torch.cat(dx),
            SPLITS: torch.cat([rows[r], rows[:, r]]), SENT: torch.tensor(sent, dtype=torch.float64)}


A2A_HINTS = {
    "recv_counts": "exchange_counts: one all_to_all_single of the E counts (E/t to each rank, even), viewed (t, E/t): "
                   "row s = the rows rank s sends to each of my experts.",
    "y": ROW_HINT, SPLITS: ROW_HINT + " " + LEDGER_HINT,
    "dx": "AllToAll.backward: every row's grad goes back to the rank it came from: the same all_to_all_single with "
          "input and output split sizes swapped.",
    SENT: LEDGER_HINT,
}


def _a2a_contract(cfg, t):
    return Contract(counts={"forward": {"all_to_all": 2}, "backward": {"all_to_all": 1}},
                    why={"forward": "one all-to-all of the counts (the receivers must know the split sizes), one "
                                    "of the rows.",
                         "backward": "the rows' grads go back with the reverse all-to-all; the counts need none."})


for name, cfg, seed in [("all_to_all", {"E": 8, "H": 8, "max_count": 3}, 12),
                        ("all_to_all_hidden", {"E": 4, "H": 6, "max_count": 5}, None)]:
    register(Case(name=f"week11/{name}", module=MODULE, world_sizes=(2, 4), config=cfg, make_inputs=_a2a_inputs,
                  rank_inputs=_a2a_rank_inputs, reference=lambda cfg, d: d, run_rank="run_all_to_all",
                  expected=_a2a_expected, contract=_a2a_contract, from_record=all_to_all_record, seed=seed,
                  hidden=seed is None,
                  title="exchange_counts + AllToAll", hints=A2A_HINTS))


# -- task 3: the EP layer ----------------------------------------------------------------------------
def _layer_inputs(cfg, gen):
    n, E, H, F = 4 * cfg["N"], cfg["E"], cfg["H"], cfg["F"]
    return {"x": torch.randn(n, H, generator=gen), "dy": torch.randn(n, H, generator=gen),
            "router": torch.randn(E, H, generator=gen), "w1": torch.randn(E, F, H, generator=gen) / H ** 0.5,
            "w2": torch.randn(E, H, F, generator=gen) / F ** 0.5}


def _layer_rank_inputs(cfg, d, r, t):
    lo, hi = r * cfg["E"] // t, (r + 1) * cfg["E"] // t
    return {"x": _block(d["x"], r, cfg["N"]), "dy": _block(d["dy"], r, cfg["N"]), "router": d["router"],
            "w1": d["w1"][lo:hi], "w2": d["w2"][lo:hi]}


def _layer_reference(cfg, d):
    """The dense MoE, one rank's block of tokens at a time (each block is routed with its own capacity): y, dx and
    the router grad per block; the expert grads summed over the first t blocks; the kept assignments per block."""
    out, dw1, dw2 = {}, 0, 0
    for r in range(4):
        x = _block(d["x"], r, cfg["N"]).clone().requires_grad_(True)
        wr, w1, w2 = (d[n].clone().requires_grad_(True) for n in ("router", "w1", "w2"))
        y, _ = dense_moe(x, wr, w1, w2, cfg["k"], cfg["C"], 1)
        backward(y, _block(d["dy"], r, cfg["N"]))
        rt = route(x.detach() @ d["router"].T, cfg["k"], cfg["C"])
        out.update({f"y{r}": y.detach(), f"dx{r}": x.grad, f"drouter{r}": wr.grad,
                    f"kept{r}": torch.bincount(rt.experts[rt.keep], minlength=cfg["E"])})
        if r == 2:
            out["dw1_2"], out["dw2_2"] = dw1, dw2
        dw1, dw2 = dw1 + w1.grad, dw2 + w2.grad
    out["dw1_4"], out["dw2_4"] = dw1, dw2
    return out


def _layer_expected(cfg, ref, r, t):
    lo, hi = r * cfg["E"] // t, (r + 1) * cfg["E"] // t
    rows = _per_rank(torch.stack([ref[f"kept{s}"] for s in range(4)]), t)             # (src, dst)
    moved = float(rows[r].sum() - rows[r, r] + rows[:, r].sum() - rows[r, r]) * cfg["H"] * 4
    return {"y": ref[f"y{r}"], "dx": ref[f"dx{r}"], "drouter": ref[f"drouter{r}"],
            "dw1": ref[f"dw1_{t}"][lo:hi], "dw2": ref[f"dw2_{t}"][lo:hi],
            SPLITS: torch.cat([rows[r], rows[:, r]]), SENT: torch.tensor([moved, moved], dtype=torch.float64)}


def _layer_contract(cfg, t):
    E, H, F = cfg["E"], cfg["H"], cfg["F"]
    return Contract(counts={"forward": {"all_to_all": 3}, "backward": {"all_to_all": 2}},
                    params={"router": (E, H), "w1": (E // t, F, H), "w2": (E // t, H, F)},
                    why={"forward": "3 all-to-alls: the per-expert counts, the dispatch of the kept rows, the combine "
                                    "(the reverse). Gathering every token on every rank is not expert parallelism.",
                         "backward": "the combine's backward is the dispatch's all-to-all and vice versa (2); the "
                                     "counts carry no grad; the router grad is summed by data parallelism, not here."})


LAYER_HINTS = {
    "y": "y = sum over the KEPT assignments of gate * expert(x), the gates renormalised over the k before the drop.",
    "dx": "dx comes back through the combine's reverse all-to-all, the experts, the dispatch's reverse, and the "
          "router (through the gates).",
    "drouter": "The router grad of THIS rank's tokens only (no all-reduce: data parallelism sums it over ranks). It "
               "flows through the gates: keep them in the graph (no .detach()) when you scale the combined rows.",
    "dw1": "Rank r's w1 grad is experts r*E/t:(r+1)*E/t of the dense grad, from every rank's tokens routed there.",
    "dw2": "Rank r's w2 grad is experts r*E/t:(r+1)*E/t of the dense grad, from every rank's tokens routed there.",
    SPLITS: ROW_HINT + " " + LEDGER_HINT, SENT: LEDGER_HINT,
}

LAYER = {"N": 12, "H": 8, "F": 16, "E": 8, "k": 2, "C": 1.0}
for name, cfg, seed in [("ep_layer", LAYER, 13),
                        ("ep_layer_hidden", dict(LAYER, N=15, F=8, E=4), None)]:
    register(Case(name=f"week11/{name}", module=MODULE, world_sizes=(2, 4), config=cfg, make_inputs=_layer_inputs,
                  rank_inputs=_layer_rank_inputs, reference=_layer_reference, run_rank="run_layer",
                  expected=_layer_expected, contract=_layer_contract, from_record=all_to_all_record, seed=seed,
                  hidden=seed is None,
                  title="EPMoE", hints=LAYER_HINTS))


# -- task 4: dropless, and the expert bias -----------------------------------------------------------
def _dropless_inputs(cfg, gen):
    """The layer's inputs with expert 0 every token's first choice, by a logit margin of 1 (its second choice keeps a
    gate of about a quarter): a capacity below N, as any factor below E/k gives, overflows expert 0's queue on every
    rank, so a layer that still drops fails whatever the seed (the same score on every run)."""
    d = _layer_inputs(cfg, gen)
    logits = d["x"] @ d["router"].T                                          # (4N, E)
    lift = (logits[:, 1:].amax(1) - logits[:, 0] + 1).clamp(min=0)           # (4N,)
    towards_0 = torch.linalg.pinv(d["router"])[:, 0]                         # (H,): router @ towards_0 = e_0
    d["x"] = d["x"] + lift[:, None] * towards_0                              # only logits[:, 0] rise
    return d


DROPLESS_HINTS = dict(LAYER_HINTS, **{
    SPLITS: "capacity_factor=None is dropless: route keeps EVERY assignment (no expert queue is longer than N, since a "
            "token never picks an expert twice), so this rank sends all N*k of them. " + ROW_HINT,
    SENT: "Dropless: all N*k assignments are dispatched, each to the rank of its expert; none is dropped.",
    "y": "With capacity_factor=None nothing is dropped: y = sum over ALL k assignments of gate * expert(x).",
})
for name, cfg, seed in [("ep_dropless", dict(LAYER, C=None), 14),
                        ("ep_dropless_hidden", dict(LAYER, N=15, F=8, E=4, C=None), None)]:
    register(Case(name=f"week11/{name}", module=MODULE, world_sizes=(2, 4), config=cfg, make_inputs=_dropless_inputs,
                  rank_inputs=_layer_rank_inputs, reference=_layer_reference, run_rank="run_layer",
                  expected=_layer_expected, contract=_layer_contract, from_record=all_to_all_record, seed=seed,
                  hidden=seed is None, title="EPMoE, dropless", hints=DROPLESS_HINTS))


def _biased_inputs(cfg, gen):
    n, E = 4 * cfg["N"], cfg["E"]
    return {"logits": 2 * torch.randn(n, E, generator=gen), "bias": 0.5 * torch.randn(E, generator=gen),
            "dgates": torch.randn(n, cfg["k"], generator=gen)}


def _biased_rank_inputs(cfg, d, r, t):
    return {"logits": _block(d["logits"], r, cfg["N"]), "bias": d["bias"], "dgates": _block(d["dgates"], r, cfg["N"])}


def _biased_reference(cfg, d):
    out = {}
    for r in range(4):
        logits = _block(d["logits"], r, cfg["N"]).clone().requires_grad_(True)
        experts, gates = route_biased(logits, cfg["k"], d["bias"])
        (gates * _block(d["dgates"], r, cfg["N"])).sum().backward()
        out.update({f"experts{r}": experts, f"gates{r}": gates.detach(), f"dlogits{r}": logits.grad})
    return out


def _biased_expected(cfg, ref, r, t):
    return {k: ref[f"{k}{r}"] for k in ("experts", "gates", "dlogits")}


BIASED_HINTS = {
    "experts": "scores s = sigmoid(logits) (not softmax); the k experts with the largest s + bias, best first "
               "(torch.topk(s + bias, k)).",
    "gates": "The bias steers the selection only: gates = the chosen s WITHOUT the bias, renormalised to sum to 1.",
    "dlogits": "The grad flows through sigmoid into the chosen scores only; the bias is a constant (no grad).",
}
for name, cfg, seed in [("route_biased", {"N": 12, "E": 8, "k": 2}, 15),
                        ("route_biased_hidden", {"N": 15, "E": 6, "k": 3}, None)]:
    register(Case(name=f"week11/{name}", module=MODULE, world_sizes=(2, 4), config=cfg, make_inputs=_biased_inputs,
                  rank_inputs=_biased_rank_inputs, reference=_biased_reference, run_rank="run_route_biased",
                  expected=_biased_expected, contract=lambda cfg, t: Contract(allowed_ops=set()), seed=seed,
                  hidden=seed is None, title="route_biased", hints=BIASED_HINTS))
