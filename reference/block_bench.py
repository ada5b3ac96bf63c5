"""Strong-scaling benchmark of one decoder block (Week 3 lecture): `python -m reference.block_bench OUT.json`.

Run on n ranks (launch.run("reference.block_bench", n, [path])): n = 1 times the dense
`tpkit.models.DecoderLayer`, n > 1 the Megatron TP block (`reference.sp_layers.ParallelDecoderLayer(mode="tp")`),
forward + backward, one thread per rank, every rank busy (no idle rank polling a barrier).
Each iteration starts after a barrier; the result is the median after warm-up, the max over
ranks (a step ends when its slowest rank ends). Also times one all-reduce of (B, T, C) alone.
On CPU/gloo these are "this machine" numbers, never GPU figures.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.distributed as dist


def median_time(fn, warmup: int, iters: int, sync: bool) -> float:
    ts = []
    for _ in range(warmup + iters):
        if sync:
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[warmup:])


def main(out_path: str, B: int = 2, T: int = 128, C: int = 256, F: int = 1024, warmup: int = 3, iters: int = 10) -> int:
    from launch.dist import init_process_group
    from tpkit.models import DecoderLayer, ModelConfig, init_weights
    from reference.sp_layers import ParallelDecoderLayer
    rank, world, _ = init_process_group()
    torch.set_num_threads(1)
    cfg = ModelConfig(hidden_size=C, intermediate_size=F, num_attention_heads=8, num_key_value_heads=4)
    dense = init_weights(DecoderLayer(cfg), seed=0)          # the same weights on every rank, then split
    layer = dense if world == 1 else ParallelDecoderLayer(dense, mode="tp")
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(B, T, C, generator=g), torch.randn(B, T, C, generator=g)

    def step():
        xx = x.clone().requires_grad_(True)
        layer(xx).backward(dy)                                # (B, T, C) in and out

    buf = torch.randn(B, T, C)
    res = torch.tensor([median_time(step, warmup, iters, world > 1),
                        median_time(lambda: dist.all_reduce(buf), warmup, iters, True) if world > 1 else 0.0])
    if world > 1:
        dist.all_reduce(res, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"t": world, "step_s": res[0].item(), "allreduce_s": res[1].item(),
                       "shape": [B, T, C, F], "warmup": warmup, "iters": iters}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
