"""reference.capstone (week 12): the degrees object, the groups, the dense model's MoE against week 11's, and on
4 ranks a TP2 x PP2 run and a TP2 x DP2 x EP2 (SP) run against the single-device one, every step; a checkpoint
saved in the first layout and resumed in TP4; the bytes per dimension against the derived counts.

The multi-rank part is this file run as a script on 4 ranks (`python tests/test_capstone.py`)."""
import os
import shutil
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from reference import capstone as cap  # noqa: E402
from tpkit.capstone_model import CapstoneConfig, LlamaMoE, MoELayer, init_capstone  # noqa: E402


@pytest.mark.parametrize("bad", [dict(tp=0), dict(tp=2, pp=2.0), dict(dp=3, ep=2), dict(dp=True)])
def test_degrees_refused(bad):
    with pytest.raises(ValueError):
        cap.ParallelDims(**bad)


def test_layout_validated_against_the_model():
    cfg = CapstoneConfig()
    for dims, world in [(cap.ParallelDims(tp=2, pp=2, dp=2), 4), (cap.ParallelDims(tp=8), 8),
                        (cap.ParallelDims(pp=3), 3), (cap.ParallelDims(dp=8), 8),
                        (cap.ParallelDims(tp=4, sp=True), 4)]:
        with pytest.raises(ValueError):
            dims.validate(cfg, batch=8, seq=6, n_micro=2, world=world)
    cap.ParallelDims(tp=2, pp=2, dp=2, ep=2, sp=True).validate(cfg, batch=8, seq=8, n_micro=2, world=8)


def test_groups_partition_the_world_tp_fastest():
    dims = cap.ParallelDims(tp=2, pp=2, dp=4, ep=2)
    groups = dims.all_groups()
    for dim, gs in groups.items():
        assert sorted(r for g in gs for r in g) == list(range(16)), dim
    assert groups["tp"][0] == [0, 1] and groups["pp"][0] == [0, 8] and groups["dp"][0] == [0, 2, 4, 6]
    assert groups["ep"][0] == [0, 2] and groups["edp"][0] == [0, 4]
    for r in range(16):
        c = dims.coords(r)
        assert dims.rank_of(c["pp"], c["dp"], c["tp"]) == r and c["dp"] == c["edp"] * 2 + c["ep"]


def test_dense_moe_layer_is_week11_dropless():
    from reference.expert_parallel import dense_moe
    cfg = CapstoneConfig()
    moe = next(m for m in init_capstone(LlamaMoE(cfg), 3).modules() if isinstance(m, MoELayer))
    x = torch.randn(2, 5, cfg.model.hidden_size, generator=torch.Generator().manual_seed(0))
    n = moe.norm(x).flatten(0, 1)
    want, _ = dense_moe(n, moe.router, moe.w1, moe.w2, cfg.top_k, cfg.n_experts / cfg.top_k, 1)   # capacity = N
    assert torch.allclose(moe(x), x + want.view_as(x), atol=1e-6)


def test_capstone_on_4_ranks():
    from tests.procs import every_rank_says_ok
    every_rank_says_ok(__file__, 4, timeout=180)


def _rank_main():
    import torch.distributed as dist

    from launch.dist import init_process_group
    rank, world, _ = init_process_group()
    torch.set_num_threads(1)
    cfg, B, T, M, SEED, N = CapstoneConfig(), 8, 8, 2, 5, 6
    data = cap.batches(cfg, N, B, T, seed=6)
    ref, states = cap.dense_run(cfg, SEED, data, keep=(3,))
    experts = cap.moe_tokens_experts(cfg, SEED, data[0][0])
    path = os.path.join(tempfile.gettempdir(), f"test_capstone_{os.getppid()}")
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)

    def train(dims, steps, load=False, save_at=None):
        groups = cap.build_groups(dims, rank)
        dense = init_capstone(LlamaMoE(cfg), SEED)
        if load:
            with torch.no_grad():
                for p in dense.parameters():
                    p.fill_(float("nan"))
        stage = cap.Stage(dense, dims, groups, rank)
        opt = cap.make_optimizer(stage)
        if load:
            assert cap.load(path, stage, opt, groups) == steps[0]
        for i in steps:
            led = cap.DimLedger(groups)
            with led:
                loss = cap.train_step(stage, *cap.data_of_rank(*data[i], dims, rank), M, groups)
            if i == 0:
                want = cap.expected_bytes(cfg, dims, rank, B, T, M, experts)
                assert all(abs(led.per_dim().get(d, 0.0) - want[d]) < 1e-6 for d in want), (dims, led.per_dim(), want)
            opt.step()
            opt.zero_grad()
            if loss is not None:
                assert abs(loss.item() - ref[i]) < 1e-5, (dims, i, loss.item(), ref[i])
            if save_at is not None and i + 1 == save_at:
                cap.save(path, stage, opt, groups, save_at)
        c, last = dims.coords(rank), steps[-1] + 1
        state = states[last]
        for name, p, rows, place in stage.shards():
            got = p.detach()[rows[0]:rows[1]] if rows else p.detach()
            assert torch.allclose(got, cap.dense_shard(state, name, place, c, dims), atol=1e-5), name

    train(cap.ParallelDims(tp=2, pp=2), range(N))
    train(cap.ParallelDims(tp=2, dp=2, ep=2, sp=True), range(3), save_at=3)
    dist.barrier()
    train(cap.ParallelDims(tp=4, sp=True), range(3, N), load=True)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    print("ok", flush=True)


if __name__ == "__main__":
    _rank_main()
