"""tpkit.costmodel: each formula checked against the numbers it must produce, computed here by hand."""
import math

import pytest

from tpkit import costmodel as cm
from tpkit import topology as topo
from reference import planner

H100 = cm.GPUS["H100"]
NODE = topo.ClusterSpec(n_nodes=1)                      # 8 H100 on NVLink
TWO = topo.ClusterSpec(n_nodes=2)                       # 16 H100, 8 NDR 400 NICs per node


def test_ring_all_reduce_is_week1_steps_and_bytes_at_nvlink_busbw():
    n = 1e9
    busbw = 450e9 * 0.80                                # NVLink line rate x protocol efficiency
    expect = 8.4e-6 + 2 * 7 * 3.4e-6 + 2 * 7 / 8 * n / busbw
    assert cm.collective_time("all_reduce", n, 8, NODE) == pytest.approx(expect)
    # reduce-scatter and all-gather: half the steps and half the bytes
    half = 8.4e-6 + 7 * 3.4e-6 + 7 / 8 * n / busbw
    assert cm.collective_time("reduce_scatter", n, 8, NODE) == pytest.approx(half)
    assert cm.collective_time("all_gather", n, 8, NODE) == pytest.approx(half)
    assert cm.collective_time("all_reduce", n, 1, NODE) == 0.0


def test_busbw_is_what_nccl_tests_reports_for_a_large_ring():
    t = cm.collective_time("all_reduce", 8e9, 8, NODE)
    algbw, busbw = cm.algbw_busbw("all_reduce", 8e9, 8, t)
    assert algbw == pytest.approx(8e9 / t)
    assert busbw == pytest.approx(algbw * 2 * 7 / 8)
    assert busbw == pytest.approx(360e9, rel=0.01)      # latency is < 1% of an 8 GB all-reduce


def test_a_group_across_nodes_gets_one_nic_per_member_per_node():
    # whole-node ring over 2 nodes: 8 NICs x 50 GB/s x 0.94 = 376 GB/s > NVLink's 360: NVLink bounds it
    assert cm.busbw(TWO, 16, 8) == (pytest.approx(360e9), "nvlink")
    # one rank per node (a DP group beside TP 8): one NIC
    assert cm.busbw(TWO, 2, 1) == (pytest.approx(47e9), "net")
    a100_hdr = topo.ClusterSpec(n_nodes=4, gpu="A100", nic="IB HDR 200", nics_per_node=4)
    assert cm.busbw(a100_hdr, 32, 8) == (pytest.approx(4 * 25e9 * 0.94), "net")
    n = 1e8                                             # a send across nodes: 1 step on the network
    assert cm.collective_time("send", n, 2, TWO, per_node=1) == pytest.approx(8.4e-6 + 9.6e-6 + n / 47e9)
    # a 16-rank ring over 2 nodes: 30 steps, 2 of them cross the network (NCCL's nInterSteps)
    lat = 8.4e-6 + 28 * 3.4e-6 + 2 * 9.6e-6
    assert cm.collective_time("all_reduce", n, 16, TWO) == pytest.approx(lat + 2 * 15 / 16 * n / 360e9)


def test_all_to_all_is_one_hop_and_one_nic_per_rank_across_nodes():
    n = 1e9
    # inside a node: every send posted at once, one hop; (t-1)/t of the buffer at NVLink's busbw
    assert cm.collective_time("all_to_all", n, 8, NODE) == pytest.approx(8.4e-6 + 3.4e-6 + 7 / 8 * n / (450e9 * 0.80))
    # 16 ranks over 2 nodes: half the buffer leaves through the rank's own NIC (50 GB/s x 0.94), 7/16 over NVLink,
    # at once; the NIC bounds it (a ring would have pooled the node's 8 NICs)
    across = 8.4e-6 + 9.6e-6 + max(8 / 16 * n / (50e9 * 0.94), 7 / 16 * n / (450e9 * 0.80))
    assert cm.collective_time("all_to_all", n, 16, TWO) == pytest.approx(across)
    assert across > 4 * cm.collective_time("all_to_all", n, 8, NODE)


def test_recursive_doubling_tree_and_nvls_formulas():
    n, bw = 4e6, 360e9
    assert cm.collective_time("all_reduce", n, 8, NODE, "rd") == pytest.approx(3 * (3.4e-6 + n / bw))
    tree = 2 * (7 * 28e-6 + math.log2(2) * 50e-6) + n / (0.5 * 0.9 * bw)
    assert cm.collective_time("all_reduce", n, 16, TWO, "tree") == pytest.approx(tree)
    assert cm.collective_time("all_reduce", n, 8, NODE, "nvls") == pytest.approx(3.4e-6 + n / 275e9)


def test_nccl_picks_the_fastest_available_algorithm():
    algo, t = cm.nccl_pick("all_reduce", 1e9, 8, NODE)
    assert algo == "nvls"
    assert t == min(cm.collective_time("all_reduce", 1e9, 8, NODE, a) for a in ("ring", "tree", "nvls"))
    assert cm.nccl_pick("all_reduce", 1e9, 16, TWO)[0] in ("ring", "tree")         # NVLS: one node only here
    assert cm.nccl_pick("all_gather", 1e9, 8, NODE)[0] == "ring"
    a100 = topo.ClusterSpec(n_nodes=1, gpu="A100")
    assert "nvls" not in cm.nccl_algorithms("all_reduce", 8, a100)                   # no NVLink SHARP on A100


def test_wave_quantization():
    assert cm.wave_efficiency(128 * 132, 128, 132) == 1.0                            # exactly one full wave
    assert cm.wave_efficiency(128 * 133, 128, 132) == pytest.approx(133 / 264)       # one tile spills
    assert cm.wave_efficiency(128, 128, 132) == pytest.approx(1 / 132)


def test_gemm_roofline_compute_and_memory_bound():
    m = n = k = 8192                                    # 64 x 64 tiles = 4096 = 31.03 waves of 132
    waves = 4096 / (math.ceil(4096 / 132) * 132)
    assert cm.gemm_time(m, n, k, H100) == pytest.approx(2 * m * n * k / (989e12 * 0.78 * waves) + 2e-6)
    # a matrix-vector product is bound by HBM: it reads the whole matrix
    assert cm.gemm_time(1, 8192, 8192, H100) == pytest.approx((8192 + 8192 ** 2 + 8192) * 2 / (3.35e12 * 0.92) + 2e-6)
    assert cm.gemm_time(m, n, k, H100, fp8=True) < cm.gemm_time(m, n, k, H100)


def test_schedule_time_overlaps_pairs_and_adds_exposed_pieces():
    assert cm.schedule_time([(3.0, 1.0), (1.0, 2.0), (0.0, 0.5)]) == 3.0 + 2.0 + 0.5


def test_model_flops_match_megatrons_formula():
    # narayanan2021: 72 B s L h^2 (1 + s/6h + V/12hL) per iteration for a GPT (4h MLP, no GQA)
    m = topo.ModelSpec("1T", 1e12, 128, 25600, 160, 2048, global_batch=3072, vocab=51200)
    L, h, s, V = 128, 25600, 2048, 51200
    assert cm.model_flops_per_token(m) == pytest.approx(72 * L * h * h * (1 + s / (6 * h) + V / (12 * h * L)))
    assert cm.model_flops_per_token(m) - cm.model_flops_per_token(m, causal=True) == pytest.approx(6 * L * h * s)


def test_gqa_and_gated_mlp_shapes():
    m = topo.ModelSpec("8B", 8e9, 32, 4096, 32, 8192, 16, ffn=14336, kv_heads=8, gated_mlp=True)
    assert m.kv_dim == 1024
    assert cm.linear_params_per_layer(m) == 4096 * (4096 + 2048) + 4096 ** 2 + 3 * 4096 * 14336
    assert cm.layer_gemms(m, 100, 4) == [(100, 6144 // 4, 4096), (100, 4096, 1024), (100, 3584, 4096),
                                         (100, 3584, 4096), (100, 4096, 3584)]


def test_layer_time_counts_backward_recompute_and_collectives():
    m = topo.ModelSpec("13B", 13e9, 40, 5120, 40, 4096, 512)
    none = cm.layer_time(m, H100, tp=8, recompute="none")
    full = cm.layer_time(m, H100, tp=8, recompute="full")
    assert full["bwd"] - none["bwd"] == pytest.approx(none["fwd"])                   # one more forward
    assert none["bwd"] > 1.9 * cm.fwd_bwd_gemm_time(cm.layer_gemms(m, 4096, 8), H100)[0]
    assert (none["tp_all_reduces"], full["tp_all_reduces"], none["tp_bytes"]) == (4, 6, 2 * 4096 * 5120)
    cp = cm.layer_time(m, H100, tp=2, cp=4)
    assert (cp["cp_collectives"], cp["cp_bytes"], cp["tp_bytes"]) == (3, 2 * 2 * 4096 * 5120 / 2, 2 * 1024 * 5120)


def test_step_time_composes_the_pieces():
    m, c = topo.LLAMA_70B, topo.H100_16x8
    t = planner.step_time(m, c, tp=8, pp=4, dp=4)
    mb = 1024 // 4
    lt = cm.layer_time(m, H100, 8)
    t_tp = 4 * cm.collective_time("all_reduce", 2 * 4096 * 8192, 8, c)
    t_pp = 2 * cm.collective_time("send", 2 * 4096 * 8192 / 8, 2, c, per_node=1)
    t_mb = 20 * (lt["fwd"] + lt["bwd"] + t_tp) + t_pp
    t_dp = cm.collective_time("all_reduce", 2 * 70e9 / 32, 4, c, per_node=1)
    assert t["step"] == pytest.approx((mb + 3) * t_mb + t_dp)
    assert t["bubble"] == pytest.approx(3 * t_mb)
    v2 = planner.step_time(m, c, tp=8, pp=4, dp=4, v=2)
    assert v2["bubble"] == pytest.approx(1.5 * (t_mb + t_pp))                       # (p-1)/v, v x the p2p
    assert 0 < t["mfu"] < cm.ETA_GEMM
