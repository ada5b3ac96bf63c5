"""Week 5 on a rank: call the student's GatherFromSequence / ReduceScatterToSequence on this rank's sequence
block (and the per-rank summands) forward and backward; or build the dense DecoderLayer from the case's
weight seed, shard it with SPDecoderLayer.from_dense, feed it this rank's block of positions (cut by the
student's pad_and_split when T is not divisible by t) and return the output block, its input grad, this
rank's weight-grad shards and the replicated norm-weight grads; or shard a dense ForCausalLM with
SPCausalLM.from_dense, give it the whole (B, T) ids and return its logit columns and every parameter's
grad. Every tensor handed to the student's code (inputs, the dense parameters) goes through ctx.hand:
the rank entry fails the item if the code wrote into one of them. The dense layer and model, the shard
rule and the pad rule live here, and the trusted side imports them."""
from __future__ import annotations

import torch

from tpkit.models import DecoderLayer, ForCausalLM, ModelConfig, init_weights

COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")


def dense_layer(cfg, inp):
    mc = ModelConfig(hidden_size=cfg["C"], intermediate_size=cfg["F"], num_attention_heads=cfg["nh"],
                     num_key_value_heads=cfg["nkv"])
    return init_weights(DecoderLayer(mc), int(inp["wseed"][0]))


def lm_config(cfg):
    return ModelConfig(vocab_size=cfg["V"], hidden_size=cfg["C"], intermediate_size=cfg["F"],
                       num_hidden_layers=cfg["L"], num_attention_heads=cfg["nh"], num_key_value_heads=cfg["nkv"])


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


def run_sequence_ops(mod, cfg, inp, ctx):
    r = ctx.rank
    x = ctx.hand("x (GatherFromSequence)", ctx.shard(inp["x"], 1).clone()).requires_grad_(True)
    xr = ctx.hand("x (ReduceScatterToSequence)", inp["xs"][r].clone()).requires_grad_(True)
    ctx.phase("forward")
    y_gather = mod.GatherFromSequence.apply(x, ctx.group)
    y_rs = mod.ReduceScatterToSequence.apply(xr, ctx.group)
    ctx.phase("backward")
    y_gather.backward(inp["dys"][r])
    y_rs.backward(ctx.shard(inp["dy"], 1))
    return {"y_gather": y_gather, "dx_gather": x.grad, "y_reduce_scatter": y_rs, "dx_reduce_scatter": xr.grad}


def run_block(mod, cfg, inp, ctx):
    dense = dense_layer(cfg, inp)
    for n, p in dense.named_parameters():     # from_dense may read the dense layer, never write into it
        ctx.hand(f"dense.{n}", p)
    layer = mod.SPDecoderLayer.from_dense(dense, group=ctx.group)
    ctx.record_params(layer)
    out = {}
    if cfg.get("uneven"):
        x_block = mod.pad_and_split(ctx.hand("x (pad_and_split)", inp["x"]), ctx.group)
        out["x_block"] = x_block
        dy = ctx.shard(pad_seq(inp["dy"], ctx.world_size), 1)
    else:
        x_block, dy = ctx.shard(inp["x"], 1), ctx.shard(inp["dy"], 1)
    x = ctx.hand("x", x_block.detach().clone()).requires_grad_(True)
    ctx.phase("forward")
    y = layer(x)
    ctx.phase("backward")
    y.backward(dy)
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
    cross-entropy hands back)."""
    dense = dense_lm(cfg, inp)
    for n, p in dense.named_parameters():
        ctx.hand(f"dense.{n}", p)
    model = mod.SPCausalLM.from_dense(dense, group=ctx.group)
    ctx.record_params(model)
    ids = ctx.hand("input_ids", inp["ids"].clone())
    ctx.phase("forward")
    logits = model(ids)
    ctx.phase("backward")
    ctx.backward(logits, ctx.shard(inp["dy"], -1), "logits")
    params = dict(model.named_parameters())
    out = {"logits": logits}
    for n, _ in dense.named_parameters():
        p = params.get(n)
        out[f"d{n}"] = None if p is None else p.grad
    return out
