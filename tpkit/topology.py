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


@dataclass(frozen=True)
class ClusterSpec:
    n_nodes: int
    gpus_per_node: int = 8
    gpu_mem: float = 80 * GB         # bytes we allow ourselves per GPU
    peak_flops: float = 989e12       # dense BF16, H100 SXM
    mfu: float = 0.4                 # achieved fraction of peak for the GEMMs
    bw_intra: float = 370 * GB       # NVLink ring bus bandwidth (bytes/s)
    bw_inter: float = 50 * GB        # one 400 Gb/s NIC per GPU (bytes/s)

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


def activation_bytes_per_layer(s, b, h, a, t=1, sp=True, recompute="selective") -> float:
    """Korthikanti et al. 2022, Table 2 (16-bit activations, bytes per layer)."""
    if recompute == "full":
        return 2 * s * b * h
    attn = 0 if recompute == "selective" else 5 * a * s / (h * t)
    if t == 1:
        return s * b * h * (34 + attn)
    return s * b * h * ((34 / t if sp else 10 + 24 / t) + attn)


LLAMA_70B = ModelSpec("70B (Llama-2/3 70B shape)", 70e9, 80, 8192, 64, 4096, global_batch=1024)


H100_16x8 = ClusterSpec(n_nodes=16)
