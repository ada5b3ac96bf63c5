"""Week 2: ColumnParallelLinear and RowParallelLinear, outputs AND gradients, t = 2 and 4.

For W of shape (out, in) and t ranks (Megatron-LM, Shoeybi et al. 2019, Sec. 3):
- column-parallel: rank r holds W[r-th out-block] (out/t, in); Y_r = X W_r^T needs no
  communication; dX = sum_r dY_r W_r needs one all-reduce in backward (the f operator).
- row-parallel: rank r holds W[:, r-th in-block] (out, in/t); Y = sum_r X_r W_r^T needs one
  all-reduce in forward (the g operator); dX_r = dY W_r is local.

Scored: values against the trusted reference and the switchboard's record of the collectives. "note (inside the
rank, not scored)" marks what the harness measures in the student's process: said beside the verdict, no points.
Such notes everywhere: Contract.params (the names and shapes a rank reports; a rank keeping more than its shard is
caught by its values, as it receives only its own part of every dense tensor, the rest NaN), ctx.hand (an input
written into) and a replaced harness function (grader/rank/seal.py).
Rules the lab's text states -> the check that enforces it (case: tensor or contract field):
 1. column-parallel keeps rows r*out/t:(r+1)*out/t of W (and of b) -> column_parallel, column_parallel_local:
    `dW`, `db` (the other rows arrive NaN); Contract.params: a note (fixture unsharded_cheat)
 2. its forward is local; gather_output=True all-gathers along the last dim, whose backward keeps the slice ->
    Contract.counts forward {all_gather: 1} / {} (local), `y` (fixture wrong_shape)
 3. dX needs f: identity forward, all-reduce backward -> column cases: counts backward {all_reduce: 1}, `dx`
 4. shards live in self.weight / self.bias, nn.Parameters shaped like nn.Linear's -> every case: `dW`, `db` are read
    by those names; Contract.params (names and shapes): note (inside the rank, not scored)
 5. use `group` and dist.get_rank(group) / get_world_size(group) -> world_sizes (2, 4) on a 4-rank job (t=2 runs
    on ranks 2 and 3)
 6. row-parallel keeps columns r*in/t:(r+1)*in/t of W -> row_parallel*: `dW`; Contract.params: a note
 7. its forward ends in g: all-reduce forward -> row cases: counts forward {all_reduce: 1} (fixture deadlock_skip)
 8. g's backward is the identity -> row cases: `dx`, `dW` (fixture wrong_weight_grad)
 9. the row bias is added once, after the sum -> row_parallel: `y`, `db` (fixture bias_every_rank)
10. input_is_parallel=False keeps its slice of X, backward all-gathers -> row_parallel: counts backward
    {all_gather: 1}, full `dx`; row_parallel_input_parallel: backward {}, `dx` shard
11. the MLP: exactly one all-reduce forward and one backward -> mlp: Contract.counts, where every other
    collective, barriers included, is counted too (fixture extra_barrier)
11 rules stated; 11 checked before this issue, 11 checked now (1, 4 and 6 by values, Contract.params a note).
Course-wide rule (not in this lab's text): code may not write into the tensors it is given -> every case,
note (inside the rank, not scored): ctx.hand on the dense layer's parameters and the input (see grader/rank/week02.py
on upstream grads). A replaced harness function: a note too (fixture patched_ledger: full marks, with the note).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from grader.judge.case import Case, Contract, poisoned, register, shard
from reference import backward

MODULE = "tp_linear"


# -- single-device references (trusted process; from the full tensors, never from a student's shards) --
def _leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone().requires_grad_(True)


def dense_linear(x, weight, bias, dy) -> dict:
    """y = x W^T + b and its grads: the dense answer for column- and row-parallel linears."""
    x, w, b = _leaf(x), _leaf(weight), _leaf(bias)
    y = F.linear(x, w, b)                         # (..., out)
    backward(y, dy)
    out = {"y": y.detach(), "dx": x.grad, "dW": w.grad}
    if b is not None:
        out["db"] = b.grad
    return out


def dense_mlp(x, w1, b1, w2, b2, dy) -> dict:
    """Megatron MLP on one device: y = GeLU(x W1^T + b1) W2^T + b2."""
    x, w1, b1, w2, b2 = map(_leaf, (x, w1, b1, w2, b2))
    h = F.gelu(F.linear(x, w1, b1))               # (..., ffn)
    y = F.linear(h, w2, b2)                       # (..., hidden)
    backward(y, dy)
    return {"y": y.detach(), "dx": x.grad, "dW1": w1.grad, "db1": b1.grad, "dW2": w2.grad, "db2": b2.grad}


def _linear_inputs(cfg, gen):
    i, o = cfg["in"], cfg["out"]
    d = {"x": torch.randn(*cfg["lead"], i, generator=gen),
         "W": torch.randn(o, i, generator=gen) / math.sqrt(i),
         "dy": torch.randn(*cfg["lead"], o, generator=gen)}
    if cfg.get("bias", True):
        d["b"] = 0.1 * torch.randn(o, generator=gen)
    return d


# -- what each rank receives (only what a real TP rank owns) ---------------------
def _own_column(cfg, d, r, t):
    """The dense layer a column-parallel rank is handed holds only its rows (the rest NaN); X is replicated;
    dY is the full output's grad when the output is gathered, else only this rank's columns of it."""
    own = {"x": d["x"], "W": poisoned(d["W"], r, t, 0), "dy": d["dy"] if cfg["gather"] else shard(d["dy"], r, t, -1)}
    if "b" in d:
        own["b"] = poisoned(d["b"], r, t, 0)
    return own


def _own_row(cfg, d, r, t):
    """A row-parallel rank: its columns of W (the rest NaN), the replicated bias and dY, and X whole or only its
    slice of the input features (input_is_parallel)."""
    own = {"x": shard(d["x"], r, t, -1) if cfg["parallel_input"] else d["x"], "W": poisoned(d["W"], r, t, 1),
           "dy": d["dy"]}
    if "b" in d:
        own["b"] = d["b"]
    return own


def _own_mlp(cfg, d, r, t):
    return {"x": d["x"], "W1": poisoned(d["W1"], r, t, 0), "b1": poisoned(d["b1"], r, t, 0),
            "W2": poisoned(d["W2"], r, t, 1), "b2": d["b2"], "dy": d["dy"]}


# -- column-parallel ------------------------------------------------------------
def _expect_column(cfg, ref, r, t):
    out = {"y": ref["y"] if cfg["gather"] else shard(ref["y"], r, t, -1), "dx": ref["dx"],
           "dW": shard(ref["dW"], r, t, 0)}
    if "db" in ref:
        out["db"] = shard(ref["db"], r, t, 0)
    return out


def _contract_column(cfg, t):
    params = {"weight": (cfg["out"] // t, cfg["in"])}
    if cfg.get("bias", True):
        params["bias"] = (cfg["out"] // t,)
    return Contract(
        counts={"forward": {"all_gather": 1} if cfg["gather"] else {}, "backward": {"all_reduce": 1}},
        params=params,
        why={"forward": "Y_r = X W_r^T is local; only gather_output=True needs one all-gather.",
             "backward": "dX = sum_r dY_r W_r: one all-reduce of dX (the f operator); the gather's backward is a local split."})


# -- row-parallel ---------------------------------------------------------------
def _expect_row(cfg, ref, r, t):
    out = {"y": ref["y"], "dx": shard(ref["dx"], r, t, -1) if cfg["parallel_input"] else ref["dx"],
           "dW": shard(ref["dW"], r, t, 1)}
    if "db" in ref:
        out["db"] = ref["db"]          # the bias is replicated: every rank's grad is the dense grad
    return out


def _contract_row(cfg, t):
    params = {"weight": (cfg["out"], cfg["in"] // t)}
    if cfg.get("bias", True):
        params["bias"] = (cfg["out"],)
    return Contract(
        counts={"forward": {"all_reduce": 1},
                "backward": {} if cfg["parallel_input"] else {"all_gather": 1}},
        params=params,
        why={"forward": "Y = sum_r X_r W_r^T: exactly one all-reduce of the partial outputs (the g operator).",
             "backward": "dX_r = dY W_r is local; only a replicated input (input_is_parallel=False) must "
                         "all-gather the dX slices back to the full dX."})


# -- column -> row MLP ----------------------------------------------------------
def _mlp_inputs(cfg, gen):
    h, f = cfg["hidden"], cfg["ffn"]
    return {"x": torch.randn(*cfg["lead"], h, generator=gen),
            "W1": torch.randn(f, h, generator=gen) / math.sqrt(h), "b1": 0.1 * torch.randn(f, generator=gen),
            "W2": torch.randn(h, f, generator=gen) / math.sqrt(f), "b2": 0.1 * torch.randn(h, generator=gen),
            "dy": torch.randn(*cfg["lead"], h, generator=gen)}


def _expect_mlp(cfg, ref, r, t):
    return {"y": ref["y"], "dx": ref["dx"], "dW1": shard(ref["dW1"], r, t, 0), "db1": shard(ref["db1"], r, t, 0),
            "dW2": shard(ref["dW2"], r, t, 1), "db2": ref["db2"]}


def _contract_mlp(cfg, t):
    h, f = cfg["hidden"], cfg["ffn"]
    return Contract(counts={"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}},
                    params={"fc1.weight": (f // t, h), "fc1.bias": (f // t,), "fc2.weight": (h, f // t),
                            "fc2.bias": (h,)},
                    why={"forward": "column->GeLU->row needs one all-reduce, after the row-parallel GEMM.",
                         "backward": "one all-reduce of dX, in the column-parallel layer's f operator."})


HINTS = {
    "db": "A bias must be added once: after the all-reduce in a row-parallel layer, and sharded with the "
          "output features in a column-parallel one.",
    "dx": "Input grads need the conjugate operator: the f operator all-reduces dX in backward.",
    "dW": "Each rank's weight grad must equal its slice of the dense weight grad.",
    "y": "Check the slice of W each rank keeps (rank r takes the r-th torch.chunk block) and that the "
         "bias is added once, not on every rank.",
}


def _lin(c, **kw):
    d = {"lead": [4], "in": 8, "out": 16, "bias": True}
    d.update(c)
    d.update(kw)
    return d


for name, gather, cfg, seed in [
        ("column_parallel", True, _lin({}), 0),
        ("column_parallel_local", False, _lin({}), 1),
        ("column_parallel_hidden", True, _lin({"lead": [2, 3], "in": 12, "out": 20, "bias": False}), None),
        ("column_parallel_local_hidden", False, _lin({"lead": [3, 2], "in": 20, "out": 12}), None)]:
    register(Case(name=f"week02/{name}", module=MODULE, world_sizes=(2, 4), config=dict(cfg, gather=gather),
                  make_inputs=_linear_inputs, reference=lambda c, d: dense_linear(d["x"], d["W"], d.get("b"), d["dy"]),
                  run_rank="run_column", expected=_expect_column, contract=_contract_column, seed=seed,
                  rank_inputs=_own_column,
                  hidden=seed is None, title="ColumnParallelLinear", hints=HINTS))

for name, par, cfg, seed in [
        ("row_parallel", False, _lin({"in": 16, "out": 8}), 2),
        ("row_parallel_input_parallel", True, _lin({"in": 16, "out": 8}), 3),
        ("row_parallel_hidden", False, _lin({"lead": [2, 3], "in": 20, "out": 12}), None),
        ("row_parallel_input_parallel_hidden", True, _lin({"lead": [5], "in": 12, "out": 20, "bias": False}), None)]:
    register(Case(name=f"week02/{name}", module=MODULE, world_sizes=(2, 4), config=dict(cfg, parallel_input=par),
                  make_inputs=_linear_inputs, reference=lambda c, d: dense_linear(d["x"], d["W"], d.get("b"), d["dy"]),
                  run_rank="run_row", expected=_expect_row, contract=_contract_row, seed=seed,
                  rank_inputs=_own_row,
                  hidden=seed is None, title="RowParallelLinear", hints=HINTS))

for name, cfg, seed in [("mlp", {"lead": [4], "hidden": 8, "ffn": 32}, 4),
                        ("mlp_hidden", {"lead": [2, 5], "hidden": 12, "ffn": 24}, None)]:
    register(Case(name=f"week02/{name}", module=MODULE, world_sizes=(2, 4), config=cfg, make_inputs=_mlp_inputs,
                  reference=lambda c, d: dense_mlp(d["x"], d["W1"], d["b1"], d["W2"], d["b2"], d["dy"]),
                  run_rank="run_mlp", expected=_expect_mlp, contract=_contract_mlp, seed=seed, hidden=seed is None,
                  rank_inputs=_own_mlp,
                  title="Megatron MLP", hints={**HINTS, "db2": HINTS["db"], "db1": HINTS["db"]}))
