"""Bytes and FLOPs into seconds on named hardware: one small, sourced cost model.

Every figure below has an entry in docs/sources.md (the key is in its comment). Bandwidths are bytes/s
in ONE direction per GPU; FLOP/s are dense (no sparsity).

Collectives (week 1's alpha-beta model, with NCCL's constants):
    T = base + steps * alpha_link + bytes_on_the_wire / busbw
  steps and bytes per rank are week 1's: a ring all-reduce takes 2(t-1) steps and sends 2(t-1)/t N
  (`tpkit.ledger.ring_bytes_sent`), recursive doubling log2(t) steps of N; NCCL's tree is a reduce and
  a broadcast along a pipelined tree, 2(depth) steps, algorithm bandwidth busbw/2; NVLS (NVLink SHARP)
  lets the switch reduce, one step, at the algorithm bandwidth NVIDIA measured. busbw is the link's
  line rate times a protocol efficiency; NCCL picks, per size, the algorithm its model says is fastest.
  An all-to-all is no ring: its t-1 sends are posted at once (one hop of latency, not t-1), and across nodes each
  rank's share for other nodes, (t - per_node)/t of its buffer, leaves through its own NIC, so one NIC bounds it,
  not the node's NICs together.
GEMM (roofline, torchao's model plus wave quantization):
    T = max(2mnk / (peak * eta_gemm * wave), bytes / (hbm * eta_mem)) + launch
  wave = tiles / (ceil(tiles / SMs) * SMs): the last wave of 128x128 output tiles leaves SMs idle.
Overlap: a schedule's time is max(compute, comm) where they overlap and compute + comm where exposed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tpkit.ledger import ring_bytes_sent
from tpkit.topology import GB, ClusterSpec, ModelSpec, activation_bytes_per_layer

TFLOPS = 1e12


@dataclass(frozen=True)
class GPU:
    name: str
    bf16: float            # dense BF16 FLOP/s
    fp8: float             # dense FP8 FLOP/s (0: none)
    hbm: float             # HBM bytes/s
    nvlink: float          # NVLink bytes/s per direction per GPU
    nvlink_domain: int     # GPUs that share one NVLink (switch) domain
    sms: int               # streaming multiprocessors (for wave quantization)


GPUS = {
    # nvidia-a100: 312 TFLOP/s BF16, 2,039 GB/s (80 GB SXM), NVLink 600 GB/s total; 108 SMs
    "A100": GPU("A100 SXM 80GB", 312 * TFLOPS, 0.0, 2.039e12, 300 * GB, 8, 108),
    # nvidia-h100: BF16 1,979 "with sparsity" (half dense), 3.35 TB/s, NVLink 900 GB/s; torchao-roofline: FP8
    # 1979e12 dense; nvidia-hopper-in-depth: 132 SMs
    "H100": GPU("H100 SXM", 989 * TFLOPS, 1979 * TFLOPS, 3.35e12, 450 * GB, 8, 132),
    # nvidia-h200: the H100 SXM's Tensor Core rates and NVLink, 4.8 TB/s HBM3e
    "H200": GPU("H200 SXM", 989 * TFLOPS, 1979 * TFLOPS, 4.8e12, 450 * GB, 8, 132),
    # torchao-roofline (Blackwell technical brief): 2.25 PF BF16, 4.5 PF FP8 dense, 8 TB/s, 148 SMs (its PR #4002);
    # nvidia-gb200-nvl72: NVLink 5, 1.8 TB/s per GPU
    "B200": GPU("B200", 2250 * TFLOPS, 4500 * TFLOPS, 8.0e12, 900 * GB, 8, 148),
    # nvidia-gb200-nvl72: the same Blackwell GPU, 72 of them in one NVLink domain
    "GB200": GPU("GB200 NVL72", 2250 * TFLOPS, 4500 * TFLOPS, 8.0e12, 900 * GB, 72, 148),
}

# scale-out links, bytes/s per direction per port (one port per GPU on these systems: nvidia-dgx-basepod)
NICS = {
    "IB HDR 200": 25 * GB,     # 200 Gb/s
    "IB NDR 400": 50 * GB,     # 400 Gb/s (ConnectX-7)
    "IB XDR 800": 100 * GB,    # 800 Gb/s (ConnectX-8, Quantum-X800)
    "RoCE 400": 50 * GB,       # 400 Gb/s Ethernet, Llama 3's fabric (llama3-2024 Sec. 3.3.1)
}
PCIE = {"PCIe Gen4 x16": 31.5 * GB, "PCIe Gen5 x16": 63 * GB}  # pcie-sig: 16 and 32 GT/s per lane, 128b/130b

# achieved fraction of the line rate (bus bandwidth): nccl-tests-issue212 "~20% protocol overhead" on
# NVLink; nccl-tests-issue290 "46-48 GB/s per NIC" on NDR 400 (47/50)
EFF = {"nvlink": 0.80, "net": 0.94}
# NVLS all-reduce algorithm bandwidth, 8 H100: "peak busBw ~480GB/s (algbw ~275GB/s)" (nccl-tests-issue212);
# the H200 shares the H100's NVLink 4 and NVSwitch, so its value is assumed equal (no published figure here)
NVLS_ALGBW = {"H100": 275 * GB, "H200": 275 * GB}
# NCCL's own latency model, Simple protocol (nccl-tuning; in seconds here): base per call, per step per hop
NCCL_BASE = {"ring": 8.4e-6, "tree": 0.0}
NCCL_HOP = {"ring": {"nvlink": 3.4e-6, "net": 9.6e-6}, "tree": {"nvlink": 28e-6, "net": 50e-6}}
# torchao-roofline: GEMMs reach 78% of peak on large shapes, element-wise kernels 92% of HBM, 2 us a launch;
# dao2023flash2 (abstract): FlashAttention-2 reaches 50-73% of peak, the lower end taken for forward + backward
ETA_GEMM, ETA_MEM, LAUNCH, ETA_ATTN = 0.78, 0.92, 2e-6, 0.50
TILE = 128


def busbw(cluster: ClusterSpec, t: int, per_node: int) -> tuple[float, str]:
    """Achievable ring bus bandwidth of a group of t GPUs with `per_node` of them in each node, and its link.

    Inside a node every rank streams over NVLink. A ring across nodes also crosses the NICs; each GPU has
    its own NIC and the node's other GPUs drive theirs for their own groups, so a group gets `per_node`
    NICs (a whole-node ring, as in nccl-tests, all of them: its busbw reads "GB/s per NIC" x NICs)."""
    nv = GPUS[cluster.gpu].nvlink * EFF["nvlink"]
    if t <= per_node:
        return nv, "nvlink"
    net = min(per_node, cluster.nics_per_node) * NICS[cluster.nic] * EFF["net"]
    return (net, "net") if net < nv else (nv, "nvlink")


def ring_steps(op: str, t: int) -> int:
    """Steps of a ring of t ranks (week 1 §4): all-reduce 2(t-1), reduce-scatter and all-gather t-1."""
    if t <= 1:
        return 0
    return {"all_reduce": 2 * (t - 1), "all_gather": t - 1, "reduce_scatter": t - 1, "all_to_all": t - 1,
            "send": 1}[op]


def collective_time(op: str, nbytes: float, t: int, cluster: ClusterSpec, algo: str = "ring",
                    per_node: int | None = None) -> float:
    """Seconds for one collective of `nbytes` (the full tensor, as the ledger counts it) on t GPUs,
    `per_node` of them in each node (default: packed, min(t, GPUs per node)). "send": one message."""
    if t <= 1:
        return 0.0
    per_node = per_node or min(t, cluster.gpus_per_node)
    bw, link = busbw(cluster, t, per_node)
    if op == "all_to_all":            # not a ring: t-1 sends posted at once (one hop of latency); across nodes each
        # rank sends (t - per_node)/t of its buffer through its own NIC(s) and (per_node - 1)/t over NVLink, together
        if t <= per_node:
            return NCCL_BASE["ring"] + NCCL_HOP["ring"][link] + ring_bytes_sent(op, nbytes, t) / bw
        nic = NICS[cluster.nic] * EFF["net"] * cluster.nics_per_node / cluster.gpus_per_node
        nv = GPUS[cluster.gpu].nvlink * EFF["nvlink"]
        lat = NCCL_BASE["ring"] + NCCL_HOP["ring"]["net"]
        return lat + max((t - per_node) / t * nbytes / nic, (per_node - 1) / t * nbytes / nv)
    if algo == "ring":                # of its steps, those that cross a node boundary pay the network hop
        steps, inter = ring_steps(op, t), ring_steps(op, math.ceil(t / per_node))
        hops = (steps - inter) * NCCL_HOP["ring"]["nvlink"] + inter * NCCL_HOP["ring"]["net"]
        return NCCL_BASE["ring"] + hops + ring_bytes_sent(op, nbytes, t) / bw
    if algo == "rd":                  # recursive doubling (week 1 §7): log2 t steps of the whole buffer
        return math.ceil(math.log2(t)) * (NCCL_HOP["ring"][link] + nbytes / bw)
    if algo == "tree":                # all-reduce only: reduce up + broadcast down, pipelined
        nodes = math.ceil(t / per_node)
        lat = 2 * ((per_node - 1) * NCCL_HOP["tree"]["nvlink"] + math.log2(nodes) * NCCL_HOP["tree"]["net"])
        return lat + nbytes / (0.5 * 0.9 * bw)     # nccl-tuning: tree busbw x0.9, algbw = busbw / 2
    if algo == "nvls":                # all-reduce inside one NVLink domain, the switch reduces
        return NCCL_HOP["ring"]["nvlink"] + nbytes / NVLS_ALGBW[cluster.gpu]
    raise ValueError(algo)


def nccl_algorithms(op: str, t: int, cluster: ClusterSpec) -> list[str]:
    if op != "all_reduce":
        return ["ring"]
    algos = ["ring", "tree"]
    if t <= cluster.gpus_per_node and cluster.gpu in NVLS_ALGBW:
        algos.append("nvls")
    return algos


def nccl_pick(op: str, nbytes: float, t: int, cluster: ClusterSpec) -> tuple[str, float]:
    """What NCCL's tuner does (nccl-issue457): estimate every algorithm, take the fastest."""
    return min(((a, collective_time(op, nbytes, t, cluster, a)) for a in nccl_algorithms(op, t, cluster)),
               key=lambda x: x[1])


def algbw_busbw(op: str, nbytes: float, t: int, seconds: float) -> tuple[float, float]:
    """nccl-tests' two bandwidths (nccl-tests-performance): algbw = S/T, busbw = algbw x the op's factor."""
    factor = ring_bytes_sent(op, 1.0, t) if op != "send" else 1.0
    return nbytes / seconds, nbytes / seconds * factor


def wave_efficiency(m: int, n: int, sms: int) -> float:
    """Fraction of the SM-slots a GEMM's last wave of 128x128 output tiles keeps busy."""
    tiles = math.ceil(m / TILE) * math.ceil(n / TILE)
    return tiles / (math.ceil(tiles / sms) * sms)


def gemm_time(m: int, n: int, k: int, gpu: GPU, fp8: bool = False) -> float:
    """Seconds for C[m, n] = A[m, k] @ B[k, n] in bf16 (or FP8 inputs, bf16 output): roofline with a
    shape-dependent compute efficiency."""
    peak = gpu.fp8 if fp8 else gpu.bf16
    compute = 2 * m * n * k / (peak * ETA_GEMM * wave_efficiency(m, n, gpu.sms))
    memory = ((m * k + k * n) * (1 if fp8 else 2) + 2 * m * n) / (gpu.hbm * ETA_MEM)
    return max(compute, memory) + LAUNCH


def memory_time(nbytes: float, gpu: GPU) -> float:
    """An element-wise pass over `nbytes` of HBM traffic."""
    return nbytes / (gpu.hbm * ETA_MEM)


def schedule_time(pieces: list[tuple[float, float]]) -> float:
    """pieces: (compute seconds, comm seconds that can run under that compute); exposed comm has compute 0.
    Each overlapped pair takes the longer of the two, exposed pieces add up."""
    return sum(max(c, m) for c, m in pieces)


# -- one transformer layer, per micro-batch, on one GPU --------------------------------------------
def linear_params_per_layer(model: ModelSpec) -> int:
    """Weights of the layer's GEMMs: QKV h(h + 2 kv), output h^2, MLP 2 or 3 (gated) h x ffn."""
    h = model.hidden
    return h * (h + 2 * model.kv_dim) + h * h + (3 if model.gated_mlp else 2) * h * model.ffn_dim


def model_flops_per_token(model: ModelSpec, causal: bool = False) -> float:
    """Model FLOPs of one token, forward + backward (narayanan2021 Sec. 5.1's count): 6 x the GEMM weights,
    12 s h per layer for attention scores and values, and the output layer 6 V h; `causal` counts only the
    unmasked half of the scores, which is what a flash-attention run executes. No recomputation: MFU."""
    L, h, s = model.n_layers, model.hidden, model.seq_len
    return 6 * L * linear_params_per_layer(model) + (6 if causal else 12) * L * h * s + 6 * model.vocab * h


def layer_gemms(model: ModelSpec, tokens: int, tp: int) -> list[tuple[int, int, int]]:
    """(m, n, k) of one layer's forward GEMMs on one TP rank, `tokens` rows each."""
    h, f = model.hidden, model.ffn_dim // tp
    mlp_in = [(tokens, f, h)] * (2 if model.gated_mlp else 1)
    return [(tokens, (h + 2 * model.kv_dim) // tp, h), (tokens, h, h // tp), *mlp_in, (tokens, h, f)]


def fwd_bwd_gemm_time(shapes: list[tuple[int, int, int]], gpu: GPU, fp8: bool = False) -> tuple[float, float]:
    """Forward GEMMs and their backward: dgrad [m,n]x[n,k] and wgrad [k,m]x[m,n] per forward [m,k]x[k,n]."""
    fwd = sum(gemm_time(m, n, k, gpu, fp8=fp8) for m, n, k in shapes)
    bwd = sum(gemm_time(m, k, n, gpu, fp8=fp8) + gemm_time(k, n, m, gpu, fp8=fp8) for m, n, k in shapes)
    return fwd, bwd


def layer_time(model: ModelSpec, gpu: GPU, tp: int = 1, cp: int = 1, recompute: str = "selective",
               flash: bool = True, sp: bool = True, fp8: bool = False) -> dict:
    """Seconds of one layer for one micro-batch on one GPU, and the bytes of its TP and CP collectives.

    compute: the GEMMs (roofline above); attention scores and values, 4 b (s/cp) s h / tp FLOPs forward
    (flash attention skips the masked half and never writes the s x s scores; without it the scores
    cost 5 a s^2 b / tp bytes of element-wise traffic, korthikanti2022 Table 2); element-wise layers move
    4x the activation bytes korthikanti2022 Table 2 stores (written and read forward, their gradients
    written and read backward). Backward is dgrad + wgrad; recompute "full" adds a forward, "selective"
    the attention core. Collectives (bytes of the full tensor, as the ledger counts them):
    tp: 4 all-reduces of the b (s/cp) h activation (f and g, forward and backward, narayanan2021 Sec. 3.2;
        under SP the same bytes as reduce-scatter + all-gather pairs), 6 with full recompute;
    cp: K and V all-gathered forward, again backward, their gradients reduce-scattered (llama3-2024 §3.3.2).
    """
    b, s, h, a = model.micro_batch, model.seq_len, model.hidden, model.n_heads
    tokens = b * s // cp
    fwd, bwd = fwd_bwd_gemm_time(layer_gemms(model, tokens, tp), gpu, fp8)
    attn = 4 * b * (s // cp) * s * h / tp * (0.5 / ETA_ATTN if flash else 1.0 / ETA_GEMM) / gpu.bf16
    scores = 0.0 if flash else memory_time(2 * 5 * a * s * s * b / (tp * cp), gpu)   # write + read
    act = activation_bytes_per_layer(s // cp, b, h, a, tp, sp=sp, recompute="selective")
    elem = memory_time(2 * act, gpu)                                                  # each direction
    f_all = fwd + attn + scores + elem
    extra = {"none": 0.0, "selective": attn + scores, "full": f_all}[recompute]
    act_bytes = 2 * tokens * h                                                        # bf16 [b, s/cp, h]
    kv_bytes = 2 * 2 * b * s * model.kv_dim / tp                                      # K and V, bf16, gathered
    return {"fwd": f_all, "bwd": bwd + 2 * attn + 2 * scores + elem + extra,
            "tp_all_reduces": (6 if recompute == "full" else 4) if tp > 1 else 0, "tp_bytes": act_bytes,
            "cp_collectives": 3 if cp > 1 else 0, "cp_bytes": kv_bytes, "act_bytes": act_bytes}


def output_layer_time(model: ModelSpec, gpu: GPU, tp: int = 1, cp: int = 1) -> float:
    """Logits [b s, h] x [h, V/tp], forward and backward (the loss itself is element-wise, ignored)."""
    if not model.vocab:
        return 0.0
    f, b = fwd_bwd_gemm_time([(model.micro_batch * model.seq_len // cp, model.vocab // tp, model.hidden)], gpu)
    return f + b
