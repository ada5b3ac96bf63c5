"""Week 7's ranks learn DTensor's output metadata from meta tensors (grader/rank/dtensor_meta.py): the same
metadata as DTensor's fake tensors, for exactly the ops the lab solution's plans run.

Each case of the week runs here in one process per (t, rank), on a fake process group (collectives move no
data: only the metadata is compared, never the numbers), with every schema DTensor propagates computed both ways.
"""
from __future__ import annotations

import importlib.util
import os
import pickle
import warnings

import nbformat
import pytest
import torch
import torch.distributed as dist

from grader import ROOT
from grader.autograde.notebook import module_sources
from grader.judge.case import get_case
from grader.rank import dtensor_meta, week07
from grader.rank.context import RankContext
from tpkit.ledger import CommLedger

CASES = ["block", "block_hidden", "model", "model_hidden", "padding", "padding_hidden", "fsdp_tp", "fsdp_tp_hidden"]


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    nb = nbformat.read(f"{ROOT}/solutions/week07/dtensor_plan.ipynb", as_version=4)
    path = tmp_path_factory.mktemp("plan") / "tp_plan.py"
    path.write_text(module_sources(nb)["tp_plan.py"])
    spec = importlib.util.spec_from_file_location("tp_plan", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run_rank(plan, t, r) -> set[str]:
    """Rank r of t runs every case of the week that runs at t, on a fake process group; returns the cases run."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=t)
    ran = set()
    for name in CASES:
        case = get_case(f"week07/{name}")
        if t in case.world_sizes:
            full = case.make_inputs(case.config, torch.Generator().manual_seed(0))
            ctx = RankContext(rank=r, world_size=t, group=None, device=torch.device("cpu"),
                              ledger=CommLedger(group_size=t))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                getattr(week07, case.run_rank)(plan, case.config, case.rank_inputs(case.config, full, r, t), ctx)
            ran.add(name)
    return ran


def _in_child(fn, *args):
    """fn(*args) in a forked child, as a rank is (its own process group and cold DTensor caches); its result."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            out = pickle.dumps(fn(*args))
        except BaseException as exc:     # noqa: BLE001  raised again in the parent
            out, code = pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}")), 1
        with os.fdopen(write, "wb") as f:
            f.write(out)
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        result = pickle.loads(f.read())
    os.waitpid(pid, 0)
    if isinstance(result, BaseException):
        raise result
    return result


def test_meta_tensors_give_dtensors_metadata_for_every_op_of_the_solution_plan(plan, monkeypatch):
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    fake = dtensor_meta._fake_tensor_meta
    ops, cases, differ = set(), set(), []

    def both(self, op_schema):
        want = fake(self, op_schema)
        ops.add(str(op_schema.op))
        try:
            got = dtensor_meta.meta_tensor_meta(op_schema)
        except Exception as exc:            # noqa: BLE001  an op meta tensors cannot run stays on DTensor's path
            got = exc
        if got != want:
            differ.append((str(op_schema.op), got, want))
        return want

    monkeypatch.setattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", both)

    def rank(t, r):
        return _run_rank(plan, t, r), ops, differ
    for t in (2, 4):
        for r in range(t):
            ran, rank_ops, rank_differ = _in_child(rank, t, r)
            cases |= ran
            ops |= rank_ops
            differ += rank_differ
    assert cases == set(CASES)
    meta_ops = ops - {op for op, _, _ in differ}
    listed = {str(op) for op in dtensor_meta.META_OPS}
    assert not [d for d in differ if d[0] in listed], differ
    assert listed == meta_ops, (
        f"META_OPS should be exactly the ops the solution plan runs whose metadata agrees: "
        f"add {sorted(meta_ops - listed)}, remove {sorted(listed - meta_ops)}")


def test_a_rank_with_it_installed_never_builds_fake_tensors_for_the_solution_plan(plan, monkeypatch):
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    monkeypatch.setattr(ShardingPropagator, "_propagate_tensor_meta_non_cached",
                        ShardingPropagator._propagate_tensor_meta_non_cached)     # undone after the test
    faked = []
    monkeypatch.setattr(dtensor_meta, "_fake_tensor_meta", lambda self, op_schema: faked.append(str(op_schema.op)))
    dtensor_meta.install()

    def rank():
        _run_rank(plan, 2, 1)
        return faked
    assert _in_child(rank) == []
