"""Week 7 on a rank: build the dense course model (a DecoderLayer, or the whole ForCausalLM) from the weights
this rank is handed (only its own part of each; the rest NaN: grader/cases/week07.py `_own`), apply the
student's block_plan / model_plan with parallelize_module(..., src_data_rank=None) (each rank splits its own
copy; the default would scatter rank 0's) on a 1-D "tp" mesh over the case's group, check that every linear
got sharded, run forward + backward (loss parallel for the full model, after the student's pad_for_sp in the
padding cases) with the DTensor collectives on the ledger, and return this rank's output, loss or logits
slice and every parameter's local grad. For fsdp_tp: a (dp, tp) mesh, the TP plan then the student's
apply_fsdp, a few SGD steps on this rank's micro-batch, and the losses and a few final full weights, and how
many fully_shard units sit on the decoder layers, on the root and elsewhere."""
from __future__ import annotations

import os

import torch

from tpkit.models import DecoderLayer, ForCausalLM, week07_config


def _warm_imports():
    """Rank processes only: pay DTensor's lazy imports (torch._dynamo, ...) when this module is imported, let DTensor
    take its output metadata from meta tensors (grader/rank/dtensor_meta.py) and its sharding decisions from the
    job's tables (grader/rank/dtensor_table.py), where the grader gave it some.

    The rank entry must import this module before it arms the item timeout: a lazy import interrupted by
    that alarm would leave torch._dynamo half-initialised for every later item.
    """
    import torch._dynamo
    import torch.distributed.fsdp
    import torch.distributed.tensor
    import torch.distributed.tensor.debug
    import torch.distributed.tensor.parallel  # noqa: F401

    from grader.rank import dtensor_meta, dtensor_table
    dtensor_meta.install()
    dtensor_table.install_from_env()


if os.environ.get("COURSE_JOB_ID"):   # not in the trusted process, which imports CHECKED_PARAMS from here
    _warm_imports()

FSDP_LAYERS = "decoder layers wrapped by fully_shard"
FSDP_ROOT = "root model wrapped by fully_shard (1 = yes)"
FSDP_OTHER = "other modules wrapped by fully_shard"
PADDED_IDS, PADDED_LABELS = "pad_for_sp ids", "pad_for_sp labels"
CHECKED_PARAMS = ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                  "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight", "lm_head.weight")
KWARGS_HINT = ("DecoderLayer calls `self.self_attn(hidden_states=..., position_ids=...)` with keyword arguments, "
               "so a PrepareModuleInput for `self_attn` must describe them with input_kwarg_layouts= and "
               "desired_input_kwarg_layouts= ({'hidden_states': ...}); input_layouts only covers positional ones.")
MIXED_HINT = ("A DTensor met a plain tensor: some layer of the plan is missing or misspelled (parallelize_module only "
              "warns about a key that matches nothing), or a style returns a DTensor where a local tensor is expected.")


def _cfg(cfg):
    return week07_config(**cfg["model"])


def load_dense(model: torch.nn.Module, inp: dict) -> torch.nn.Module:
    """`model` holding the weights `w.<name>` of `inp` (on a rank: its own parts, the rest NaN)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(inp[f"w.{n}"])
    return model


def _split_locally():
    """distribute_tensor's default src_data_rank=0 scatters rank 0's copy of a tensor, which is right where every rank
    made the same copy, as on any machine. Here each rank holds only its own shards (the rest NaN), so the default
    becomes None, as parallelize_module is called: each rank splits its own copy, and a plan (or a partition function
    written by hand with the default) gets exactly the shards rank 0's scatter of the dense model would give."""
    from torch.distributed.tensor import _api
    _api.distribute_tensor.__kwdefaults__["src_data_rank"] = None


def _apply_plans(mod, model, mesh, whole_model: bool):
    from torch.distributed.tensor.parallel import parallelize_module
    _split_locally()
    layers = model.model.layers if whole_model else [model]
    for layer in layers:
        parallelize_module(layer, mesh, mod.block_plan(), src_data_rank=None)
    if whole_model:
        parallelize_module(model, mesh, mod.model_plan(), src_data_rank=None)


def _record(ctx, model):
    from tpkit.dtensor import local_shape
    for n, p in model.named_parameters():
        ctx.params[n] = local_shape(p)


def _require_sharded(model):
    from tpkit.dtensor import unsharded_linears
    unsharded = unsharded_linears(model)
    if unsharded:
        held = ", ".join(f"`{n}` (weight {tuple(model.get_submodule(n).weight.shape)} on every rank)" for n in unsharded)
        raise RuntimeError(f"not sharded: {held}. No plan key matched these layers, so they stay replicated "
                           f"(parallelize_module only warns about a key that matches nothing): check the spelling "
                           f"of the plan keys against model.named_modules().")


def _explain(exc: BaseException):
    msg = str(exc)
    if "input_layouts should have same length" in msg:
        raise RuntimeError(f"PrepareModuleInput got no positional input: {KWARGS_HINT}") from None
    if "mixed torch.Tensor and DTensor" in msg:
        raise RuntimeError(f"{msg.splitlines()[0]}\n{MIXED_HINT}") from None
    raise exc


def _forward_backward(model, ids, labels, ctx):
    """Logits and loss of the TP model, loss parallel over the vocab-sharded logits, and the backward."""
    from torch.distributed.tensor.parallel import loss_parallel
    ctx.phase("forward")
    logits = model(ids)                                 # (B, T, V), a DTensor sharded on V by the plan
    with loss_parallel():
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        ctx.phase("backward")
        loss.backward()
    return logits, loss


def run_plan(mod, cfg, inp, ctx):
    import warnings

    from torch.distributed.tensor import DTensor

    from tpkit.dtensor import local_grad, tp_mesh_for

    mc = _cfg(cfg)
    mesh = tp_mesh_for(ctx.group, ctx.device.type)
    block = cfg["kind"] == "block"
    model = load_dense(DecoderLayer(mc) if block else ForCausalLM(mc), inp).to(ctx.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")            # a misspelled key only warns: the shape check names it
        _apply_plans(mod, model, mesh, whole_model=not block)
    _record(ctx, model)
    _require_sharded(model)
    out = {}
    try:
        if block:
            x = ctx.hand("x", inp["x"].clone()).requires_grad_(True)   # (B, T/t, C): its SP shard
            ctx.phase("forward")
            y = model(x)
            y = y.to_local() if isinstance(y, DTensor) else y           # (B, T/t, C)
            ctx.phase("backward")
            y.backward(inp["dy"])
            out = {"y": y, "dx": x.grad}
        else:
            ids, labels = ctx.hand("input_ids", inp["input_ids"]), ctx.hand("labels", inp["labels"])
            T = ids.shape[1]
            if cfg["kind"] == "padding":
                ids, labels = mod.pad_for_sp(ids, labels, ctx.world_size)
                if not (isinstance(ids, torch.Tensor) and isinstance(labels, torch.Tensor)) or \
                        ids.shape[1] % ctx.world_size or labels.shape != ids.shape or ids.shape[1] < T:
                    raise ValueError(f"pad_for_sp returned ids {tuple(getattr(ids, 'shape', ()))} and labels "
                                     f"{tuple(getattr(labels, 'shape', ()))} for T={T}, t={ctx.world_size}: both "
                                     f"must be (B, T') with T' >= T and T' % t == 0, or DTensor SP aborts on gloo.")
                out[PADDED_IDS], out[PADDED_LABELS] = ids.detach().clone(), labels.detach().clone()
            logits, loss = _forward_backward(model, ids, labels, ctx)
            out["loss"] = (loss.to_local() if isinstance(loss, DTensor) else loss).detach()
            if cfg["kind"] == "model":
                out["logits"] = (logits.to_local() if isinstance(logits, DTensor) else logits).detach()
    except Exception as exc:                          # noqa: BLE001
        _explain(exc)
    ctx.phase("harness")                              # reducing Partial grads of replicated norms: the grader's
    for n, p in model.named_parameters():
        out[f"grad:{n}"] = local_grad(p)
    return out


def run_fsdp_tp(mod, cfg, inp, ctx):
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from tpkit.dtensor import quiet_redistribute_warnings

    mc = _cfg(cfg)
    dp, tp = cfg["dp"], ctx.world_size // cfg["dp"]
    mesh = init_device_mesh(ctx.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    model = load_dense(ForCausalLM(mc), inp).to(ctx.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _apply_plans(mod, model, mesh["tp"], whole_model=True)
        _require_sharded(model)
        mod.apply_fsdp(model, mesh["dp"])
    _record(ctx, model)
    from torch.distributed.fsdp import FSDPModule
    on_layers = sum(isinstance(layer, FSDPModule) for layer in model.model.layers)
    on_root = int(isinstance(model, FSDPModule))
    elsewhere = sum(isinstance(m, FSDPModule) for m in model.modules()) - on_layers - on_root
    ids, labels = inp["input_ids"], inp["labels"]                       # this dp rank's micro-batch
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    losses = []
    for _ in range(cfg["steps"]):
        _, loss = _forward_backward(model, ids, labels, ctx)
        ctx.phase("step")
        opt.step()
        opt.zero_grad()
        local = (loss.to_local() if isinstance(loss, DTensor) else loss).detach().clone()
        dist.all_reduce(local, group=mesh["dp"].get_group())                # mean over the dp micro-batches
        losses.append(local / dp)
    ctx.phase("gather")
    out = {"losses": torch.stack(losses), FSDP_LAYERS: torch.tensor([on_layers]), FSDP_ROOT: torch.tensor([on_root]),
           FSDP_OTHER: torch.tensor([elsewhere])}
    with quiet_redistribute_warnings():             # a few final weights: step 2's gradients, each kind of style
        for n, p in model.named_parameters():
            if n in CHECKED_PARAMS:
                out[f"param:{n}"] = (p.full_tensor() if isinstance(p, DTensor) else p).detach()
    return out
