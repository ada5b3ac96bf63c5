"""The checkpoint: every local tensor under its dense name with its global offset, so any layout can load it
(week 12 §6)."""
from __future__ import annotations

import torch

from reference.capstone.stage import Stage


def _meshes(groups):
    from torch.distributed.device_mesh import DeviceMesh
    return {dim: DeviceMesh.from_group(groups[dim][0], "cpu", mesh_dim_names=(dim,)) for dim in ("tp", "ep")}


def checkpoint_state(stage: Stage, opt, groups, step: int) -> dict:
    """Every local tensor as a DTensor of its dense parameter (a tp or ep shard: the global shape and this
    rank's offset are in it) or a plain tensor (replicated: saved once). torch.distributed.checkpoint saves each
    chunk once, under its dense name, and loads into any layout the chunks that overlap each rank's pieces."""
    from torch.distributed.tensor import DTensor, Shard
    meshes = _meshes(groups)
    sd = {"step": torch.tensor(step)}
    for name, p, rows, place in stage.shards():
        buf = opt.state.setdefault(p, {}).setdefault("momentum_buffer", torch.zeros_like(p))
        for key, x in (("model." + name, p.data), ("momentum." + name, buf)):
            x = x[rows[0]:rows[1]] if rows else x
            sd[key] = x if place is None else DTensor.from_local(x, meshes[place[0]], [Shard(place[1])],
                                                                 run_check=False)
    return sd


def save(path: str, stage: Stage, opt, groups, step: int):
    import torch.distributed.checkpoint as dcp
    dcp.save(checkpoint_state(stage, opt, groups, step), checkpoint_id=path)


def load(path: str, stage: Stage, opt, groups) -> int:
    """Fill this layout's shards (weights and momentum) from a checkpoint saved in any layout; returns its step."""
    import torch.distributed.checkpoint as dcp
    sd = checkpoint_state(stage, opt, groups, 0)
    dcp.load(sd, checkpoint_id=path)
    with torch.no_grad():            # the loaded pieces back into the (fused) local tensors
        for name, p, rows, place in stage.shards():
            for key, x in (("model." + name, p.data), ("momentum." + name, opt.state[p]["momentum_buffer"])):
                src = sd[key] if place is None else sd[key].to_local()
                (x[rows[0]:rows[1]] if rows else x).copy_(src)
    return int(sd["step"])
