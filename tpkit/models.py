"""The course's dense model: a small Llama/Qwen-style decoder, pure PyTorch, no downloads.

Module names follow HuggingFace (`self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`, ...) so
the DTensor plans of Week 7 read like real ones. The model stays pure: every parallel version
(hand-written Weeks 3-6, DTensor Week 7) is built *from* it, and the grader uses it as the
single-device reference. Activations are (B, T, C): batch, sequence, channels; so the
sequence dimension is 1 (DTensor `Shard(1)`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def week07_config(**kw) -> ModelConfig:
    """The course model, sized so every head count divides t = 2 and 4 (GQA: 8 query, 4 kv heads)."""
    d = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=4)
    d.update(kw)
    return ModelConfig(**d)


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight (Zhang & Sennrich 2019); the weight is replicated under TP."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype=torch.float32):
    """cos, sin of shape (T, hs) for rotary position embeddings (Su et al. 2021)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    ang = positions.float()[:, None] * inv[None, :]            # (T, hs/2)
    ang = torch.cat([ang, ang], dim=-1)                        # (T, hs)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rotary(x, cos, sin):
    """x: (B, nh, T, hs)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def causal_attention(q, k, v):
    """q: (B, nh, T, hs); k, v: (B, nkv, T, hs) with nh % nkv == 0 (grouped-query attention)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)                    # (B, nh, T, hs)
        v = v.repeat_interleave(rep, dim=1)
    T = q.shape[2]
    att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])   # (B, nh, T, T)
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return att @ v                                             # (B, nh, T, hs)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hs = cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hs
        self.rope_theta = cfg.rope_theta
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * hs, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hs, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hs, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hs, cfg.hidden_size, bias=False)

    def forward(self, hidden_states, position_ids=None):
        B, T, _ = hidden_states.shape
        # -1, not self.num_heads: under tensor parallelism each rank holds num_heads / t heads
        q = self.q_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)   # (B, nh, T, hs)
        k = self.k_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)   # (B, nkv, T, hs)
        v = self.v_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)   # (B, nkv, T, hs)
        pos = position_ids if position_ids is not None else torch.arange(T, device=hidden_states.device)
        cos, sin = rotary_cos_sin(pos, self.head_dim, self.rope_theta, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = causal_attention(q, k, v)                                                    # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)                                          # (B, T, nh*hs)
        return self.o_proj(y)                                                            # (B, T, C)


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)); y = h + mlp(norm(h))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, hidden_states, position_ids=None):
        # keyword call, as HuggingFace does: a DTensor plan needs input_kwarg_layouts for it
        h = hidden_states + self.self_attn(hidden_states=self.input_layernorm(hidden_states), position_ids=position_ids)
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, position_ids=None):
        h = self.embed_tokens(input_ids)                       # (B, T, C)
        for layer in self.layers:
            h = layer(h, position_ids=position_ids)
        return self.norm(h)


class ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids, position_ids=None):
        return self.lm_head(self.model(input_ids, position_ids=position_ids))   # (B, T, V)


def init_weights(module: nn.Module, seed: int) -> nn.Module:
    """Deterministic init from one seed: every rank builds the same dense model, then shards it.

    Matrices ~ N(0, 1/fan_in) keep activations O(1), so atol=1e-3 is a fair bar in float32;
    norm weights ~ 1 + N(0, 0.1^2) so a wrong norm-weight gradient cannot hide behind ones.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in module.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    return module
