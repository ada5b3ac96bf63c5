"""Week 5 on a rank: call the student's GatherFromSequence / ReduceScatterToSequence on this rank's sequence
block (and its own summands) forward and backward; or rebuild the dense DecoderLayer it is handed, shard it with
SPDecoderLayer.from_dense, feed it this rank's block of positions (cut by the student's pad_and_split when T is
not divisible by t) and return the output block, its input grad, this rank's weight-grad shards and the
replicated norm-weight grads; or rebuild the dense ForCausalLM it is handed, shard it with SPCausalLM.from_dense,
give it the whole (B, T) ids and return its logit columns and every parameter's grad.
`inp` is this rank's own (grader/cases/week05.py `_own_*`): its sequence blocks of x and dY, and the dense
module's parameters with the other ranks' blocks NaN (the norm weights whole: they are replicated); so nothing
here shards or pads.
Every tensor handed to the student's code (inputs, the dense parameters) goes through ctx.hand:
the rank entry fails the item if the code wrote into one of them; and from_dense must leave the dense
module itself as it was (its submodules, parameters, buffers and hooks; no .grad after backward), as the
lab's demo cells use it after from_dense. The module configs and the names of the sharded parameters live
here, and the trusted side imports them."""
from __future__ import annotations

import torch

from tpkit.models import DecoderLayer, ForCausalLM, ModelConfig, init_weights

COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")


def layer_config(cfg):
    return ModelConfig(hidden_size=cfg["C"], intermediate_size=cfg["F"], num_attention_heads=cfg["nh"],
                       num_key_value_heads=cfg["nkv"])


def lm_config(cfg):
    return ModelConfig(vocab_size=cfg["V"], hidden_size=cfg["C"], intermediate_size=cfg["F"],
                       num_hidden_layers=cfg["L"], num_attention_heads=cfg["nh"], num_key_value_heads=cfg["nkv"])


def handed(module: torch.nn.Module, inp) -> torch.nn.Module:
    """`module` holding the dense parameters this rank is handed (`dense.<name>`: its blocks, the rest NaN)."""
    with torch.no_grad():
        for n, p in module.named_parameters():
            p.copy_(inp[f"dense.{n}"])
    return module


def _hooks(obj) -> int:
    return sum(len(getattr(obj, h, None) or {}) for h in ("_backward_hooks", "_post_accumulate_grad_hooks",
                                                           "_forward_hooks", "_forward_pre_hooks",
                                                           "_backward_pre_hooks"))


def snapshot(module: torch.nn.Module) -> dict:
    """What from_dense may not change in the module it is given: each submodule's name, type and hooks, each
    parameter's and buffer's name, identity, shape and hooks."""
    return {"modules": {n: (type(m).__name__, _hooks(m)) for n, m in module.named_modules()},
            "tensors": {n: (t, tuple(t.shape), _hooks(t))
                        for n, t in [*module.named_parameters(), *module.named_buffers()]}}


def check_untouched(ctx, module: torch.nn.Module, before: dict, name: str, after_backward: bool = False):
    """A note naming what from_dense (or the model it built) changed in the caller's `module` (seen inside the rank:
    feedback; a change that matters shows in the values)."""
    now = snapshot(module)
    what = []
    for n in sorted(set(before["modules"]) | set(now["modules"]), key=lambda n: (len(n), n)):
        was, got = before["modules"].get(n), now["modules"].get(n)
        if was is None or got is None or was[0] != got[0]:
            what.append(f"`{n or name}` " + ("is new" if was is None else "is gone" if got is None else
                                             f"is now a {got[0]} (was a {was[0]})"))
        elif got[1] != was[1]:
            what.append(f"`{n or name}` has a hook it did not have")
    for n, (t, shape, hooks) in before["tensors"].items():
        got = now["tensors"].get(n)
        if got is None:
            what.append(f"`{n}` is gone")
        elif got[0] is not t or got[1] != shape:
            what.append(f"`{n}` is now {got[1]} (was {shape})" if got[1] != shape else f"`{n}` was replaced")
        elif got[2] != hooks:
            what.append(f"`{n}` has a hook it did not have")
        elif after_backward and getattr(t, "grad", None) is not None:
            what.append(f"`{n}` has a .grad: your model's backward reached the caller's parameter")
    what += [f"`{n}` is new" for n in now["tensors"] if n not in before["tensors"]]
    if what:
        shown = "; ".join(what[:4]) + (f" (and {len(what) - 4} more)" if len(what) > 4 else "")
        ctx.note(f"from_dense changed the {name} it was given: {shown}. It must leave that module as it was (the "
                 "caller still uses it, as the lab's demo cell does): copy what you keep (copy.deepcopy, or clone "
                 "each tensor), shard and hook your copy, never the original.")


def run_sequence_ops(mod, cfg, inp, ctx):
    x = ctx.hand("x (GatherFromSequence)", inp["x"].clone()).requires_grad_(True)        # (B, T/t, C)
    xr = ctx.hand("x (ReduceScatterToSequence)", inp["xs"].clone()).requires_grad_(True)  # (B, T, C) summand
    ctx.phase("forward")
    y_gather = mod.GatherFromSequence.apply(x, ctx.group)
    y_rs = mod.ReduceScatterToSequence.apply(xr, ctx.group)
    ctx.phase("backward")
    y_gather.backward(inp["dys"])          # this rank's summand of dY (B, T, C)
    y_rs.backward(inp["dy"])               # its block of dY (B, T/t, C)
    return {"y_gather": y_gather, "dx_gather": x.grad, "y_reduce_scatter": y_rs, "dx_reduce_scatter": xr.grad}


def run_block(mod, cfg, inp, ctx):
    dense = handed(DecoderLayer(layer_config(cfg)), inp)
    ctx.hand_module("dense", dense)
    before = snapshot(dense)
    layer = mod.SPDecoderLayer.from_dense(dense, group=ctx.group)
    check_untouched(ctx, dense, before, "DecoderLayer")
    ctx.record_params(layer)
    out = {}
    if cfg.get("uneven"):
        x_block = mod.pad_and_split(ctx.hand("x (pad_and_split)", inp["x"]), ctx.group)   # x: its real positions
        out["x_block"] = x_block
    else:
        x_block = inp["x"]
    dy = inp["dy"]                            # its block of the (padded) dY
    x = ctx.hand("x", x_block.detach().clone()).requires_grad_(True)
    ctx.phase("forward")
    y = layer(x)
    ctx.phase("backward")
    y.backward(dy)
    check_untouched(ctx, dense, before, "DecoderLayer", after_backward=True)
    params = dict(layer.named_parameters())
    out.update({"y": y, "dx": x.grad})
    for name in COLUMN + ROW + NORMS:
        p = params.get(f"{name}.weight")
        out[f"d{name.split('.')[-1]}"] = None if p is None else p.grad
    return out


def run_divisibility(mod, cfg, inp, ctx):
    """from_dense on layers t cannot split: kv heads, then the FFN width, not divisible by t. 1 = ValueError."""
    t = ctx.world_size
    out = {}
    for key, mc in (("kv heads not divisible by t raises ValueError (1 = yes)",
                     ModelConfig(hidden_size=8 * t, intermediate_size=8 * t, num_attention_heads=2 * t + 2,
                                 num_key_value_heads=t + 1)),
                    ("FFN width not divisible by t raises ValueError (1 = yes)",
                     ModelConfig(hidden_size=8 * t, intermediate_size=8 * t + 1, num_attention_heads=2 * t,
                                 num_key_value_heads=t))):
        layer = init_weights(DecoderLayer(mc), 0)
        try:
            mod.SPDecoderLayer.from_dense(layer, group=ctx.group)
            raised = 0
        except ValueError:
            raised = 1
        out[key] = torch.tensor(raised)
    return out


def run_model(mod, cfg, inp, ctx):
    """SPCausalLM.from_dense on the dense ForCausalLM, the whole (B, T) ids on every rank, this rank's
    logit columns back; backward from this rank's columns of a random dlogits (what a vocab-parallel
    cross-entropy hands back, and all the rank receives of it)."""
    dense = handed(ForCausalLM(lm_config(cfg)), inp)
    ctx.hand_module("dense", dense)
    before = snapshot(dense)
    model = mod.SPCausalLM.from_dense(dense, group=ctx.group)
    check_untouched(ctx, dense, before, "ForCausalLM")
    ctx.record_params(model)
    ids = ctx.hand("input_ids", inp["ids"].clone())
    ctx.phase("forward")
    logits = model(ids)
    ctx.phase("backward")
    ctx.backward(logits, inp["dy"], "logits")
    check_untouched(ctx, dense, before, "ForCausalLM", after_backward=True)
    params = dict(model.named_parameters())
    out = {"logits": logits}
    for n, _ in dense.named_parameters():
        p = params.get(n)
        out[f"d{n}"] = None if p is None else p.grad
    return out
