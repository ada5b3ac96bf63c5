"""DTensor helpers: meshes on a case's group, local shard shapes and grads, SP padding, memory ledgers.

Shared by the Week 7 grader cases and lectures and by students (never copied between notebooks).
"""
from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor



def tp_mesh_for(group, device_type: str = "cpu"):
    """A 1-D DeviceMesh named "tp" over `group` (None: the whole world).

    `init_device_mesh` always spans the default group; for a sub-group (the grader runs t=2 on
    ranks 2 and 3 of a 4-rank job) `DeviceMesh.from_group` wraps the existing group.
    """
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    if group is None:
        return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("tp",))
    return DeviceMesh.from_group(group, device_type, mesh_dim_names=("tp",))


def local_shape(p: torch.Tensor) -> list[int]:
    """The shape this rank actually stores: a DTensor's local shard, else the tensor itself."""
    return list(p.to_local().shape) if isinstance(p, DTensor) else list(p.shape)


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """This rank's gradient in the parameter's own layout (what an optimizer step would use).

    DTensor may leave a grad in another placement than its parameter: Partial for a replicated norm
    weight under SP, Replicate for the embedding; redistributing to the parameter's placements gives
    the shard this rank owns.
    """
    g = p.grad
    if g is None:
        return None
    if isinstance(g, DTensor) and isinstance(p, DTensor):
        return g.redistribute(p.device_mesh, p.placements).to_local()
    if isinstance(g, DTensor):
        return g.full_tensor()
    return g


def unsharded_linears(model: torch.nn.Module) -> list[str]:
    """Names of nn.Linear / nn.Embedding modules whose weight is not a DTensor (no plan key matched)."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) and not isinstance(m.weight, DTensor):
            out.append(name)
    return out


@contextmanager
def quiet_redistribute_warnings():
    """full_tensor() of a 2-D (FSDP x TP) parameter logs a 'suboptimal' warning on stderr; a grade cell must stay quiet."""
    lg = logging.getLogger("torch.distributed.tensor._redistribute")
    old = lg.level
    lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        lg.setLevel(old)


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _ptr(t) -> int:
    try:
        return _local(t).untyped_storage().data_ptr()
    except Exception:      # noqa: BLE001
        return -1


def state_bytes(model: torch.nn.Module, optimizer=None) -> dict:
    """Bytes this rank stores for parameters, gradients and optimizer state (local shards of DTensors)."""
    def nb(t):
        t = _local(t)
        return t.numel() * t.element_size()
    out = {"params": sum(nb(p) for p in model.parameters()),
           "grads": sum(nb(p.grad) for p in model.parameters() if p.grad is not None), "optimizer": 0}
    if optimizer is not None:
        for st in optimizer.state.values():
            out["optimizer"] += sum(nb(v) for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return out


class SavedActivations:
    """Bytes of tensors autograd keeps for backward on this rank, each storage counted once.

    Measured with saved_tensors_hooks (local shards for DTensors). Parameters are excluded by storage,
    looked up at pack time so FSDP2's temporarily unsharded weights are excluded too. A checkpointed
    layer saves nothing through these hooks: its input (what checkpointing keeps) is added by a
    forward pre-hook on each module in `checkpointed`.
    """

    def __init__(self, model: torch.nn.Module, checkpointed=()):
        self.model = model
        self.bytes = 0
        self._seen: set = set()
        self._handles = [m.register_forward_pre_hook(self._keep_input) for m in checkpointed]

    def _add(self, t):
        local = _local(t)
        k = _ptr(t)
        if k in self._seen:
            return
        self._seen.add(k)
        self.bytes += local.untyped_storage().nbytes()

    def _keep_input(self, module, args):
        for a in args:
            if isinstance(a, torch.Tensor):
                self._add(a)

    def _pack(self, t):
        if isinstance(t, torch.Tensor) and t.layout == torch.strided:
            if _ptr(t) not in {_ptr(p) for p in self.model.parameters()}:
                self._add(t)
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        return self._ctx.__exit__(*exc)
