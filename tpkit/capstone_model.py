"""The capstone's model (Week 12): the course's Llama-style decoder with one mixture-of-experts layer.

    ids (B, T) -> embed -> L dense `tpkit.models.DecoderLayer`s -> one MoE layer -> norm -> lm_head -> (B, T, V)

The MoE layer is a pre-norm residual feed-forward layer, y = x + sum_j gate_j FFN_{e_j}(norm(x)), top-k of E
experts with the gates renormalised over the k (GShard, Lepikhin et al. 2020) and no token dropped (every
expert has room for every token: Megatron-LM's "dropless" MoE), so the routing of a token never depends on
which other tokens share its rank, and every parallel layout computes the same function. The blocks are one
list (`layers`): a pipeline cuts it into stages, whatever kind each block is.

Pure PyTorch and pure model: no parallelism here. Week 12's lecture (`reference/capstone.py`) and the
grader build every parallel layout *from* it and use it as the single-device reference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from tpkit.models import DecoderLayer, ModelConfig, RMSNorm, init_weights


@dataclass
class CapstoneConfig:
    model: ModelConfig = field(default_factory=lambda: ModelConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=4))
    n_experts: int = 4
    top_k: int = 2
    expert_size: int = 32          # each expert's FFN width

    @property
    def n_blocks(self) -> int:
        return self.model.num_hidden_layers + 1      # the dense layers and the MoE layer


def expert_ffn(x, w1, w2):
    """One expert: (M, C) -> (M, C) with w1 (F, C), w2 (C, F) (as in Week 11)."""
    return F.gelu(x @ w1.T) @ w2.T


def dropless_gates(logits: torch.Tensor, k: int) -> torch.Tensor:
    """(N, E) router logits -> (N, E) gate matrix: the renormalised top-k probabilities, zero elsewhere."""
    top, experts = logits.softmax(-1).topk(k, dim=-1)                       # (N, k), best first
    return torch.zeros_like(logits).scatter(1, experts, top / top.sum(-1, keepdim=True))


class MoELayer(nn.Module):
    """x + MoE(norm(x)); router (E, C), w1 (E, F, C), w2 (E, C, F). Dense: every expert runs on every token and
    the gate matrix picks (E times the FLOPs: a reference, not a way to train)."""

    def __init__(self, cfg: CapstoneConfig):
        super().__init__()
        C, E, Fe = cfg.model.hidden_size, cfg.n_experts, cfg.expert_size
        self.k = cfg.top_k
        self.norm = RMSNorm(C, cfg.model.rms_norm_eps)
        self.router = nn.Parameter(torch.empty(E, C))
        self.w1 = nn.Parameter(torch.empty(E, Fe, C))
        self.w2 = nn.Parameter(torch.empty(E, C, Fe))

    def forward(self, x):                                                   # (B, T, C)
        n = self.norm(x).flatten(0, 1)                                      # (B*T, C)
        gates = dropless_gates(n @ self.router.T, self.k)                   # (B*T, E)
        out = torch.stack([expert_ffn(n, self.w1[e], self.w2[e]) for e in range(self.w1.shape[0])], 1)  # (N, E, C)
        return x + torch.einsum("ne,nec->nc", gates, out).view_as(x)


class LlamaMoE(nn.Module):
    def __init__(self, cfg: CapstoneConfig):
        super().__init__()
        m = cfg.model
        self.config = cfg
        self.embed_tokens = nn.Embedding(m.vocab_size, m.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(m) for _ in range(m.num_hidden_layers)] + [MoELayer(cfg)])
        self.norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.lm_head = nn.Linear(m.hidden_size, m.vocab_size, bias=False)

    def forward(self, input_ids):                                           # (B, T) -> (B, T, V)
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm(h))


def init_capstone(model: LlamaMoE, seed: int) -> LlamaMoE:
    """`tpkit.models.init_weights` (matrices N(0, 1/fan_in), norm weights 1 + N(0, 0.1^2)) and the same scale
    for the 3-D expert weights, which it would treat as norm-like."""
    init_weights(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 3:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return model


def lm_loss(logits, targets):
    """Mean cross-entropy over the B*T tokens."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
