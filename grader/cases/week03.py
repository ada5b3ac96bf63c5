"""Week 3: tensor-parallel attention (GQA-aware) and the whole pre-norm decoder block, t = 2 and 4.

Megatron-LM (Shoeybi et al. 2019, Sec. 3): q/k/v are column-parallel (rank r keeps its heads' rows),
o_proj is row-parallel; gate/up are column-parallel, down is row-parallel. So each sub-block
needs one all-reduce forward (g, after the row-parallel GEMM) and one backward (f, of dX at the
column-parallel input): attention 1 + 1, block 2 + 2. RMSNorm weights are replicated: their
input and the grad reaching them are replicated, so every rank holds the dense grad with no
communication.

GQA rule (reference.head_sharding.kv_heads_of_rank): rank r keeps the k/v rows of every kv head
its query heads read; a kv head read by several ranks is copied, and each copy's weight grad is
the partial from that rank's query heads (the dense grad is their sum; summing them is a
once-per-step weight-grad sync, not part of the block's backward, so it is not in the contract).

What each rank receives (`_own`): the dense module the harness hands `from_dense` with only this rank's parts
(q rows of its query heads, k/v rows of kv_heads_of_rank, its columns of o_proj, its rows of gate/up and
columns of down; every other entry NaN), the replicated RMSNorm weights whole, and the replicated input X and
upstream grad dY (without sequence parallelism both are whole on every rank). A rank that computes with
weights it does not own (a dense copy, another rank's heads) gets NaN, named in the verdict.

Why atol=1e-3 is fair: weights come from N(0, 1/fan_in) (tpkit.models.init_weights: activations
stay O(1)), inputs and upstream grads are N(0, 1), everything is float32 (eps ~1e-7) and the
reductions are tens of terms long: a correct TP implementation differs from the dense one by
~1e-6 (reordered sums), a wrong slice or a doubled reduction by O(0.1-1).

Scored: values against the trusted reference and the switchboard's record of the collectives. "note (inside the
rank, not scored)" marks what the harness measures in the student's process: said beside the verdict, no points.
Such notes everywhere: Contract.params (the names and shapes a rank reports; a rank keeping more than its shard is
caught by its values, as it receives only its own part of every dense tensor, the rest NaN), ctx.hand (an input
written into) and a replaced harness function (grader/rank/seal.py).
Rules the lab's text states -> the check that enforces it (case: tensor or contract field):
 1. rank r owns query heads [r nh/t, (r+1) nh/t): those rows of q_proj, those columns of o_proj -> attention*,
    block*: `d.q_proj.weight`, `d.o_proj.weight`; Contract.params (note)
 2. the input passes f (all-reduce backward) before the projections -> counts backward {all_reduce: 1}, `dx`
    (fixture reduce_twice)
 3. o_proj's partial sum is all-reduced by g -> counts forward {all_reduce: 1}, bytes_sent forward, `y`
 4. GQA: rank r keeps the k/v rows of kv_heads_of_rank(...), a copy when several ranks read one kv head ->
    attention_gqa (t=4 copies): `d.k_proj.weight`, `d.v_proj.weight`, Contract.params (note) (fixture wrong_kv_head)
 5. a copy's grad is the partial grad: no all-reduce of k/v grads inside the block -> `d.k_proj.weight`
    (fixture copy_grad_zeroed), counts backward
 6. use `group` and dist.get_rank(group) -> world_sizes (2, 4) on a 4-rank job (t=2 on ranks 2 and 3)
 7. keep the HF module names -> the grads are read by name (a missing one is reported); Contract.params (note)
 8. MLP: gate/up keep rows r*ffn/t:(r+1)*ffn/t, down those columns -> block*: `d.mlp.*.weight`, Contract.params
    (note)
 9. SwiGLU runs locally, no communication -> block: counts forward {all_reduce: 2}
10. pre-norm block h = x + attn(norm1(x)), y = h + mlp(norm2(h)) -> block: `y`, `dx`
11. the two RMSNorms are replicated -> block: `d.*layernorm.weight` = the dense grad; Contract.params (C,) (note)
12. residual adds on the all-reduced outputs, once -> block: `y` (fixture residual_inside_reduce)
13. norm weight grads need no communication -> block: `d.input_layernorm.weight`, counts backward
    {all_reduce: 2} (fixture norm_grad_allreduced)
14. attention 1 all-reduce forward + 1 backward, the block 2 + 2 -> Contract.counts, bytes_sent
15. write the pieces fresh, do not import the Week 2 module -> the job ships only this lab's modules, so an
    import of tp_linear fails on every rank
15 rules stated; 15 checked before this issue, 15 checked now (by values and the record; Contract.params a note).
Course-wide rule (not in this lab's text): code may not write into the tensors it is given -> every case,
note (inside the rank, not scored): ctx.hand on the dense module's parameters and the input (see
grader/rank/week02.py on upstream grads).
Course-wide rule: a rank holds only what its rank owns -> every case: `_own` (fixture dense_shadow).
"""
from __future__ import annotations

import torch

from grader.judge.case import Case, Contract, poisoned, register
from reference.head_sharding import (
    dense_attention,
    dense_block,
    kv_heads_of_rank,
    model_config,
)
from tpkit.models import Attention, DecoderLayer, init_weights

MODULE = "tp_block"


def _inputs(kind):
    def make(cfg, gen):
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
        mc = model_config(cfg)
        dense = init_weights(Attention(mc) if kind == "attention" else DecoderLayer(mc), seed)
        d = {f"w.{k}": v.detach().clone() for k, v in dense.state_dict().items()}
        d["x"] = torch.randn(cfg["batch"], cfg["seq"], cfg["hidden"], generator=gen)
        d["dy"] = torch.randn(cfg["batch"], cfg["seq"], cfg["hidden"], generator=gen)
        return d
    return make


def _rows_only(w: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """`w` with every row outside [lo, hi) NaN: a GQA rank's kv rows need not be one torch.chunk block."""
    out = torch.full_like(w, float("nan"))
    out[lo:hi] = w[lo:hi]
    return out


def _own(cfg, d, r, t):
    """Rank r's view: X and dY whole (replicated), the norm weights whole, every projection NaN outside r's part."""
    hs = cfg["hidden"] // cfg["heads"]
    first, end = kv_heads_of_rank(cfg["heads"], cfg["kv_heads"], r, t)
    own = {"x": d["x"], "dy": d["dy"]}
    for k, w in ((k, w) for k, w in d.items() if k.startswith("w.")):
        leaf = k.split(".")[-2]
        if leaf in ("q_proj", "gate_proj", "up_proj"):
            own[k] = poisoned(w, r, t, 0)                  # column-parallel: its heads' / its ffn rows
        elif leaf in ("k_proj", "v_proj"):
            own[k] = _rows_only(w, first * hs, end * hs)   # the kv heads its query heads read
        elif leaf in ("o_proj", "down_proj"):
            own[k] = poisoned(w, r, t, 1)                  # row-parallel: the matching columns
        else:
            own[k] = w                                     # RMSNorm weights: replicated
    return own


def _attn_shards(cfg, ref, r, t, pre):
    hs, per = cfg["hidden"] // cfg["heads"], cfg["heads"] // t
    rows = slice(r * per * hs, (r + 1) * per * hs)
    return {f"d.{pre}q_proj.weight": ref[f"d.{pre}q_proj.weight"][rows],
            f"d.{pre}k_proj.weight": ref[f"d.{pre}dk@t{t}r{r}"],
            f"d.{pre}v_proj.weight": ref[f"d.{pre}dv@t{t}r{r}"],
            f"d.{pre}o_proj.weight": ref[f"d.{pre}o_proj.weight"][:, rows]}


def _expect_attention(cfg, ref, r, t):
    return {"y": ref["y"], "dx": ref["dx"], **_attn_shards(cfg, ref, r, t, "")}


def _expect_block(cfg, ref, r, t):
    f = cfg["ffn"] // t
    out = {"y": ref["y"], "dx": ref["dx"],
           "d.input_layernorm.weight": ref["d.input_layernorm.weight"],          # replicated: the dense grad
           "d.post_attention_layernorm.weight": ref["d.post_attention_layernorm.weight"]}
    out.update(_attn_shards(cfg, ref, r, t, "self_attn."))
    out["d.mlp.gate_proj.weight"] = ref["d.mlp.gate_proj.weight"][r * f:(r + 1) * f]
    out["d.mlp.up_proj.weight"] = ref["d.mlp.up_proj.weight"][r * f:(r + 1) * f]
    out["d.mlp.down_proj.weight"] = ref["d.mlp.down_proj.weight"][:, r * f:(r + 1) * f]
    return out


def _attn_param_shapes(cfg, t, rank_kv, pre=""):
    C, hs, per = cfg["hidden"], cfg["hidden"] // cfg["heads"], cfg["heads"] // t
    return {f"{pre}q_proj.weight": (per * hs, C), f"{pre}k_proj.weight": (rank_kv * hs, C),
            f"{pre}v_proj.weight": (rank_kv * hs, C), f"{pre}o_proj.weight": (C, per * hs)}


def _kv_count(cfg, t):
    # the contract's params are per case, not per rank: every rank of these configs keeps the same count
    counts = {hi - lo for lo, hi in (kv_heads_of_rank(cfg["heads"], cfg["kv_heads"], r, t) for r in range(t))}
    assert len(counts) == 1, f"config {cfg} gives ranks different kv-head counts"
    return counts.pop()


def _contract_attention(cfg, t):
    return Contract(
        counts={"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}},
        bytes_sent={"forward": 2 * (t - 1) / t * cfg["batch"] * cfg["seq"] * cfg["hidden"] * 4},
        params=_attn_param_shapes(cfg, t, _kv_count(cfg, t)),
        why={"forward": "q/k/v are column-parallel and attention is local per head: the only sum is the "
                        "row-parallel o_proj's partial outputs (one all-reduce of (B, T, C)).",
             "backward": "one all-reduce of dX at the column-parallel q/k/v input (the f operator); a kv "
                         "head copied on several ranks keeps its partial weight grad (no extra collective)."})


def _contract_block(cfg, t):
    C, f = cfg["hidden"], cfg["ffn"] // t
    params = {"input_layernorm.weight": (C,), "post_attention_layernorm.weight": (C,),
              "mlp.gate_proj.weight": (f, C), "mlp.up_proj.weight": (f, C), "mlp.down_proj.weight": (C, f)}
    params.update(_attn_param_shapes(cfg, t, _kv_count(cfg, t), "self_attn."))
    return Contract(
        counts={"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}},
        bytes_sent={"all": 4 * 2 * (t - 1) / t * cfg["batch"] * cfg["seq"] * C * 4},
        params=params,
        why={"forward": "one all-reduce after o_proj and one after down_proj (the g operators); the "
                        "residual adds and the RMSNorms run on replicated tensors, after the sums.",
             "backward": "one all-reduce of dX per sub-block (f before q/k/v, f before gate/up); the "
                         "replicated RMSNorm weights already hold the dense grad, so no collective for them."})


HINTS = {
    "y": "Check the head slicing (rank r owns query heads [r nh/t, (r+1) nh/t)), that attention uses the local "
         "head count (view(B, T, -1, hs)), and that each partial sum is all-reduced exactly once.",
    "dx": "Input grads need the f operator before the column-parallel projections (all-reduce in backward); "
          "a second reduction in backward multiplies the grad by t.",
    "d.k_proj.weight": "Rank r keeps the kv heads its query heads read (kv_heads_of_rank); a kv head copied on "
                       "several ranks keeps only its partial grad: do not all-reduce it inside the block.",
    "d.input_layernorm.weight": "The norm weight is replicated and its input grad is already the full grad: "
                                "do not all-reduce it (that multiplies it by t) and do not shard it.",
}
HINTS["d.v_proj.weight"] = HINTS["d.k_proj.weight"]
HINTS["d.self_attn.k_proj.weight"] = HINTS["d.self_attn.v_proj.weight"] = HINTS["d.k_proj.weight"]
HINTS["d.post_attention_layernorm.weight"] = HINTS["d.input_layernorm.weight"]
for _n in ("q_proj", "o_proj"):
    HINTS[f"d.{_n}.weight"] = HINTS[f"d.self_attn.{_n}.weight"] = \
        "Each rank's grad must equal its slice of the dense grad: rows of its heads for q_proj, columns for o_proj."
for _n in ("gate_proj", "up_proj", "down_proj"):
    HINTS[f"d.mlp.{_n}.weight"] = ("gate/up keep rows r*ffn/t:(r+1)*ffn/t (column-parallel), down keeps those "
                                   "columns (row-parallel); SwiGLU is elementwise, so it runs on the local slice.")


def _cfg(**kw):
    d = {"batch": 2, "seq": 6, "hidden": 32, "heads": 4, "kv_heads": 4, "ffn": 64}
    d.update(kw)
    return d


ATTENTION = [("attention", (2, 4), _cfg(), 0),
             ("attention_gqa", (2, 4), _cfg(heads=8, kv_heads=2), 1),          # t=2: 1 kv head each; t=4: copied
             ("attention_hidden", (2, 4), _cfg(batch=3, seq=7, hidden=48, heads=8, kv_heads=8), None),
             ("attention_gqa_hidden", (2, 3), _cfg(batch=1, seq=9, hidden=24, heads=6, kv_heads=3), None)]
BLOCK = [("block", (2, 4), _cfg(kv_heads=2), 2),
         ("block_hidden", (2, 4), _cfg(batch=1, seq=11, hidden=48, heads=8, kv_heads=4, ffn=96), None),
         ("block_gqa_hidden", (2, 4), _cfg(seq=5, hidden=32, heads=4, kv_heads=1, ffn=128), None)]

for name, ws, cfg, seed in ATTENTION:
    register(Case(name=f"week03/{name}", module=MODULE, world_sizes=ws, config=dict(cfg, world_sizes=list(ws)),
                  make_inputs=_inputs("attention"), reference=dense_attention, run_rank="run_attention",
                  expected=_expect_attention, contract=_contract_attention, seed=seed, hidden=seed is None,
                  rank_inputs=_own, title="TP attention", hints=HINTS))
for name, ws, cfg, seed in BLOCK:
    register(Case(name=f"week03/{name}", module=MODULE, world_sizes=ws, config=dict(cfg, world_sizes=list(ws)),
                  make_inputs=_inputs("block"), reference=dense_block, run_rank="run_block",
                  expected=_expect_block, contract=_contract_block, seed=seed, hidden=seed is None,
                  rank_inputs=_own, title="TP decoder block", hints=HINTS))
