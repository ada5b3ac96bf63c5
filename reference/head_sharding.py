"""Head sharding for TP attention (Week 3): which heads a rank holds, and the dense references the grader uses.

Computed in the trusted process from the dense module (tpkit.models), never from a
student's shards. Head sharding (Megatron-LM, Shoeybi et al. 2019, Sec. 3): rank r of t
owns query heads [r nh/t, (r+1) nh/t) and the key/value heads those queries read.

With grouped-query attention (nh/nkv query heads share one kv head) a kv head may be
needed by several ranks (nkv < t, or a group boundary inside a rank's block of query
heads). Each such rank keeps a *copy* of that kv head's k/v rows. Its k/v weight grad
is then the *partial* grad coming from its own query heads only; the dense grad is the
sum of the partials over the ranks sharing the head (a weight-grad sync, once per step,
outside the block's forward/backward: the same job as syncing replicated norm weights
under sequence parallelism, Week 5). `attention_partial_grads` computes those partials
independently: it masks the other ranks' heads out of the dense o_proj input.
"""
from __future__ import annotations

import torch

from reference import backward
from tpkit.models import Attention, DecoderLayer, ModelConfig


def kv_heads_of_rank(num_heads: int, num_kv_heads: int, rank: int, world: int) -> tuple[int, int]:
    """[first, end) of the kv heads read by rank r's query heads [r nh/t, (r+1) nh/t)."""
    per_rank, group = num_heads // world, num_heads // num_kv_heads
    return rank * per_rank // group, ((rank + 1) * per_rank - 1) // group + 1


def model_config(cfg: dict) -> ModelConfig:
    return ModelConfig(hidden_size=cfg["hidden"], intermediate_size=cfg.get("ffn", 4 * cfg["hidden"]),
                       num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"])


def build(kind: str, cfg: dict, weights: dict) -> torch.nn.Module:
    """The dense module with the case's weights (names as in tpkit.models, prefix `w.`)."""
    mc = model_config(cfg)
    m = Attention(mc) if kind == "attention" else DecoderLayer(mc)
    m.load_state_dict({k[2:]: v for k, v in weights.items() if k.startswith("w.")})
    return m


def attention_partial_grads(attn: Attention, a: torch.Tensor, g_out: torch.Tensor, world_sizes) -> dict:
    """k/v weight grads of each rank's kv rows, from that rank's query heads only.

    a: the attention input (B, T, C); g_out: dL/d(attention output) (B, T, C).
    Returns {"dk@t{t}r{r}": (kv rows of rank r) x C, "dv@...": ...}.
    """
    nh, nkv, hs = attn.num_heads, attn.num_kv_heads, attn.head_dim
    out = {}
    for t in world_sizes:
        per_rank = nh // t
        for r in range(t):
            mask = torch.zeros(nh * hs)
            mask[r * per_rank * hs:(r + 1) * per_rank * hs] = 1.0      # rank r's heads in o_proj's input
            hook = attn.o_proj.register_forward_pre_hook(lambda mod, args, m=mask: (args[0] * m,))
            try:
                attn.zero_grad(set_to_none=True)
                (attn(a.detach()) * g_out).sum().backward()
            finally:
                hook.remove()
            lo, hi = kv_heads_of_rank(nh, nkv, r, t)
            out[f"dk@t{t}r{r}"] = attn.k_proj.weight.grad[lo * hs:hi * hs].clone()
            out[f"dv@t{t}r{r}"] = attn.v_proj.weight.grad[lo * hs:hi * hs].clone()
    attn.zero_grad(set_to_none=True)
    return out


def dense_attention(cfg: dict, inp: dict) -> dict:
    attn = build("attention", cfg, inp)
    x = inp["x"].clone().requires_grad_(True)
    y = attn(x)
    backward(y, inp["dy"])
    ref = {"y": y.detach(), "dx": x.grad}
    ref.update({f"d.{n}": p.grad.clone() for n, p in attn.named_parameters()})
    parts = attention_partial_grads(attn, inp["x"], inp["dy"], cfg["world_sizes"])
    ref.update({f"d.{k}": v for k, v in parts.items()})
    return ref


def dense_block(cfg: dict, inp: dict) -> dict:
    layer = build("block", cfg, inp)
    x = inp["x"].clone().requires_grad_(True)
    a = layer.input_layernorm(x)
    a.retain_grad()
    att = layer.self_attn(a)
    att.retain_grad()
    h = x + att
    y = h + layer.mlp(layer.post_attention_layernorm(h))   # the same graph as DecoderLayer.forward
    backward(y, inp["dy"])
    ref = {"y": y.detach(), "dx": x.grad}
    ref.update({f"d.{n}": p.grad.clone() for n, p in layer.named_parameters()})
    parts = attention_partial_grads(layer.self_attn, a.detach(), att.grad, cfg["world_sizes"])
    ref.update({f"d.self_attn.{k}": v for k, v in parts.items()})
    with torch.no_grad():                                   # guard: the hand-unrolled graph is the layer's
        assert torch.allclose(layer(inp["x"]), ref["y"], atol=1e-6)
    return ref
