"""DTensor's sharding decisions, computed once for the class and looked up by every Week 7 rank.

A DTensor op with a new (op, global shapes, placements, arguments) runs sharding propagation: every strategy the
op has, each with the cost of redistributing the inputs to it, then the cheapest
(`ShardingPropagator.propagate_op_sharding_non_cached`). The answer depends on that schema and the torch version
only, yet every rank of every job computed it again: 0.6 to 0.9 ms a schema, and a Week 7 rank meets 330 to 570.
The grader records the answers once per torch version and lab solution, running the solution's plans as a job's
last rank (grader/judge/dtensor_tables.py), and the launcher loads them before it forks the ranks. A schema in the
table is a lookup; any other, and every schema while something traces (`torch.compile`), is propagated as torch
does it.

The answers hold the mesh of the process that recorded them; a hit gets the asking schema's own mesh, whose groups
are this rank's (a mesh compares equal across processes: DeviceMesh.__eq__ ignores group names). What a rank sees
here: the placements DTensor chooses for the solution's plans on the lab's shapes (the lab's rules state them),
never a tensor. A placement that carries state (the row-wise embedding's _MaskPartial holds its mask) is never
recorded. `tests/test_dtensor_prop.py` checks every answer against live propagation on every rank.
"""
from __future__ import annotations

import dataclasses
import os
import pickle

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor._sharding_prop import _are_we_tracing
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from grader.rank.exchange import DTENSOR_TABLE

PLAIN = (Shard, Replicate, Partial)     # placements that are values: equal placements, equal meaning
# where the classes of a table come from (anything else in a table file is refused)
_MODULES = ("torch.distributed.tensor._op_schema", "torch.distributed.tensor._dtensor_spec",
            "torch.distributed.tensor.placement_types", "torch.distributed._mesh_layout")
_TORCH_VALUES = (torch.dtype, torch.memory_format, torch.layout)


def _propagator():
    return DTensor._op_dispatcher.sharding_propagator


def plain(x) -> bool:
    """Whether `x` (a schema, an answer, or part of one) holds only plain placements."""
    if isinstance(x, DTensorSpec):
        return all(type(p) in PLAIN for p in x.placements)
    if isinstance(x, (tuple, list)):
        return all(plain(v) for v in x)
    if isinstance(x, dict):
        return all(plain(v) for v in x.values())
    if isinstance(x, OpSchema):
        return plain(x.args_schema) and plain(x.kwargs_schema)
    if isinstance(x, OutputSharding):
        return plain(x.output_spec) and plain(x.redistribute_schema)
    return True


def rebind(x, mesh: DeviceMesh):
    """`x` (an answer, or part of one) with every spec on `mesh`."""
    if isinstance(x, DTensorSpec):
        return dataclasses.replace(x, mesh=mesh)
    if isinstance(x, (tuple, list)):
        return type(x)(rebind(v, mesh) for v in x)
    if isinstance(x, OpSchema):
        return OpSchema(x.op, rebind(x.args_schema, mesh), {k: rebind(v, mesh) for k, v in x.kwargs_schema.items()},
                        schema_info=x.schema_info)
    if isinstance(x, OutputSharding):
        return OutputSharding(rebind(x.output_spec, mesh), rebind(x.redistribute_schema, mesh), x.needs_redistribute,
                              x.use_val_from_redistribute_schema)
    return x


def record() -> list[tuple[OpSchema, OutputSharding]]:
    """From now on, every plain schema this process propagates and its answer are appended to the list returned."""
    p = _propagator()
    live, seen = p.propagate_op_sharding_non_cached, []

    def propagate(op_schema):
        out = live(op_schema)
        if not _are_we_tracing() and plain(op_schema) and plain(out):
            seen.append((op_schema, out))
        return out
    p.propagate_op_sharding_non_cached = propagate
    return seen


def install(table: dict):
    """In a rank process (the launcher, before the fork): a schema in `table` is answered from it."""
    p = _propagator()
    live = p.propagate_op_sharding_non_cached

    def propagate(op_schema):
        answer = None if _are_we_tracing() else table.get(op_schema)
        meshes = {s.mesh for s in op_schema.args_spec}
        if answer is None or len(meshes) != 1:
            return live(op_schema)
        return rebind(answer, meshes.pop())
    p.propagate_op_sharding_non_cached = propagate


def install_from_env():
    """In a rank process: install the tables the grader named in the job's environment (exchange.DTENSOR_TABLE),
    once; the variable goes, so no rank sees where they were."""
    table = {}
    for path in filter(None, os.environ.pop(DTENSOR_TABLE, "").split(os.pathsep)):
        try:
            with open(path, "rb") as f:
                table.update(load(f))
        except Exception:   # noqa: BLE001  a table is a shortcut: one this process may not read (torchrun's ranks)
            pass            # or cannot load leaves every schema to live propagation
    if table:
        install(table)


def _spec(state: dict) -> DTensorSpec:
    spec = object.__new__(DTensorSpec)
    spec.__dict__.update(state)
    spec.__dict__["_hash"] = None      # a hash from another process (string hashes are salted per process)
    return spec


class _Writer(pickle.Pickler):
    """Ops by name, meshes by what DeviceMesh.__eq__ compares (no process group), specs without their hash."""

    def persistent_id(self, obj):
        if isinstance(obj, torch._ops.OpOverload):
            return ("op", obj.namespace, obj._overloadpacket.__name__, obj._overloadname)
        if isinstance(obj, DeviceMesh):
            return ("mesh", obj._flatten_rank_map, obj._layout, obj._device_type, obj._mesh_dim_names, obj._thread_id)
        return None

    def reducer_override(self, obj):
        if type(obj) is DTensorSpec:
            return _spec, ({k: v for k, v in obj.__dict__.items() if k != "_hash"},)
        return NotImplemented


class _Reader(pickle.Unpickler):
    def persistent_load(self, pid):
        if pid[0] == "op":
            return getattr(getattr(getattr(torch.ops, pid[1]), pid[2]), pid[3])
        if pid[0] != "mesh":
            raise pickle.UnpicklingError(f"{pid[0]!r} has no place in a DTensor table")
        mesh = DeviceMesh.__new__(DeviceMesh)       # compares equal to a rank's mesh; never runs a collective
        mesh._flatten_rank_map, mesh._layout, mesh._device_type, mesh._mesh_dim_names, mesh._thread_id = pid[1:]
        return mesh

    def find_class(self, module, name):
        if (module, name) == (__name__, "_spec"):
            return _spec
        if module in _MODULES or module in ("torch", "torch._utils"):
            value = super().find_class(module, name)
            if (isinstance(value, type) and module in _MODULES or value is torch.Size
                    or isinstance(value, _TORCH_VALUES)):
                return value
        raise pickle.UnpicklingError(f"{module}.{name} has no place in a DTensor table")


def dump(entries: list[tuple[OpSchema, OutputSharding]], f):
    _Writer(f, protocol=pickle.HIGHEST_PROTOCOL).dump(entries)


def load(f) -> dict:
    return dict(_Reader(f).load())
