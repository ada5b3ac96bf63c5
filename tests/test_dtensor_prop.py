"""Week 7's ranks take two shortcuts through DTensor's sharding propagation, and both must give torch's own answers:
- output metadata from meta tensors (grader/rank/dtensor_meta.py), for exactly the ops the lab solution's plans run;
- sharding decisions from a table recorded once (grader/rank/dtensor_table.py, grader/judge/dtensor_tables.py).

Each rank of a 4-rank job runs every case of the week here in a forked child of its own, on a fake process group
(collectives move no data: only the propagation is compared, never the numbers), with the groups a job makes.
"""
from __future__ import annotations

import io
import os
import pickle

import pytest
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator

from grader.judge import dtensor_tables
from grader.judge.case import cases_of_week
from grader.rank import dtensor_meta, dtensor_table
from grader.rank.exchange import DTENSOR_TABLE

WORLD = 4


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


@pytest.fixture(scope="module")
def solution(tmp_path_factory):
    return dtensor_tables.solution_modules("week07", str(tmp_path_factory.mktemp("solution")))


@pytest.fixture(scope="module")
def table_bytes(solution):
    """The table as grader/judge/dtensor_tables.py records it (the last rank runs every item), written to bytes."""
    def record():
        seen = dtensor_table.record()
        dtensor_tables.run_week_as_rank("week07", solution, WORLD, WORLD - 1)
        buf = io.BytesIO()
        dtensor_table.dump(seen, buf)
        return buf.getvalue()
    return _in_child(record)


@pytest.fixture(scope="module")
def ranks(solution, table_bytes):
    """Per rank: the items it ran, and every schema it propagated, computed both ways for each shortcut."""
    def rank(r):
        table = dtensor_table.load(io.BytesIO(table_bytes))
        fake = dtensor_meta._fake_tensor_meta
        seen = {"ops": set(), "meta_differ": [], "answered": 0, "table_differ": [], "foreign_mesh": 0}

        def both_metas(self, op_schema):
            want = fake(self, op_schema)
            seen["ops"].add(str(op_schema.op))
            try:
                got = dtensor_meta.meta_tensor_meta(op_schema)
            except Exception as exc:          # noqa: BLE001  an op meta tensors cannot run stays on DTensor's path
                got = exc
            if got != want:
                seen["meta_differ"].append((str(op_schema.op), repr(got), repr(want)))
            return want
        ShardingPropagator._propagate_tensor_meta_non_cached = both_metas

        p = DTensor._op_dispatcher.sharding_propagator
        live = p.propagate_op_sharding_non_cached

        def both_answers(op_schema):
            want = live(op_schema)
            if op_schema in table:
                mesh = op_schema.args_spec[0].mesh
                got = dtensor_table.rebind(table[op_schema], mesh)
                seen["answered"] += 1
                if got != want:
                    seen["table_differ"].append((str(op_schema), repr(got), repr(want)))
                seen["foreign_mesh"] += sum(s.mesh is not mesh for s in _specs(got))
            return want
        p.propagate_op_sharding_non_cached = both_answers
        seen["items"] = dtensor_tables.run_week_as_rank("week07", solution, WORLD, r)
        return seen
    return [_in_child(rank, r) for r in range(WORLD)]


def _specs(x):
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
    if isinstance(x, DTensorSpec):
        return [x]
    if isinstance(x, (tuple, list)):
        return [s for v in x for s in _specs(v)]
    if isinstance(x, OpSchema):
        return _specs(x.args_schema) + _specs(list(x.kwargs_schema.values()))
    if isinstance(x, OutputSharding):
        return _specs(x.output_spec) + _specs(x.redistribute_schema)
    return []


def test_every_case_runs_at_every_size_on_the_ranks_of_a_job(ranks):
    want = {f"{c.name}@t{t}" for c in cases_of_week("week07") for t in c.world_sizes}
    assert set().union(*(set(r["items"]) for r in ranks)) == want
    assert set(ranks[-1]["items"]) == want      # the last rank runs every item: the table is recorded there


def test_meta_tensors_give_dtensors_metadata_for_every_op_of_the_solution_plan(ranks):
    ops = set().union(*(r["ops"] for r in ranks))
    differ = [d for r in ranks for d in r["meta_differ"]]
    meta_ops = ops - {op for op, _, _ in differ}
    listed = {str(op) for op in dtensor_meta.META_OPS}
    assert not [d for d in differ if d[0] in listed], differ
    assert listed == meta_ops, (
        f"META_OPS should be exactly the ops the solution plan runs whose metadata agrees: "
        f"add {sorted(meta_ops - listed)}, remove {sorted(listed - meta_ops)}")


def test_the_table_answers_as_live_propagation_does_on_every_rank_with_the_askers_mesh(ranks):
    for r, seen in enumerate(ranks):
        assert seen["answered"] > 300, f"rank {r}: only {seen['answered']} schemas found in the table"
        assert not seen["table_differ"], seen["table_differ"][:3]
        assert seen["foreign_mesh"] == 0, f"rank {r}: an answer kept the recording process's mesh"


def test_a_rank_with_both_installed_builds_no_fake_tensor_and_propagates_only_what_no_table_holds(
        solution, table_bytes, monkeypatch):
    faked = []
    monkeypatch.setattr(dtensor_meta, "_fake_tensor_meta", lambda self, op_schema: faked.append(str(op_schema.op)))

    def rank():
        live, propagated = ShardingPropagator.propagate_op_sharding_non_cached, []

        def counting(self, op_schema):
            out = live(self, op_schema)
            propagated.append((str(op_schema.op), dtensor_table.plain(op_schema) and dtensor_table.plain(out)))
            return out
        ShardingPropagator.propagate_op_sharding_non_cached = counting      # what the table falls back to
        dtensor_meta.install()
        dtensor_table.install(dtensor_table.load(io.BytesIO(table_bytes)))
        dtensor_tables.run_week_as_rank("week07", solution, WORLD, WORLD - 1)
        return faked, propagated
    faked_ops, propagated = _in_child(rank)
    assert faked_ops == []
    # the row-wise embedding (its answer's _MaskPartial holds a mask) and FSDP's _StridedShard weights: placements
    # that are more than a value, which no table holds
    assert 0 < len(propagated) < 20 and all(not plain for _, plain in propagated), propagated


class _Evil:
    def __reduce__(self):
        return os.system, ("true",)


def test_a_table_file_with_anything_but_dtensor_classes_is_refused():
    with pytest.raises(pickle.UnpicklingError, match="posix.system has no place"):
        dtensor_table.load(io.BytesIO(pickle.dumps([(_Evil(), None)])))


def test_a_rank_whose_tables_cannot_be_read_propagates_live(tmp_path):
    evil = tmp_path / "evil.pkl"
    evil.write_bytes(pickle.dumps([(_Evil(), None)]))

    def rank():
        from grader.rank import week07
        os.environ[DTENSOR_TABLE] = os.pathsep.join([str(tmp_path / "missing.pkl"), str(evil)])
        week07._warm_imports()
        p = DTensor._op_dispatcher.sharding_propagator
        return "propagate_op_sharding_non_cached" in vars(p), DTENSOR_TABLE in os.environ
    assert _in_child(rank) == (False, False)


def test_a_job_of_week_7_gets_its_table_in_its_folder_and_other_weeks_none(tmp_path):
    assert dtensor_tables.job_env(["week02"], str(tmp_path)) == {}
    env = dtensor_tables.job_env(["week07"], str(tmp_path))
    path = env[DTENSOR_TABLE]
    assert os.path.dirname(path) == str(tmp_path) and os.stat(path).st_mode & 0o777 == 0o600
    with open(path, "rb") as f:
        assert len(dtensor_table.load(f)) > 500
    assert dtensor_tables.missing(["week02", "week07"]) == []


def test_a_recording_that_fails_is_said_once_and_never_retried(tmp_path, monkeypatch):
    import subprocess
    calls = []

    def failing(*args, **kwargs):
        calls.append(args)
        return subprocess.CompletedProcess(args, 1, "", "Traceback ...\nKeyError: 'tp_plan'\n")
    monkeypatch.setattr(dtensor_tables, "CACHE", str(tmp_path))
    monkeypatch.setattr(dtensor_tables, "table_path", lambda week: str(tmp_path / f"{week}-k.pkl"))
    monkeypatch.setattr(dtensor_tables.subprocess, "run", failing)
    assert dtensor_tables.missing(["week07"]) == ["week07"]
    assert dtensor_tables.ensure("week07") is None and dtensor_tables.ensure("week07") is None
    assert len(calls) == 1
    assert "KeyError: 'tp_plan'" in (tmp_path / "week07-k.pkl.failed").read_text()
    assert dtensor_tables.missing(["week07"]) == [] and dtensor_tables.job_env(["week07"], str(tmp_path)) == {}
