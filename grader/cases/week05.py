"""Week 5: sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2), t = 2 and 4.

Activations are (B, T, C); rank r holds positions r*T/t:(r+1)*T/t (torch.chunk along dim 1).
- sequence_ops: GatherFromSequence (AG fwd / RS bwd) and ReduceScatterToSequence (RS fwd / AG bwd).
- sp_block: the dense DecoderLayer as a TP+SP block: 2 AG + 2 RS forward; backward the mirror image
  (each AG's backward is an RS and vice versa) + one all-reduce per replicated norm-weight grad.
  Outputs, input grads, weight-grad shards and the replicated norm grads (= the dense grads on EVERY rank).
- sp_model: tpkit.models.ForCausalLM under TP+SP (lecture §8): the vocab-parallel embedding's partial lookups
  reduce-scattered to sequence blocks, L SP layers, the final norm on the block (weight grad all-reduced), an
  all-gather before the vocab-parallel LM head; logits (B, T, V/t) per rank, backward from a random dlogits.
  One step: 2L+1 all-gathers and 2L+1 reduce-scatters of (B, T, C) each way, 2L+1 norm-grad all-reduces.
- sp_block_uneven: T not divisible by t; the rule is "zero-pad at the end to a multiple of t". Causal
  attention means real positions never see the pad, and a zero dy on the pad rows leaves every gradient
  equal to the unpadded one; the reference is the dense layer run on the padded sequence.

What each rank receives (`_own_*`, Case.rank_inputs): its sequence block of x and dY (and its own summands for the
operators); pad_and_split gets the whole (B, T, C) x with every position outside its padded block NaN; the dense
DecoderLayer / ForCausalLM from_dense is handed stays whole (every submodule and parameter, the replicated norm
weights intact), but each sharded weight carries only this rank's block (q/k/v, gate/up, embed_tokens, lm_head
rows; o/down columns), the rest NaN; sp_model gets the whole (B, T) ids and its vocab columns of dlogits. No weight
seed leaves the trusted process. divisibility receives nothing (it builds its own small layers). (Fixture
dense_head_keep_columns: every logit from the kept dense LM head, then its columns, full marks when ranks were
handed everything; now the head's input grad reads the NaN rows.)

Scored: values against the trusted reference and the switchboard's record of the collectives. "note (inside the
rank, not scored)" marks what the harness measures in the student's process: said beside the verdict, no points.
Such notes everywhere: Contract.params (the names and shapes a rank reports; a rank keeping more than its shard is
caught by its values, as it receives only its own part of every dense tensor, the rest NaN), ctx.hand (an input
written into) and a replaced harness function (grader/rank/seal.py).
Rules the lab's text states -> the check that enforces it (case: tensor or contract field):
 1. GatherFromSequence: all-gather along T forward, reduce-scatter backward -> sequence_ops: `y_gather`,
    `dx_gather`, Contract.counts
 2. ReduceScatterToSequence: reduce-scatter along T forward, all-gather backward -> sequence_ops:
    `y_reduce_scatter`, `dx_reduce_scatter`, Contract.counts
 3. the collectives split dim 0: move the sequence (dim 1) to the front -> the values (fixture rs_wrong_dim)
 4. use `group` in every collective -> world_sizes (2, 4) on a 4-rank job (t=2 on ranks 2 and 3)
 5. the dense module names, each holding this rank's shard (q/k/v, gate/up rows; o, down columns) -> sp_block*:
    `dq_proj` ... `ddown_proj`, Contract.params (note)
 6. the two norm weights stay whole (replicated) -> `dinput_layernorm`, `dpost_attention_layernorm` (C,), the dense
    grad (rule 7); Contract.params (C,) (note)
 7. each norm-weight grad is all-reduced during backward -> `dinput_layernorm`, `dpost_attention_layernorm` (the
    dense grad on every rank), counts backward {all_reduce: 2} (fixture forgot_norm_allreduce)
 8. ValueError if the kv heads or the FFN width are not divisible by t -> divisibility (fixture
    no_divisibility_check)
 9. per block 2 all-gathers + 2 reduce-scatters forward, the mirror image backward, no all-reduce of activations ->
    Contract.counts, bytes_sent (fixture allreduce_then_slice)
10. the block of the diagram: norm, gather, column, attention/SwiGLU, row, reduce-scatter, residual -> `y`, `dx`
11. pad_and_split zero-pads the sequence at the end to a multiple of t and returns block r -> sp_block_uneven:
    `x_block`
12. the layer runs on the padded T = 7 on 2 and 4 ranks -> sp_block_uneven: `y`, `dx`, every grad
13. SPCausalLM keeps the dense names: embedding and lm_head rows r*V/t:(r+1)*V/t, the layers' shards, the final
    norm whole -> sp_model: `dmodel.embed_tokens.weight`, `dlm_head.weight`, every layer grad;
    Contract.params (note)
14. the embedding's partial lookups are reduce-scattered along T (not all-reduced) -> sp_model: counts forward
    {reduce_scatter: 2L+1} and no all_reduce, bytes_sent; `dmodel.embed_tokens.weight` (an all-reduce + plain slice
    keeps only the grad of this rank's block of tokens; fixture embed_allreduce_slice)
15. the layers are the SPDecoderLayers of task 2, on the sequence block -> sp_model: `logits`, every layer grad
16. the final norm runs on the sequence block; its weight grad is all-reduced -> `dmodel.norm.weight`, counts
    backward {all_reduce: 2L+1}
17. all-gather along T before the LM head, whose backward reduce-scatters -> counts forward {all_gather: 2L+1},
    backward {reduce_scatter: 2L+1}; every grad below the head (fixture head_gather_own_grad)
18. forward returns this rank's logit columns for all T positions, (B, T, V/t) -> `logits`
19. SPDecoderLayer.from_dense and SPCausalLM.from_dense leave the module they are given as it was (copy what you keep;
    the demo cells run the dense module afterwards) -> sp_block*, sp_model*, note (inside the rank, not scored):
    grader.rank.week05.check_untouched after from_dense and after backward: the same submodule names and types, the
    same parameter and buffer objects with their shapes, no new hooks on them, no .grad on them (values: ctx.hand,
    rule 20) (fixtures model_taken_apart, layer_taken_apart, norm_shared_with_caller: full marks, with the note;
    independent_sp_model: a correct SPCausalLM built from fresh modules, full marks) (new in issue 23)
20. your code may not write into the tensors it is given -> every case, note (inside the rank, not scored): ctx.hand
    on the inputs and the dense layer's parameters (see grader/rank/week02.py on upstream grads)
20 rules stated, 20 checked. 19 is new in issue 23; 20 was graded before, but the lab's text states it only since
issue 25. Now 18 are scored; 19 and 20 are notes (inside the rank, not scored).
"""
from __future__ import annotations

import torch

from grader.judge.case import Case, Contract, poisoned, register, shard
from grader.rank.week05 import COLUMN, NORMS, ROW, layer_config, lm_config
from reference import backward
from tpkit.models import DecoderLayer, ForCausalLM, init_weights

MODULE = "sp_block"
SEQ_HINT = ("Rank r's block is positions r*T/t:(r+1)*T/t (torch.chunk along dim 1). all_gather_single and "
            "reduce_scatter_single split dim 0: move the sequence (dim 1) to the front first, or you move batches.")
HINTS = {
    "y": SEQ_HINT,
    "dx": "The backward of the gather is a reduce-scatter along T (your block's grad is a sum over ranks); "
          "the backward of the reduce-scatter is an all-gather. " + SEQ_HINT,
    "x_block": "pad_and_split: zero-pad dim 1 at the END to a multiple of t, then take block r with torch.chunk.",
}
for n in NORMS:
    HINTS[f"d{n}"] = ("A replicated norm weight's grad must equal the dense grad on every rank: each rank's norm "
                      "saw only T/t positions, so all-reduce (sum) that grad over the group during backward.")
for n in COLUMN + ROW:
    HINTS[f"d{n.split('.')[-1]}"] = ("Each rank's weight grad must equal its slice of the dense weight grad: rows "
                                     "r*out/t:(r+1)*out/t for q/k/v/gate/up, the same block of columns for o/down.")


def dense_layer(cfg, inp):
    return init_weights(DecoderLayer(layer_config(cfg)), int(inp["wseed"][0]))


def dense_lm(cfg, inp):
    return init_weights(ForCausalLM(lm_config(cfg)), int(inp["wseed"][0]))


def lm_shard_dim(name: str):
    """The dim along which rank r keeps 1/t of the dense parameter `name` (None: replicated)."""
    if name.endswith(("embed_tokens.weight", "lm_head.weight")) or any(f"{c}.weight" in name for c in COLUMN):
        return 0                       # vocab rows; column-parallel output features
    if any(f"{c}.weight" in name for c in ROW):
        return 1                       # row-parallel input features
    return None                        # norm weights


def pad_seq(x, t):
    """Zero-pad dim 1 (T) at the end to a multiple of t."""
    return torch.nn.functional.pad(x, (0, 0, 0, -x.shape[1] % t))


# -- what each rank receives (only what a real TP+SP rank owns) ------------------------------------
def _own_dense(module, r, t):
    """The dense module's parameters as from_dense hands them to rank r: each sharded weight with the other ranks'
    blocks NaN, the replicated norm weights whole (the module stays whole: every submodule, every parameter)."""
    return {f"dense.{n}": p.detach().clone() if lm_shard_dim(n) is None else poisoned(p.detach(), r, t, lm_shard_dim(n))
            for n, p in module.named_parameters()}


def _own_ops(cfg, d, r, t):
    """Its sequence block of x and of dY, and its own summands (the tensor it reduce-scatters, the grad of its
    gathered output)."""
    return {"x": shard(d["x"], r, t, 1), "xs": d["xs"][r], "dys": d["dys"][r], "dy": shard(d["dy"], r, t, 1)}


def _own_block(cfg, d, r, t):
    """Its block of the (padded) sequence of x and dY; with uneven T, the x given to pad_and_split with every
    position outside that block NaN; the dense layer as `_own_dense`. No weight seed: it would rebuild the layer."""
    own = _own_dense(dense_layer(cfg, d), r, t)
    if cfg.get("uneven"):
        own["x"] = poisoned(pad_seq(d["x"], t), r, t, 1)[:, :d["x"].shape[1]]     # (B, T, C)
    else:
        own["x"] = shard(d["x"], r, t, 1)                                         # (B, T/t, C)
    own["dy"] = shard(pad_seq(d["dy"], t), r, t, 1)                               # (B, T_pad/t, C)
    return own


def _own_model(cfg, d, r, t):
    """The whole ids (a vocab-parallel embedding looks up every position), its vocab columns of dlogits, the dense
    model as `_own_dense`."""
    return {"ids": d["ids"], "dy": shard(d["dy"], r, t, -1), **_own_dense(dense_lm(cfg, d), r, t)}


# -- the two sequence operators ------------------------------------------------------------------
def _ops_inputs(cfg, gen):
    B, T, C = cfg["shape"]
    return {"x": torch.randn(B, T, C, generator=gen), "xs": torch.randn(4, B, T, C, generator=gen),
            "dys": torch.randn(4, B, T, C, generator=gen), "dy": torch.randn(B, T, C, generator=gen)}


def _ops_reference(cfg, d):
    out = {"x": d["x"], "dy": d["dy"]}
    for t in (2, 4):
        out[f"sum_xs{t}"] = d["xs"][:t].sum(0)
        out[f"sum_dys{t}"] = d["dys"][:t].sum(0)
    return out


def _ops_expected(cfg, ref, r, t):
    return {"y_gather": ref["x"], "dx_gather": shard(ref[f"sum_dys{t}"], r, t, 1),
            "y_reduce_scatter": shard(ref[f"sum_xs{t}"], r, t, 1), "dx_reduce_scatter": ref["dy"]}


def _ops_contract(cfg, t):
    B, T, C = cfg["shape"]
    n = B * T * C * 4
    return Contract(counts={"forward": {"all_gather": 1, "reduce_scatter": 1},
                            "backward": {"all_gather": 1, "reduce_scatter": 1}},
                    bytes_sent={"forward": 2 * (t - 1) / t * n, "backward": 2 * (t - 1) / t * n},
                    why={"forward": "one all-gather (GatherFromSequence) and one reduce-scatter (ReduceScatterToSequence).",
                         "backward": "the backward of an all-gather is a reduce-scatter, and vice versa."})


OPS_HINTS = {"y_gather": SEQ_HINT, "y_reduce_scatter": SEQ_HINT,
             "dx_gather": "GatherFromSequence.backward must reduce-scatter along T: every rank's dY touches your block.",
             "dx_reduce_scatter": "ReduceScatterToSequence.backward must all-gather dY along T."}

for name, shape, seed in [("sequence_ops", (2, 8, 6), 0), ("sequence_ops_hidden", (3, 12, 5), None)]:
    register(Case(name=f"week05/{name}", module=MODULE, world_sizes=(2, 4), config={"shape": list(shape)},
                  make_inputs=_ops_inputs, reference=_ops_reference, run_rank="run_sequence_ops",
                  expected=_ops_expected, contract=_ops_contract, seed=seed, hidden=seed is None, rank_inputs=_own_ops,
                  title="sequence operators", hints=OPS_HINTS))


# -- the SP block --------------------------------------------------------------------------------
def _block_inputs(cfg, gen):
    B, T, C = cfg["B"], cfg["T"], cfg["C"]
    return {"x": torch.randn(B, T, C, generator=gen), "dy": torch.randn(B, T, C, generator=gen),
            "wseed": torch.randint(0, 2**31 - 1, (1,), generator=gen)}


def _dense_run(layer, x, dy, tag=""):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    backward(y, dy)
    out = {f"y{tag}": y.detach(), f"dx{tag}": x.grad, f"xp{tag}": x.detach()}
    for name, p in layer.named_parameters():
        out[f"d{name.split('.')[-2]}{tag}"] = p.grad.clone()
    layer.zero_grad()
    return out


def _block_reference(cfg, d):
    layer = dense_layer(cfg, d)
    if not cfg.get("uneven"):
        return _dense_run(layer, d["x"], d["dy"])
    out = {}
    for t in (2, 4):       # the pad (and so the reference) depends on t
        out.update(_dense_run(layer, pad_seq(d["x"], t), pad_seq(d["dy"], t), tag=str(t)))
    return out


def _block_expected(cfg, ref, r, t):
    tag = str(t) if cfg.get("uneven") else ""
    out = {"y": shard(ref[f"y{tag}"], r, t, 1), "dx": shard(ref[f"dx{tag}"], r, t, 1)}
    if cfg.get("uneven"):
        out["x_block"] = shard(ref[f"xp{tag}"], r, t, 1)
    for name in COLUMN:
        out[f"d{name.split('.')[-1]}"] = shard(ref[f"d{name.split('.')[-1]}{tag}"], r, t, 0)
    for name in ROW:
        out[f"d{name.split('.')[-1]}"] = shard(ref[f"d{name.split('.')[-1]}{tag}"], r, t, 1)
    for name in NORMS:
        out[f"d{name}"] = ref[f"d{name}{tag}"]       # replicated: the dense grad on every rank
    return out


def _block_contract(cfg, t):
    B, C, F, hs = cfg["B"], cfg["C"], cfg["F"], cfg["C"] // cfg["nh"]
    T = cfg["T"] + (-cfg["T"] % t)
    n = B * T * C * 4                                      # one (B, T, C) float32 activation, bytes
    ring = (t - 1) / t
    params = {"input_layernorm.weight": (C,), "post_attention_layernorm.weight": (C,),
              "self_attn.q_proj.weight": (cfg["nh"] * hs // t, C), "self_attn.k_proj.weight": (cfg["nkv"] * hs // t, C),
              "self_attn.v_proj.weight": (cfg["nkv"] * hs // t, C), "self_attn.o_proj.weight": (C, cfg["nh"] * hs // t),
              "mlp.gate_proj.weight": (F // t, C), "mlp.up_proj.weight": (F // t, C), "mlp.down_proj.weight": (C, F // t)}
    return Contract(
        counts={"forward": {"all_gather": 2, "reduce_scatter": 2},
                "backward": {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 2}},
        bytes_sent={"forward": 4 * ring * n, "backward": 4 * ring * n + 2 * 2 * ring * C * 4},
        params=params,
        why={"forward": "per block: an all-gather of the normed input before each column-parallel group (q/k/v, "
                        "gate/up) and a reduce-scatter after each row-parallel GEMM (o_proj, down_proj). An "
                        "all-reduce of activations is plain TP: it leaves full (B, T, C) tensors on every rank.",
             "backward": "the backward of each all-gather is a reduce-scatter and of each reduce-scatter an "
                         "all-gather (2 + 2), plus one all-reduce of each replicated norm-weight grad (2 of C "
                         "floats): each rank's norm saw only T/t positions."})


BASE = {"B": 2, "T": 8, "C": 32, "F": 64, "nh": 8, "nkv": 4}
for name, cfg, seed in [
        ("sp_block", BASE, 5),
        ("sp_block_hidden", dict(BASE, B=3, T=12, C=24, F=48, nh=4, nkv=4), None),
        ("sp_block_uneven", dict(BASE, T=7, uneven=True), 6),
        ("sp_block_uneven_hidden", dict(BASE, B=1, T=5, C=16, F=32, nh=4, nkv=4, uneven=True), None)]:
    register(Case(name=f"week05/{name}", module=MODULE, world_sizes=(2, 4), config=cfg, make_inputs=_block_inputs,
                  reference=_block_reference, run_rank="run_block", expected=_block_expected,
                  contract=_block_contract, seed=seed, hidden=seed is None, rank_inputs=_own_block,
                  title="SPDecoderLayer", hints=HINTS))


# -- the divisibility rule the task states ---------------------------------------------------------
DIVISIBILITY = ("kv heads not divisible by t raises ValueError (1 = yes)",
                "FFN width not divisible by t raises ValueError (1 = yes)")
register(Case(name="week05/divisibility", module=MODULE, world_sizes=(2, 4), config={},
              make_inputs=lambda cfg, gen: {"unused": torch.zeros(1)}, reference=lambda cfg, inp: {},
              rank_inputs=lambda cfg, d, r, t: {}, run_rank="run_divisibility", expected=lambda cfg, ref, r, t: {k: torch.tensor(1) for k in DIVISIBILITY},
              contract=lambda cfg, t: Contract(allowed_ops=set()), seed=7, title="SPDecoderLayer divisibility",
              hints={DIVISIBILITY[0]: "The task: raise ValueError in from_dense when num_key_value_heads % t != 0 "
                                      "(a kv head cannot be split across ranks).",
                     DIVISIBILITY[1]: "The task: raise ValueError in from_dense when intermediate_size % t != 0 "
                                      "(gate/up rows and down columns must split evenly)."}))


# -- the whole model: the edges (lecture §8) -----------------------------------------------------
def _model_inputs(cfg, gen):
    B, T, V = cfg["B"], cfg["T"], cfg["V"]
    ids = torch.randint(0, V, (B, T), generator=gen)
    ids[0, 0], ids[-1, -1] = 0, V - 1                    # the first and the last vocabulary row, always
    return {"ids": ids, "dy": torch.randn(B, T, V, generator=gen),
            "wseed": torch.randint(0, 2**31 - 1, (1,), generator=gen)}


def _model_reference(cfg, d):
    model = dense_lm(cfg, d)
    logits = model(d["ids"])                             # (B, T, V)
    backward(logits, d["dy"])
    return {"logits": logits.detach(), **{f"d{n}": p.grad.clone() for n, p in model.named_parameters()}}


def _model_expected(cfg, ref, r, t):
    out = {"logits": shard(ref["logits"], r, t, -1)}    # this rank's vocab columns, every position
    for key, g in ref.items():
        if key != "logits":
            dim = lm_shard_dim(key[1:])
            out[key] = g if dim is None else shard(g, r, t, dim)
    return out


def _model_contract(cfg, t):
    B, T, C, k = cfg["B"], cfg["T"], cfg["C"], 2 * cfg["L"] + 1
    n = B * T * C * 4                                    # one (B, T, C) float32 activation, bytes
    ring = (t - 1) / t
    params = {}
    for name, p in ForCausalLM(lm_config(cfg)).named_parameters():
        shape, dim = list(p.shape), lm_shard_dim(name)
        if dim is not None:
            shape[dim] //= t
        params[name] = tuple(shape)
    return Contract(
        counts={"forward": {"all_gather": k, "reduce_scatter": k},
                "backward": {"all_gather": k, "reduce_scatter": k, "all_reduce": k}},
        bytes_sent={"forward": 2 * k * ring * n, "backward": 2 * k * ring * n + k * 2 * ring * C * 4},
        params=params,
        why={"forward": f"{k} reduce-scatters: the embedding's partial lookups into sequence blocks (an all-reduce "
                        "sends twice the bytes and leaves every position on every rank), then 1 per row-parallel "
                        f"GEMM; {k} all-gathers: 1 per column-parallel group and 1 before the LM head.",
             "backward": "each forward reduce-scatter's backward is an all-gather and each all-gather's a "
                         f"reduce-scatter ({k} + {k}), plus one all-reduce of each replicated norm-weight grad "
                         f"(2 per layer and the final norm: {k})."})


MODEL_HINTS = {
    "logits": "forward returns this rank's logit columns for ALL T positions, (B, T, V/t): all-gather the normed "
              "(B, T/t, C) along T before lm_head (GatherFromSequence). " + SEQ_HINT,
    "dmodel.embed_tokens.weight": "Rank r's embedding grad is rows r*V/t:(r+1)*V/t of the dense grad, from the tokens "
                                  "at ALL positions: reduce-scatter the partial lookups (its backward all-gathers dY). "
                                  "An all-reduce followed by a plain slice keeps only your own block's tokens.",
    "dlm_head.weight": "Rank r's lm_head grad is rows r*V/t:(r+1)*V/t of the dense grad: its input must be the "
                       "gathered (B, T, C), every position.",
    "dmodel.norm.weight": "The final norm weight is replicated and saw T/t positions per rank: all-reduce (sum) "
                          "its grad over the group during backward, as for the layers' norms.",
}
_BELOW_HEAD = (" If this and the other grads below the head are off while `logits` and `dlm_head.weight` match, "
               "the gather before the head has the wrong backward: it must reduce-scatter (sum over ranks) the "
               "head's input grad, as GatherFromSequence does.")
for _L in range(2):
    for _n in NORMS:
        MODEL_HINTS[f"dmodel.layers.{_L}.{_n}.weight"] = HINTS[f"d{_n}"] + _BELOW_HEAD
    for _n in COLUMN + ROW:
        MODEL_HINTS[f"dmodel.layers.{_L}.{_n}.weight"] = HINTS[f"d{_n.split('.')[-1]}"] + _BELOW_HEAD
for _n in ("dmodel.norm.weight", "dmodel.embed_tokens.weight"):
    MODEL_HINTS[_n] += _BELOW_HEAD

for name, cfg, seed in [
        ("sp_model", {"B": 2, "T": 8, "V": 64, "C": 32, "F": 64, "nh": 8, "nkv": 4, "L": 2}, 8),
        ("sp_model_hidden", {"B": 3, "T": 12, "V": 48, "C": 24, "F": 48, "nh": 4, "nkv": 4, "L": 1}, None)]:
    register(Case(name=f"week05/{name}", module=MODULE, world_sizes=(2, 4), config=cfg, make_inputs=_model_inputs,
                  reference=_model_reference, run_rank="run_model", expected=_model_expected,
                  contract=_model_contract, seed=seed, hidden=seed is None, rank_inputs=_own_model,
                  title="SPCausalLM", hints=MODEL_HINTS))
