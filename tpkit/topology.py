"""What a 3-D layout is planned for: model and cluster specs, and Korthikanti's activation formula.

The planner itself (memory per GPU, step time, the search) is `reference.planner`, because the
Week 9 lab asks students to write it; these dataclasses are what the lab hands them.
"""
from __future__ import annotations

from dataclasses import dataclass, field


GB = 1e9


@dataclass(frozen=True)
class ModelSpec:
    name: str
    n_params: float          # P
    n_layers: int            # L
    hidden: int              # h
    n_heads: int             # a
    seq_len: int             # s
    global_batch: int        # sequences per optimizer step
    micro_batch: int = 1     # b
    ffn: int = 0             # MLP width (0: GPT's 4h)
    kv_heads: int = 0        # key/value heads (0: n_heads, no GQA)
    vocab: int = 0           # output-layer width (0: no output layer counted)
    gated_mlp: bool = False  # SwiGLU: three h x ffn matrices instead of two
    dropout: bool = True     # GPT-style dropout after attention and MLP (Llama has none)

    @property
    def ffn_dim(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def kv_dim(self) -> int:
        return self.hidden * (self.kv_heads or self.n_heads) // self.n_heads


@dataclass(frozen=True)
class ClusterSpec:
    """Named hardware (`tpkit.costmodel.GPUS` and `NICS` keys): the cost model turns it into seconds."""
    n_nodes: int
    gpus_per_node: int = 8
    gpu_mem: float = 80 * GB         # bytes we allow ourselves per GPU
    gpu: str = "H100"
    nic: str = "IB NDR 400"          # one port per GPU
    nics_per_node: int = 8

    @property
    def n_gpus(self) -> int:
        return self.n_nodes * self.gpus_per_node


@dataclass
class Plan:
    tp: int
    pp: int
    dp: int
    micro_batches: int                               # m per pipeline per step
    memory: dict = field(default_factory=dict)       # bytes per GPU: weights, grads, optimizer, activations
    time: dict = field(default_factory=dict)         # seconds: compute, tp, pp, dp, bubble, step

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())

    @property
    def step_time(self) -> float:
        return self.time["step"]


def activation_bytes_per_layer(s, b, h, a, t=1, sp=True, recompute="selective", dropout=True) -> float:
    """Korthikanti et al. 2022, Table 2 (16-bit activations, bytes per layer). Of its 34 sbh, 2 sbh are the
    attention-output and MLP-output dropout masks (Sec. 4.1, replicated without SP): a model without dropout
    (Llama) stores 32 sbh."""
    if recompute == "full":
        return 2 * s * b * h
    attn = 0 if recompute == "selective" else 5 * a * s / (h * t)
    masks = 2 if dropout else 0
    if t == 1:
        return s * b * h * (32 + masks + attn)
    return s * b * h * ((32 + masks) / t if sp else 8 + masks + 24 / t) + s * b * h * attn


LLAMA_70B = ModelSpec("70B (Llama-2/3 70B shape)", 70e9, 80, 8192, 64, 4096, global_batch=1024)


H100_16x8 = ClusterSpec(n_nodes=16)
