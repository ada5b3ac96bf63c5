"""Week 7: a DTensor TP + SP plan for the course model (`tpkit.models`), graded on t = 2 and 4.

The student writes plans (module path -> ParallelStyle); the harness applies them with
`parallelize_module` to a pure dense model, runs forward + backward (loss parallel for the full model)
and compares with the dense model run here, in the trusted process.

What each rank receives (`_own`): the dense model's weights with only this rank's part of each: its Shard(0)
rows of q/k/v/gate/up/lm_head/embed_tokens, its Shard(1) columns of o_proj/down_proj, every other entry NaN;
the replicated norm weights whole. Under FSDP2 x TP (fsdp_tp) only its dim-0 FSDP chunk of that TP part
(the rest NaN, the norms too), as fully_shard keeps it. Activations: the block gets its sequence shard of X and
dY (B, T/t, C), as sequence parallelism leaves them; the model gets the replicated (B, T) ids and labels, and
fsdp_tp its data-parallel micro-batch of them. The weights (and the seed they come from) stay here.
Why the harness calls parallelize_module(..., src_data_rank=None): with the default src_data_rank=0, every
style's distribute_tensor scatters rank 0's copy of each weight (torch/distributed/tensor/_api.py), so rank 0
would have to hold every rank's shards and the other ranks' copies would go unread; with None each rank
splits its own copy locally, and a plan gets exactly the shards that rank 0's scatter of the dense model gives
(the same torch.chunk blocks). fully_shard always splits the local copy (no broadcast). A partition function the
student writes by hand with distribute_tensor's default gets the same: the rank's default is None too
(grader/rank/week07._split_locally; fixture custom_partition_default_src, full marks).
A plan that leaves a weight whole, or shards it along the other dimension, computes with NaN.

Collectives per direction with TP + SP (Korthikanti et al. 2022, Sec. 4.2.2): each of the two
sub-blocks of a layer enters its TP region with an all-gather of the sequence shards and leaves it
with a reduce-scatter; backward swaps them. The embedding leaves with a reduce-scatter, the head
enters with an all-gather, and vocab-parallel cross-entropy adds three all-reduces of (B*T) scalars
(max, sum-exp, target logit) in forward and none in backward.

Scored: values against the trusted reference and the switchboard's record of the collectives. "note (inside the
rank, not scored)" marks what the harness measures in the student's process: said beside the verdict, no points.
Such notes everywhere: Contract.params (the names and shapes a rank reports; a rank keeping more than its shard is
caught by its values, as it receives only its own part of every dense tensor, the rest NaN), ctx.hand (an input
written into) and a replaced harness function (grader/rank/seal.py).
Rules the lab's text states -> the check that enforces it (case: tensor or contract field):
 1. both RMSNorms run on the local tokens with a replicated weight (SequenceParallel) -> block, model:
    `grad:*layernorm.weight`, Contract.params (note) (fixture norm_not_sp)
 2. attention and the MLP all-gather their Shard(1) input to Replicate first (PrepareModuleInput) ->
    Contract.counts forward {all_gather: 2 per layer}, `y`; and hand the projections a DTensor, so backward
    reduce-scatters -> Contract.counts backward (fixture prepare_input_local)
 3. self_attn is called with keywords: input_kwarg_layouts / desired_input_kwarg_layouts -> every case: the
    error is named (fixture forgot_kwargs)
 4. q/k/v_proj, gate/up_proj column-parallel -> `grad:*` (a weight left whole computes with NaN), Contract.params
    (local Shard(0) shapes) (note)
 5. o_proj, down_proj row-parallel, leaving with a reduce-scatter to Shard(1) -> Contract.params (Shard(1)) (note),
    counts {reduce_scatter: 2 per layer}, `y` as this rank's tokens
 6. a misspelled key leaves a layer whole: the checker names it -> every case: local shapes checked before the
    run, and the layer left whole computes with NaN (fixture plan_typo)
 7. embed_tokens: row-wise on the (V, C) table, replicated ids in, sequence shards out (a reduce-scatter) ->
    model: Contract.params (note), counts forward {reduce_scatter: 2L + 1}
 8. model.norm sequence-parallel -> model: `grad:model.norm.weight`
 9. lm_head column-parallel on the vocabulary, Shard(1) in, a vocab-sharded DTensor out for loss_parallel ->
    model: `logits` (this rank's vocab slice), `loss`, counts forward {all_gather: 2L + 1, all_reduce: 3}
10. never gather the (B, T, V) logits -> Contract.counts (an extra all-gather is counted)
11. styles only, no hand-written collectives -> Contract.counts, exact per direction
12. pad_for_sp pads on the right -> padding: `loss`, `grad:*` (a left pad changes the causal loss)
13. ... to the next multiple of t -> padding: `pad_for_sp ids`, `pad_for_sp labels` shapes (new: before, any
    T' >= T with T' % t == 0 passed)
14. ... the ids with 0 -> padding: `pad_for_sp ids` (new; fixture pad_ids_nonzero)
15. ... the labels with ignore_index (-100), so the loss and every grad equal the unpadded model's -> padding:
    `pad_for_sp labels`, `loss`, `grad:*`
16. apply_fsdp: fully_shard on each decoder layer, then on the root -> fsdp_tp: `reduce-scatters over the dp group
    in all steps, from the switchboard's record` = steps x (layers + 1): FSDP2 reduce-scatters each unit's grads
    once per step over the dp group, so one unit per decoder layer plus the root, no other (fixture
    fsdp_root_only: 2 of 6); the unit counts the rank reports (`decoder layers wrapped by fully_shard`, `root model
    wrapped by fully_shard (1 = yes)`, `other modules wrapped by fully_shard`): note (inside the rank, not scored)
17. every rank then stores 1/4 of each matrix -> fsdp_tp: `param:*` from ranks handed only their FSDP chunk of their
    TP part (the rest NaN); Contract.params (dp x tp local shapes) (note)
18. two SGD steps give the dense model's losses and final weights -> fsdp_tp: `losses`, `param:*`
18 rules stated; 15 checked before this issue (13, 14 and 16 were not), 18 checked now (rule 16 by the record since
the unit counts became notes).
Course-wide rule (not in this lab's text): code may not write into the tensors it is given -> note (inside the rank,
not scored): ctx.hand on the inputs, and the ids and labels handed to pad_for_sp.
Course-wide rule: a rank holds only what its rank owns -> every case: `_own` (fixture embedding_colwise).
"""
from __future__ import annotations

import math

import torch

from grader.judge.case import Case, Contract, register, shard
from grader.rank.week07 import (
    CHECKED_PARAMS,
    FSDP_LAYERS,
    FSDP_OTHER,
    FSDP_ROOT,
    PADDED_IDS,
    PADDED_LABELS,
    load_dense,
)
from reference import backward
from tpkit.models import DecoderLayer, ForCausalLM, init_weights, week07_config

MODULE = "tp_plan"
COL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head", "embed_tokens")   # Shard(0) of the weight
ROW = ("o_proj", "down_proj")                                                               # Shard(1) of the weight

def _cfg(cfg):
    return week07_config(**cfg["model"])


def _shard_dim(name: str):
    leaf = name.split(".")[-2] if name.endswith(".weight") else ""
    if leaf in COL:
        return 0
    if leaf in ROW:
        return 1
    return None          # norms: replicated, every rank's grad is the whole dense grad


def _expected_shape(name, shape, t):
    d = _shard_dim(name)
    shape = list(shape)
    if d is not None:
        shape[d] //= t
    return tuple(shape)


def _dense(cfg):
    return DecoderLayer(_cfg(cfg)) if cfg["kind"] == "block" else ForCausalLM(_cfg(cfg))


# -- inputs, what each rank receives, references (trusted process) ------------------
def _inputs(cfg, gen):
    mc = _cfg(cfg)
    B, T = cfg["B"], cfg["T"]
    dense = init_weights(_dense(cfg), int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    d = {f"w.{n}": p.detach().clone() for n, p in dense.named_parameters()}
    if cfg["kind"] == "block":
        d["x"] = torch.randn(B, T, mc.hidden_size, generator=gen)
        d["dy"] = torch.randn(B, T, mc.hidden_size, generator=gen)
    else:
        d["input_ids"] = torch.randint(0, mc.vocab_size, (cfg["dp"] * B if "dp" in cfg else B, T), generator=gen)
        d["labels"] = torch.randint(0, mc.vocab_size, d["input_ids"].shape, generator=gen)
    return d


def _keep(w: torch.Tensor, blocks) -> torch.Tensor:
    """`w` NaN outside one nested block: each (dim, i, n) of `blocks` takes the i-th torch.chunk of n along dim
    of the block before it (TP's Shard, then FSDP2's dim-0 chunk of the local shard)."""
    out = torch.full_like(w, float("nan"))
    src, dst = w, out
    for dim, i, n in blocks:
        sizes = [c.shape[dim] for c in src.chunk(n, dim=dim)] + [0] * n    # a chunk past the end is empty
        src, dst = (x.narrow(dim, sum(sizes[:i]), sizes[i]) for x in (src, dst))
    dst.copy_(src)
    return out


def _own(cfg, d, r, t):
    """Rank r's view: its part of each weight (the rest NaN), its sequence shard of the block's X and dY, the
    model's ids and labels whole (its dp micro-batch under fsdp_tp)."""
    dp = cfg.get("dp", 1)
    tp, tp_r, dp_r = t // dp, r % (t // dp), r // (t // dp)     # the (dp, tp) mesh holds ranks row-major
    own = {}
    for k, w in d.items():
        if k.startswith("w."):
            tp_dim = _shard_dim(k[2:])
            blocks = ([] if tp_dim is None else [(tp_dim, tp_r, tp)]) + ([(0, dp_r, dp)] if dp > 1 else [])
            own[k] = _keep(w, blocks)
        elif k in ("x", "dy"):
            own[k] = shard(w, r, t, 1)                          # (B, T/t, C): sequence parallel
        else:
            own[k] = w.chunk(dp)[dp_r].contiguous()              # ids, labels: (B, T), this dp rank's rows
    return own


def _reference(cfg, inp):
    if cfg["kind"] == "block":
        layer = load_dense(_dense(cfg), inp)
        x = inp["x"].clone().requires_grad_(True)
        y = layer(x)
        backward(y, inp["dy"])
        out = {"y": y.detach(), "dx": x.grad}
        out.update({f"grad:{n}": p.grad for n, p in layer.named_parameters()})
        return out
    model = load_dense(_dense(cfg), inp)
    if cfg["kind"] == "fsdp_tp":
        losses = []
        for _ in range(cfg["steps"]):
            logits = model(inp["input_ids"])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), inp["labels"].flatten())
            loss.backward()
            with torch.no_grad():       # plain SGD, w -= lr * grad: torch.optim would import torch._dynamo (~1 s)
                for p in model.parameters():
                    p.add_(p.grad, alpha=-cfg["lr"])
                    p.grad = None
            losses.append(loss.detach())
        out = {"losses": torch.stack(losses)}
        out.update({f"param:{n}": p.detach().clone() for n, p in model.named_parameters() if n in CHECKED_PARAMS})
        return out
    logits = model(inp["input_ids"])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), inp["labels"].flatten())
    loss.backward()
    out = {"loss": loss.detach(), "logits": logits.detach()}
    out.update({f"grad:{n}": p.grad for n, p in model.named_parameters()})
    if cfg["kind"] == "padding":
        out["input:ids"], out["input:labels"] = inp["input_ids"], inp["labels"]
    return out


def _padded(x, t, value):
    """The task's padding rule: on the right, to the next multiple of t."""
    return torch.nn.functional.pad(x, (0, (-x.shape[1]) % t), value=value)


def _expected(cfg, ref, r, t):
    out = {}
    for k, v in ref.items():
        if k.startswith("grad:"):
            d = _shard_dim(k[5:])
            out[k] = v if d is None else v.chunk(t, dim=d)[r].contiguous()
        elif k in ("y", "dx"):
            out[k] = v.chunk(t, dim=1)[r].contiguous()         # sequence-parallel: this rank's tokens
        elif k == "logits":
            if cfg["kind"] == "model":
                out[k] = v.chunk(t, dim=-1)[r].contiguous()    # loss parallel: this rank's vocab slice
        elif k == "input:ids":
            out[PADDED_IDS] = _padded(v, t, 0)
        elif k == "input:labels":
            out[PADDED_LABELS] = _padded(v, t, -100)
        else:
            out[k] = v
    if cfg["kind"] == "fsdp_tp":
        out.update({FSDP_LAYERS: torch.tensor([_cfg(cfg).num_hidden_layers]), FSDP_ROOT: torch.tensor([1]),
                    FSDP_OTHER: torch.tensor([0]),
                    FSDP_UNITS: torch.tensor([cfg["steps"] * (_cfg(cfg).num_hidden_layers + 1)])})
    return out


LOCAL_HINT = ("An all-reduce in backward usually means a PrepareModuleInput with use_local_output=True: the "
              "projections then get a plain tensor, and autograd all-reduces each one's input grad.")


def _contract(cfg, t):
    mc = _cfg(cfg)
    params = {n: _expected_shape(n, p.shape, t) for n, p in _dense(cfg).named_parameters()}
    L = mc.num_hidden_layers
    if cfg["kind"] == "block":
        fwd = bwd = {"all_gather": 2, "reduce_scatter": 2}
        why = {"forward": "per layer: all-gather the sequence shards into attention and into the MLP (2), "
                          "reduce-scatter out of o_proj and down_proj (2).",
               "backward": "the conjugates: each forward all-gather becomes a reduce-scatter and vice versa. "
                           + LOCAL_HINT}
    else:
        fwd = {"all_gather": 2 * L + 1, "reduce_scatter": 2 * L + 1, "all_reduce": 3}
        bwd = {"all_gather": 2 * L + 1, "reduce_scatter": 2 * L + 1}
        why = {"forward": f"2 all-gathers + 2 reduce-scatters per layer ({L} layers), one reduce-scatter out of "
                          f"the embedding, one all-gather into lm_head, and 3 all-reduces of loss parallel.",
               "backward": "the conjugates of the forward gathers/scatters; loss parallel's backward is local. "
                           + LOCAL_HINT}
    return Contract(counts={"forward": fwd, "backward": bwd}, params=params, why=why, unchecked=("harness",))


FSDP_UNITS = ("reduce-scatters over the dp group in all steps, from the switchboard's record (one per fully_shard "
              "unit per step)")


def _fsdp_units(cfg, record: list, r: int, t: int) -> dict:
    """FSDP2 reduce-scatters each unit's gradients once per backward, on the dp group: counted outside the rank. The
    (dp, tp) mesh puts rank r's dp group at the places congruent to r mod tp."""
    tp = t // cfg["dp"]
    on_dp = [e for e in record if e.get("op") == "reduce_scatter" and len(e.get("members", [])) == cfg["dp"]
             and all(m % tp == r % tp for m in e["members"])]
    return {FSDP_UNITS: torch.tensor([len(on_dp)])}


def _contract_2d(cfg, t):
    mc = _cfg(cfg)
    dp, tp = cfg["dp"], t // cfg["dp"]
    params = {}
    for n, p in ForCausalLM(mc).named_parameters():
        shape = list(_expected_shape(n, p.shape, tp))
        shape[0] = math.ceil(shape[0] / dp)                   # FSDP2 shards dim 0 of the local TP shard
        params[n] = tuple(shape)
    return Contract(params=params)


HINTS = {
    "y": "Check the block plan: o_proj and down_proj must leave with output_layouts=Shard(1) (sequence "
         "shards), and self_attn / mlp must all-gather their Shard(1) input to Replicate first.",
    "dx": "The input grad is wrong although it went through your plan: a norm without SequenceParallel or "
          "a missing PrepareModuleInput changes what autograd reduces.",
    "loss": "The loss needs loss_parallel: lm_head must keep its vocab-sharded output as a DTensor "
            "(use_local_output=False) with input_layouts=Shard(1) from the sequence-parallel final norm.",
    "logits": "Each rank's logits must be its vocab slice (ColwiseParallel on lm_head, output Shard(-1)).",
    "losses": "The 2-D step must match one dense SGD step on the full batch: shard each decoder layer and "
              "then the root with fully_shard(..., mesh=dp_mesh) after the TP plan.",
    PADDED_IDS: "pad_for_sp pads on the right to the next multiple of t, the ids with 0.",
    PADDED_LABELS: "pad_for_sp pads on the right to the next multiple of t, the labels with ignore_index (-100), "
                   "so the loss ignores the padded positions.",
    FSDP_LAYERS: ("apply_fsdp must make one fully_shard unit per decoder layer (fully_shard(layer, mesh=dp_mesh) for "
                  "each layer of model.model.layers), then one for the root: a root-only unit gives the same numbers "
                  "but gathers every weight of the model at once."),
    FSDP_ROOT: "apply_fsdp must end with fully_shard(model, mesh=dp_mesh) on the root (embedding, final norm, lm_head).",
    FSDP_UNITS: ("apply_fsdp must make one fully_shard unit per decoder layer and one for the root, no other: each unit "
                 "reduce-scatters its gradients once per step over the dp group. Fewer: units missing (a root-only "
                 "unit gathers every weight of the model at once); more: units on single linears or norms."),
    FSDP_OTHER: "One fully_shard unit per decoder layer plus the root, and no other (not per linear or per norm).",
}
NORM_HINT = ("A replicated norm weight sees only this rank's tokens under SP: wrap the norm in SequenceParallel() "
             "so its grad is summed over the sequence shards.")


def _hints(cfg):
    """Per-tensor hints: norms get the SP reduction hint, every sharded weight the slicing rule."""
    h = dict(HINTS)
    for n, _ in _dense(cfg).named_parameters():
        d = _shard_dim(n)
        h[f"grad:{n}"] = (NORM_HINT if d is None else
                          f"Each rank's grad must be its Shard({d}) slice of the dense weight grad; a wrong value "
                          f"with right shapes usually means a missing SequenceParallel/PrepareModuleInput upstream.")
    return h


for name, cfg, seed in [
        ("block", {"kind": "block", "B": 2, "T": 8, "model": {}}, 0),
        ("block_hidden", {"kind": "block", "B": 1, "T": 12, "model": {"hidden_size": 48, "intermediate_size": 32}}, None),
        ("model", {"kind": "model", "B": 2, "T": 8, "model": {}}, 1),
        ("model_hidden", {"kind": "model", "B": 1, "T": 12, "model": {"num_hidden_layers": 1, "vocab_size": 32}}, None),
        ("padding", {"kind": "padding", "B": 2, "T": 7, "model": {"num_hidden_layers": 1}}, 2),
        ("padding_hidden", {"kind": "padding", "B": 1, "T": 9, "model": {"vocab_size": 32, "num_hidden_layers": 1}}, None)]:
    register(Case(name=f"week07/{name}", module=MODULE, world_sizes=(2, 4), config=cfg, make_inputs=_inputs,
                  reference=_reference, run_rank="run_plan", expected=_expected, contract=_contract, seed=seed,
                  hidden=seed is None, rank_inputs=_own, hints=_hints(cfg),
                  title={"block": "TP+SP block plan", "model": "full-model plan + loss parallel",
                         "padding": "SP padding"}[cfg["kind"]]))

for name, cfg, seed in [
        ("fsdp_tp", {"kind": "fsdp_tp", "B": 2, "T": 8, "dp": 2, "steps": 2, "lr": 0.5, "model": {}}, 3),
        ("fsdp_tp_hidden", {"kind": "fsdp_tp", "B": 1, "T": 6, "dp": 2, "steps": 2, "lr": 0.3,
                            "model": {"num_hidden_layers": 1}}, None)]:
    register(Case(name=f"week07/{name}", module=MODULE, world_sizes=(4,), config=cfg, make_inputs=_inputs,
                  reference=_reference, run_rank="run_fsdp_tp", expected=_expected, contract=_contract_2d,
                  from_record=_fsdp_units, feedback=(FSDP_LAYERS, FSDP_ROOT, FSDP_OTHER),
                  seed=seed, hidden=seed is None, rank_inputs=_own, title="FSDP2 x TP training steps (dp=2, tp=2)",
                  hints=_hints(cfg)))
