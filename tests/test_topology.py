"""Unit tests of week 9's planner (reference/planner.py, tpkit/topology.py) and schedule simulator (tpkit/pipeline.py) formulas."""
import math

import pytest

from tpkit import pipeline as pl
from tpkit import topology as topo
from reference import planner, schedules

GB = topo.GB
M70, C128 = topo.LLAMA_70B, topo.H100_16x8


def test_memory_terms_match_the_formulas():
    mem = planner.memory_per_gpu(M70, C128, tp=8, pp=2, dp=8)
    P = 70e9
    assert mem["weights"] == pytest.approx(2 * P / 16)
    assert mem["grads"] == pytest.approx(2 * P / 16)
    assert mem["optimizer"] == pytest.approx(12 * P / 128)
    # Korthikanti Table 2, TP+SP+selective: sbh*34/t per layer; 1F1B keeps min(p, m) micro-batches of L/p layers
    assert mem["activations"] == pytest.approx(40 * 2 * 4096 * 8192 * 34 / 8)


def test_activation_rows_of_korthikanti_table2():
    s, b, h, a, t = 2048, 1, 4096, 32, 4
    sbh = s * b * h
    assert topo.activation_bytes_per_layer(s, b, h, a, 1, recompute="none") == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert topo.activation_bytes_per_layer(s, b, h, a, t, sp=False, recompute="none") == pytest.approx(
        sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert topo.activation_bytes_per_layer(s, b, h, a, t, recompute="none") == pytest.approx(
        sbh * (34 / t + 5 * a * s / (h * t)))
    assert topo.activation_bytes_per_layer(s, b, h, a, t, sp=False) == pytest.approx(sbh * (10 + 24 / t))
    assert topo.activation_bytes_per_layer(s, b, h, a, t) == pytest.approx(sbh * 34 / t)
    assert topo.activation_bytes_per_layer(s, b, h, a, t, recompute="full") == pytest.approx(2 * sbh)


def test_activation_memory_of_stage0_does_not_shrink_with_pp():
    acts = {pp: planner.memory_per_gpu(M70, C128, 8, pp, 128 // (8 * pp))["activations"] for pp in (1, 2, 4, 8)}
    assert len({round(v) for v in acts.values()}) == 1


def test_step_time_ignores_tp_and_pp_terms_when_absent():
    """The full composition is checked in tests/test_costmodel.py; here: no TP, no PP, no communication of theirs."""
    t = planner.step_time(M70, C128, 1, 1, 128)
    assert t["tp"] == 0 and t["pp"] == 0 and t["bubble"] == 0


def test_uneven_stages_take_the_fullest_one():
    m = topo.ModelSpec("30 layers", 7e9, 30, 4096, 32, 2048, 48)
    c = topo.ClusterSpec(n_nodes=1)
    assert planner.memory_per_gpu(m, c, 2, 4, 1)["activations"] == pytest.approx(8 * 4 * 2048 * 4096 * 34 / 2)
    m32 = topo.ModelSpec("32 layers", 7e9, 32, 4096, 32, 2048, 48)        # 8 layers per stage as well
    assert planner.step_time(m, c, 2, 4, 1)["step"] == planner.step_time(m32, c, 2, 4, 1)["step"]


def test_plan_picks_llama3s_layout_and_mfu():
    """Llama 3 405B on 8,192 H100s (llama3-2024 Table 4: TP 8, PP 16, DP 64, 43% MFU), gradients sharded as by FSDP."""
    m = topo.ModelSpec("405B", 405e9, 126, 16384, 128, 8192, global_batch=2048, ffn=53248, kv_heads=8,
                       vocab=128256, gated_mlp=True, dropout=False)
    best = planner.plan(m, topo.ClusterSpec(n_nodes=1024, gpu="H100", nic="RoCE 400"), zero=2)
    assert (best.tp, best.pp, best.dp) == (8, 16, 64)
    assert abs(best.time["mfu"] / 0.43 - 1) <= 0.15


def test_plan_keeps_tp_inside_a_node_and_fits():
    for model, cluster in [(M70, C128), (topo.ModelSpec("20B", 20e9, 8, 6144, 48, 2048, 32),
                                         topo.ClusterSpec(n_nodes=8, gpus_per_node=4, gpu_mem=40 * GB))]:
        best = planner.plan(model, cluster)
        assert cluster.gpus_per_node % best.tp == 0
        assert best.tp * best.pp * best.dp == cluster.n_gpus
        assert best.memory_total <= cluster.gpu_mem
        for tp, pp, dp in planner.candidates(model, cluster):
            other = planner.evaluate(model, cluster, tp, pp, dp)
            if other.memory_total <= cluster.gpu_mem:
                assert best.step_time <= other.step_time * (1 + 1e-9)


def test_plan_70b_on_16x8_h100():
    best = planner.plan(M70, C128)
    assert (best.tp, best.pp, best.dp) == (2, 8, 8)
    assert best.memory_total / GB == pytest.approx(69.70, abs=0.01)


def test_plan_rejects_what_cannot_fit():
    assert planner.plan(topo.ModelSpec("1T", 1e12, 128, 25600, 160, 2048, 512), topo.ClusterSpec(n_nodes=1)) is None


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 8), (3, 7), (8, 32)])
def test_simulated_bubble_matches_formula(p, m):
    for sched in (schedules.gpipe(p, m), schedules.one_f_one_b(p, m)):
        tl = pl.simulate(sched)
        assert not tl.problems
        assert tl.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert pl.simulate(schedules.gpipe(p, m)).peak_in_flight == [m] * p
    assert pl.simulate(schedules.one_f_one_b(p, m)).peak_in_flight == [min(p - s, m) for s in range(p)]


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 4, 3)])
def test_interleaved_bubble(p, m, v):
    tl = pl.simulate(schedules.interleaved_1f1b(p, m, v), m=m, v=v)
    assert not tl.problems
    assert tl.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


def test_simulator_names_a_dependency_violation():
    bad = schedules.one_f_one_b(3, 4)
    bad[2] = [("B", 0)] + [a for a in bad[2] if a != ("B", 0)]     # last stage: B(0) before F(0)
    tl = pl.simulate(bad)
    assert tl.stuck[:2] == (2, 0) and "needs F(mb 0)" in tl.problems[-1]
    assert math.isfinite(tl.makespan)
