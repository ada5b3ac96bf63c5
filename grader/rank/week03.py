"""Week 3 on a rank: rebuild the dense tpkit.models Attention (or DecoderLayer) from the weights this rank
is handed (only its own parts; the rest NaN: grader/cases/week03.py `_own`), shard it with the student's
TPAttention.from_dense (or TPDecoderLayer.from_dense) on the case's group, run forward and backward on the
full, replicated input and return the output, the input grad and this rank's weight grads (their shard of
each sharded weight, the whole grad of each replicated norm). Every tensor handed to the student's code
(the dense module's parameters, the input) goes through ctx.hand: the rank entry fails the item if the code
wrote into one of them."""
from __future__ import annotations

import torch

from tpkit.models import Attention, DecoderLayer, ModelConfig

ATTN_PARAMS = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"]
BLOCK_PARAMS = ["input_layernorm.weight", "post_attention_layernorm.weight"] + \
    [f"self_attn.{n}" for n in ATTN_PARAMS] + [f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]


def _dense(kind: str, cfg: dict, inp: dict) -> torch.nn.Module:
    """The dense module with the case's weights (names as in tpkit.models, prefix `w.`)."""
    mc = ModelConfig(hidden_size=cfg["hidden"], intermediate_size=cfg.get("ffn", 4 * cfg["hidden"]),
                     num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"])
    m = Attention(mc) if kind == "attention" else DecoderLayer(mc)
    m.load_state_dict({k[2:]: v for k, v in inp.items() if k.startswith("w.")})
    return m


def _grads(module, names):
    params = dict(module.named_parameters())
    return {f"d.{n}": (params[n].grad if n in params else None) for n in names}


def _run(kind, mod, cfg, inp, ctx):
    cls = mod.TPAttention if kind == "attention" else mod.TPDecoderLayer
    dense = _dense(kind, cfg, inp)
    ctx.hand_module("dense", dense)
    layer = cls.from_dense(dense, group=ctx.group)
    ctx.record_params(layer)
    x = ctx.hand("hidden_states", inp["x"].clone()).requires_grad_(True)
    ctx.phase("forward")
    y = layer(x)
    ctx.phase("backward")
    y.backward(inp["dy"])
    return {"y": y, "dx": x.grad, **_grads(layer, ATTN_PARAMS if kind == "attention" else BLOCK_PARAMS)}


def run_attention(mod, cfg, inp, ctx):
    return _run("attention", mod, cfg, inp, ctx)


def run_block(mod, cfg, inp, ctx):
    return _run("block", mod, cfg, inp, ctx)
