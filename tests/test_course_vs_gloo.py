"""The course backend against gloo, with PyTorch's own distributed tests as the judge.

Grading runs a student's ranks on the "course" backend (launch/course_pg.py: every collective is carried out and
recorded by the launcher's switchboard); a student develops on gloo (or NCCL). Correct code must get the same answer
on both. Here the upstream `_DistTestBase` methods shipped in the installed wheel
(torch/testing/_internal/distributed/distributed_test.py) run on the course backend and on gloo, at 2 and 4 ranks,
and any divergence not listed in DELIBERATE (with its reason) fails the test.

How the upstream methods run outside their multiprocess harness: each rank of `python -m launch.forkrun` (the
switchboard's launcher for the course backend, a plain one for gloo) builds one instance of upstream's test class
(`TestDistBackend` + `_DistTestBase`, as test_distributed_spawn.py combines them) with `rank` set and, for each
method in turn, does what upstream's `_run` does: a fresh `init_process_group` (course: a switchboard item per
method, so a failing method cannot leave collectives behind for the next; gloo: a fresh store prefix), a barrier,
the method, a barrier, `destroy_process_group`. The module is imported with BACKEND=gloo, so upstream's own choice
of what runs on CPU/gloo and what it expects apply to both backends; it is imported once, before the ranks are
forked (`--preload`). Upstream skips some methods on CPU or below 8 ranks although they run on 4 CPU ranks (the
`_group` methods, all_to_all_single): FORCED runs them anyway, on both backends.

Besides upstream's methods the ranks run a few checks of their own (`x_*`), compared the same way: what every
op's `Work.get_future()` and `Work.result()` carry, a DDP model trained 3 steps (plain, a
`get_future().then(...)` comm hook, the fp16 compress hook, `no_sync` accumulation), bitwise reductions on integer
and bool tensors, `distribute_tensor` with its default `src_data_rank=0`, an in-place all-reduce on a strided view.
`x_course_*` run on the course backend only: calls gloo rejects (some of which leave gloo's group broken or abort
the process, so gloo cannot be the control there) are rejected with a message that names what to use instead, and
the switchboard's record of the rooted collectives.

The four launches (course and gloo, 2 and 4 ranks) run at once: their ranks mostly wait on each other.
"""
import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from grader import ROOT

pytestmark = pytest.mark.xdist_group("course_vs_gloo")    # the four launches run once, on one xdist worker

UPSTREAM = """
    test_get_rank test_get_backend test_Backend_enum_class test_destroy_group test_get_rank_size_group
    test_destroy_full_group test_get_rank_size_full_group test_new_subgroups_with_group_param
    test_batch_isend_irecv_gloo test_batch_isend_irecv_gloo_tags test_send_recv test_send_recv_any_source
    test_send_recv_with_tag test_isend test_irecv test_broadcast test_broadcast_full_group
    test_reduce_sum test_reduce_product test_reduce_min test_reduce_max test_reduce_full_group_sum
    test_reduce_full_group_product test_reduce_full_group_min test_reduce_full_group_max test_reduce_sum_twice
    test_all_reduce_sum test_all_reduce_sum_async test_all_reduce_sum_complex test_all_reduce_complex_unsupported_ops
    test_all_reduce_product test_all_reduce_min test_all_reduce_max test_all_reduce_full_group_sum
    test_all_reduce_full_group_product test_all_reduce_full_group_min test_all_reduce_full_group_max
    test_sparse_all_reduce_sum test_all_reduce_coalesced_max_complex_unsupported test_all_reduce_coalesced_sum
    test_all_reduce_coalesced_product test_all_reduce_coalesced_min test_all_reduce_coalesced_max
    test_all_reduce_coalesced_full_group_sum test_all_reduce_coalesced_full_group_product
    test_all_reduce_coalesced_full_group_min test_all_reduce_coalesced_full_group_max
    test_scatter_checks test_scatter test_scatter_complex test_scatter_full_group
    test_gather_checks test_gather test_gather_full_group
    test_all_gather test_all_gather_complex test_all_gather_full_group
    test_all_gather_coalesced_simple test_all_gather_coalesced_complex test_all_gather_coalesced_full_group
    test_all_gather_coalesced_with_empty test_barrier
    test_DistributedDataParallelCPU test_DistributedDataParallelCPU_grad_is_view
    test_DistributedDataParallel_requires_grad test_ddp_create_graph
    test_accumulate_gradients_no_sync test_accumulate_gradients_no_sync_grad_is_view
    test_accumulate_gradients_no_sync_allreduce_hook test_accumulate_gradients_no_sync_allreduce_with_then_hook
    test_get_future test_ddp_logging_data_cpu test_static_graph_api_cpu
    test_all_gather_object_default_pg test_all_gather_object_subgroup test_gather_object test_gather_object_subgroup
    test_grads_same_across_ranks_with_no_sync test_scatter_object_list
""".split()
# skipped by upstream on CPU/gloo ("Only MPI supports ...") or below 8 ranks, yet they run on CPU ranks: forced, on
# both backends (test_all_to_all* use uneven tensors in the list form, which gloo rejects: both fail alike)
FORCED = """
    test_all_to_all_single_equal_split test_all_to_all_single_equal_split_complex test_all_to_all_single_unequal_split
    test_all_to_all_single_unequal_split_complex test_all_to_all_single_equal_split_full_group
    test_all_to_all_single_unequal_split_full_group test_all_to_all test_all_to_all_complex test_all_to_all_full_group
""".split()
FORCED_4 = """
    test_new_subgroups_group_size_exceeds_world_size test_new_subgroups_world_size_not_divisible_by_group_size
    test_new_subgroups_by_enumeration_input_rank_exceeds_world_size
    test_new_subgroups_by_enumeration_negative_input_rank
    test_new_subgroups_overlap_not_allowed test_broadcast_group test_reduce_group_sum test_reduce_group_product
    test_reduce_group_min test_reduce_group_max test_all_reduce_group_sum test_all_reduce_group_product
    test_all_reduce_group_min test_all_reduce_group_max test_all_reduce_coalesced_group_sum
    test_all_reduce_coalesced_group_product test_all_reduce_coalesced_group_min test_all_reduce_coalesced_group_max
    test_scatter_group test_gather_group test_all_gather_group test_all_gather_coalesced_group
    test_all_to_all_single_equal_split_group test_all_to_all_single_unequal_split_group test_barrier_group
""".split()
CHECKS = ["x_futures", "x_ddp_three_steps", "x_bitwise", "x_distribute_tensor", "x_strided_view", "x_reduce_elsewhere",
          "x_large_payloads"]
COURSE_CHECKS = ["x_course_rejects", "x_course_rooted", "x_course_arena"]

# where the course backend answers differently from gloo on purpose: "method" or "method[key]", "@N" when only at N
# ranks -> why
DELIBERATE = {
    "test_get_backend": "dist.get_backend() names the backend that carries the job: 'course', not 'gloo'",
    "x_futures[reduce_scatter]": "gloo's reduce_scatter Work has no future ('Work::getFuture not implemented') nor "
                                 "result(); the course backend's carries the output, as NCCL's does",
    "x_futures[reduce_scatter_tensor]": "as reduce_scatter: gloo has no future here, course (as NCCL) the output",
    "x_futures[isend]": "gloo's send Work has no future nor result(); course's carries the tensor sent, as NCCL's",
    "x_futures[irecv]": "gloo's recv Work has no future nor result(); course's carries the tensor received, as NCCL's",
    "x_strided_view": "gloo is silently wrong: an in-place all_reduce of a non-contiguous view (b[:, 0]) writes the "
                      "sum into the wrong elements of b; the course backend writes the view (docs/student.md says so)",
    "x_reduce_elsewhere": "after dist.reduce gloo leaves its ring's partial sums in the other ranks' tensors (torch's "
                            "docs: only the root receives the result); the course backend leaves them as they were, "
                            "as NCCL does",
}
# values compared more loosely than to 1e-5 (relative): key -> relative tolerance, and why
TOLERANCE = {"x_ddp_three_steps[fp16_hook]": (2e-3, "the fp16 compress hook sums in float16: gloo's ring adds 4 ranks' "
                                                    "halves in another order than rank order, a last-bit difference")}

SUITE_MODULE = '''
"""PyTorch's distributed test module, imported as upstream's gloo run imports it (BACKEND, WORLD_SIZE)."""
import os
import sys
import types
import unittest

os.environ["BACKEND"] = "gloo"
try:
    import expecttest  # noqa: F401
except ImportError:       # torch's test helpers import it for their own TestCase; nothing here uses it
    sys.modules["expecttest"] = types.SimpleNamespace(TestCase=unittest.TestCase, ACCEPT=False)
from torch.testing._internal.distributed import distributed_test  # noqa: E402,F401
import torch.distributed.tensor  # noqa: E402,F401
'''

RANK_PROGRAM = r'''
import copy
import datetime
import json
import os
import sys
import threading
import time
import traceback
import unittest

import torch
import torch.distributed as dist
import torch.nn as nn

import upstream_suite  # noqa: F401  (preloaded)
from torch.testing._internal.common_distributed import TEST_SKIPS
from torch.testing._internal.distributed import distributed_test as upstream

backend, names = sys.argv[1], json.load(open(sys.argv[2]))
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
TEMP = os.environ["TEMP_DIR"]
HANG_S = 30
if backend == "course":
    from launch import course_pg
    course_pg.register()
    link = course_pg.link()
else:
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
SKIP_CODES = {s.exit_code for s in TEST_SKIPS.values()}
where = {"index": 0, "count": 0}


def _mark(value):
    path = os.path.join(TEMP, f"barrier-{where['index']}", str(rank))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(value)
    os.replace(path + ".tmp", path)


def _marks():
    out = []
    for r in range(world):
        try:
            with open(os.path.join(TEMP, f"barrier-{where['index']}", str(r))) as f:
                out.append(f.read())
        except FileNotFoundError:
            out.append("0")
    return out


class Case(upstream.TestDistBackend, upstream.DistributedTest._DistTestBase):
    def _barrier(self, *args, timeout=20, **kwargs):
        """Upstream's file barrier, per method; a peer that left the method (it failed) ends the wait."""
        where["count"] += 1
        _mark(str(where["count"]))
        start = time.monotonic()
        while True:
            marks = _marks()
            counts = [int(m.removeprefix("end:")) for m in marks]
            left = [r for r, m in enumerate(marks) if m.startswith("end:") and counts[r] < where["count"]]
            if left:
                raise RuntimeError(f"file barrier: rank {left[0]} left the method")
            if all(c >= where["count"] for c in counts):
                return
            if time.monotonic() - start > timeout:
                raise RuntimeError("file barrier: timeout")
            time.sleep(0.005)


def _all_ended(timeout=30):
    start = time.monotonic()
    while time.monotonic() - start < timeout and not all(m.startswith("end:") for m in _marks()):
        time.sleep(0.005)


def _unskipped(fn):
    """The method without upstream's skip wrappers (world size, GPU count); its skip marks are ignored."""
    while getattr(fn, "__wrapped__", None) is not None and fn.__code__.co_filename.endswith("common_distributed.py") \
            and "skip" in fn.__code__.co_qualname:
        fn = fn.__wrapped__
    return fn


def _hung(name):
    print("@@result " + json.dumps({"method": name, "rank": rank, "status": "fail", "why": f"hung for {HANG_S} s"}),
          flush=True)
    os._exit(3)


# -- the checks of our own: each returns what it saw, compared between the backends ---------------------------
def _seen(fn):
    try:
        return _plain(fn())
    except Exception as exc:      # noqa: BLE001
        return f"raises: {str(exc).splitlines()[0][:80]}"


def _plain(v):
    if isinstance(v, torch.Tensor):
        return {"dtype": str(v.dtype), "shape": list(v.shape), "values": v.tolist()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def x_futures(case):
    """Each op's Work: its future's value and result(), as gloo gives them (the output tensors)."""
    r, n = dist.get_rank(), dist.get_world_size()
    x = torch.arange(2.0 * n) + 10 * r
    calls = {
        "all_reduce": lambda: dist.all_reduce(x.clone(), async_op=True),
        "all_reduce_coalesced": lambda: dist.all_reduce_coalesced([x.clone(), x[:2].clone()], async_op=True),
        "all_gather_coalesced": lambda: dist.all_gather_coalesced([[torch.empty(2 * n), torch.empty(1)]
                                                                   for _ in range(n)], [x, x[:1]], async_op=True),
        "broadcast": lambda: dist.broadcast(x.clone(), 1, async_op=True),
        "all_gather": lambda: dist.all_gather([torch.empty(2 * n) for _ in range(n)], x, async_op=True),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(2 * n * n), x, async_op=True),
        "reduce_scatter": lambda: dist.reduce_scatter(torch.empty(2), list(x.chunk(n)), async_op=True),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(2), x, async_op=True),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(2 * n), x, async_op=True),
        "all_to_all": lambda: dist.all_to_all([torch.empty(2) for _ in range(n)], list(x.chunk(n)), async_op=True),
        "barrier": lambda: dist.barrier(async_op=True),
        "reduce": lambda: dist.reduce(x.clone(), 0, async_op=True),    # elsewhere than the root: x_reduce_elsewhere
        "gather": lambda: dist.gather(x, [torch.empty(2 * n) for _ in range(n)] if r == 0 else None, 0,
                                      async_op=True),
        "scatter": lambda: dist.scatter(torch.empty(2), list(x.chunk(n)) if r == 0 else None, 0, async_op=True),
        "isend": lambda: dist.isend(x, 1) if r == 0 else None,
        "irecv": lambda: dist.irecv(torch.empty(2 * n), 0) if r == 1 else None,
    }
    seen = {}
    for name, call in calls.items():
        work = call()
        if work is None:
            continue
        work.wait()
        if name == "reduce" and r != 0:
            continue
        if not hasattr(work, "get_future"):             # the *_coalesced calls return a future
            seen[name] = {"future": _seen(work.value)}
        else:
            seen[name] = {"future": _seen(lambda: work.get_future().value()), "result": _seen(work.result)}
    return seen


def x_ddp_three_steps(case):
    """A DDP-wrapped model trained 3 steps: plain, an all-reduce hook through get_future().then(...), the fp16
    compress hook, and no_sync gradient accumulation. The losses and the parameters after."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP
    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    g = torch.Generator().manual_seed(100 + r)              # each rank its own batches
    xs, ys = torch.randn(3, 2, 5, 8, generator=g), torch.randn(3, 2, 5, 4, generator=g)

    def then_hook(state, bucket):
        work = dist.all_reduce(bucket.buffer().div_(n), async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    seen = {}
    for variant in ("plain", "then_hook", "fp16_hook", "no_sync"):
        model = copy.deepcopy(base)
        ddp = DDP(model, bucket_cap_mb=0.0005)               # a few buckets
        if variant == "then_hook":
            ddp.register_comm_hook(None, then_hook)
        elif variant == "fp16_hook":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            opt.zero_grad()
            if variant == "no_sync":
                with ddp.no_sync():
                    first = nn.functional.mse_loss(ddp(xs[step, 0]), ys[step, 0])
                    first.backward()
                loss = nn.functional.mse_loss(ddp(xs[step, 1]), ys[step, 1])
                loss.backward()
                loss = loss + first
            else:
                loss = nn.functional.mse_loss(ddp(xs[step, 0]), ys[step, 0])
                loss.backward()
            opt.step()
            losses.append(loss.item())
        seen[variant] = {"losses": losses, "params": [p.detach().clone() for p in model.parameters()]}
    return _plain(seen)


def x_bitwise(case):
    """BAND, BOR, BXOR on integer and bool tensors (all_reduce and reduce), and the arithmetic ones on bool."""
    r = dist.get_rank()
    seen = {}
    for dtype in (torch.int64, torch.int32, torch.uint8, torch.bool):
        v = torch.tensor([5, 3, 0, 7, 12]) + 3 * r
        v = v % 2 == 1 if dtype == torch.bool else v.to(dtype)
        ops = ["BAND", "BOR", "BXOR"] + (["SUM", "PRODUCT", "MIN", "MAX"] if dtype == torch.bool else [])
        for op in ops:
            y = v.clone()
            dist.all_reduce(y, op=getattr(dist.ReduceOp, op))
            seen[f"{dtype}/{op}"] = y
        y = v.clone()
        dist.reduce(y, 0, op=dist.ReduceOp.BOR)
        if r == 0:                                   # a reduce's result is the root's (x_reduce_elsewhere)
            seen[f"{dtype}/reduce BOR"] = y
    return _plain(seen)


def x_reduce_elsewhere(case):
    """What dist.reduce leaves in the other ranks' tensors (torch's docs: only the root receives the result)."""
    y = torch.arange(4.0) + 10 * dist.get_rank()
    dist.reduce(y, 0)
    return y.tolist()


def x_distribute_tensor(case):
    """distribute_tensor with its default src_data_rank=0: every rank's shard is rank 0's (the others' tensors are
    not read); uneven shards too."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.randn(6, 5, generator=torch.Generator().manual_seed(0)) + 100 * dist.get_rank()
    seen = {}
    for name, placements in {"Shard(0)": [Shard(0)], "Shard(1)": [Shard(1)], "Replicate()": [Replicate()]}.items():
        d = distribute_tensor(full, mesh, placements)
        seen[name] = {"local": d.to_local(), "full": d.full_tensor()}
    return _plain(seen)


def x_strided_view(case):
    """An in-place all_reduce of a non-contiguous view."""
    b = torch.ones(2, 2) * (dist.get_rank() + 1)
    dist.all_reduce(b[:, 0])
    return b.tolist()


def x_large_payloads(case):
    """Every op on payloads past the arena's threshold (launch.wire.SHM_MIN), three all-reduces in flight at once (and
    three of 22 MiB: more than launch.switchboard.MAX_HELD), a ring of isend/irecv; whole-number values, so any summation order gives the same bits. Checksums and a few
    elements come back (the tensors are MiBs)."""
    r, n = dist.get_rank(), dist.get_world_size()
    m = 1 << 18                                                   # 1 MiB of float32
    x = torch.arange(m, dtype=torch.float32) % 97 + r

    def seen(t):
        return {"sum": float(t.double().sum()), "head": t.reshape(-1)[:3].tolist(), "tail": t.reshape(-1)[-2:].tolist()}
    out = {}
    works = [dist.all_reduce(y, async_op=True) for y in (x.clone(), x.clone() * 2, x.clone() * 3)]
    for w in works:
        w.wait()
    out["all_reduce_x3"] = [seen(w.result()[0]) for w in works]
    big = [torch.full((22 << 18,), float(r + k)) for k in range(3)]    # 66 MiB in flight: more than the switchboard
    for w in [dist.all_reduce(y, async_op=True) for y in big]:         # holds of a rank's payloads on the socket
        w.wait()
    out["in_flight_66MiB"] = [seen(y) for y in big]
    g = torch.empty(n * m)
    dist.all_gather_into_tensor(g, x)
    out["all_gather"] = seen(g)
    rs = torch.empty(m // n)
    dist.reduce_scatter_tensor(rs, x)
    out["reduce_scatter"] = seen(rs)
    rows_in = [(m // 64) * (j + 1) // n for j in range(n)]        # uneven rows of 64 floats: an MoE dispatch's shape
    inp = torch.arange(sum(rows_in) * 64, dtype=torch.float32).reshape(-1, 64) % 89 + r
    rows_out = [(m // 64) * (r + 1) // n] * n
    a2a = torch.empty(sum(rows_out), 64)
    dist.all_to_all_single(a2a, inp, rows_out, rows_in)
    out["all_to_all_uneven"] = seen(a2a)
    b = x.clone() if r == n - 1 else torch.zeros(m)
    dist.broadcast(b, n - 1)
    out["broadcast"] = seen(b)
    parts = [torch.empty(m) for _ in range(n)] if r == 0 else None
    dist.gather(x, parts, 0)
    out["gather"] = [seen(p) for p in parts] if parts else None
    sc = torch.empty(m)
    dist.scatter(sc, [x + j for j in range(n)] if r == 0 else None, 0)
    out["scatter"] = seen(sc)
    got = torch.empty(m)
    ops = [dist.P2POp(dist.isend, x * (r + 1), (r + 1) % n), dist.P2POp(dist.irecv, got, (r - 1) % n)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    out["ring"] = seen(got)
    return out


def x_course_arena(case):
    """The shared memory this rank holds: its own arena and no other rank's (mapped or open)."""
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.add(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:                # the listing's own descriptor
            pass
    fds = sorted(f for f in fds if f.startswith("/memfd:"))
    dist.all_reduce(torch.ones(1 << 17))           # a payload in the arena: it is mapped by now
    maps = sorted({line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
                   for line in open("/proc/self/maps") if "memfd:" in line})
    return {"mapped": maps, "open": fds}


def x_course_rejects(case):
    """What gloo rejects, the course backend rejects before posting anything, saying what to use instead."""
    r, n = dist.get_rank(), dist.get_world_size()
    calls = {
        "avg_int": lambda: dist.all_reduce(torch.tensor([3, 4]), op=dist.ReduceOp.AVG),
        "avg_bool": lambda: dist.all_reduce(torch.tensor([True]), op=dist.ReduceOp.AVG),
        "avg_int_reduce_scatter": lambda: dist.reduce_scatter_tensor(torch.empty(1, dtype=torch.int64),
                                                                     torch.arange(n), op=dist.ReduceOp.AVG),
        "bxor_float": lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BXOR),
        "premul_sum": lambda: dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0)),
        "all_to_all_uneven": lambda: dist.all_to_all([torch.empty(i + 1) for i in range(n)],
                                                     [torch.ones(i + 1) for i in range(n)]),
        "all_gather_stacked": lambda: dist.all_gather_into_tensor(torch.empty(n, 2), torch.ones(2)),
        "all_gather_flat": lambda: dist.all_gather_into_tensor(torch.empty(6 * n), torch.ones(2, 3)),
        "all_gather_0d": lambda: dist.all_gather_into_tensor(torch.empty(n), torch.tensor(1.0)),
        "all_gather_list_shape": lambda: dist.all_gather([torch.empty(1, 2) for _ in range(n)], torch.ones(2)),
        "reduce_scatter_stacked": lambda: dist.reduce_scatter_tensor(torch.empty(2), torch.ones(n, 2)),
        "isend_self": lambda: dist.isend(torch.ones(2), r).wait(),
        "irecv_self": lambda: dist.irecv(torch.ones(2), r).wait(),
    }
    seen = {}
    for name, call in calls.items():
        try:
            call()
            seen[name] = "accepted"
        except Exception as exc:    # noqa: BLE001
            seen[name] = f"{type(exc).__name__}: {exc}"
    dist.all_reduce(torch.ones(1))       # nothing was posted: the next collective is still everyone's first
    return seen


def x_course_rooted(case):
    """reduce, gather and scatter to root 1 (the switchboard's record of them is checked by the test)."""
    r, n = dist.get_rank(), dist.get_world_size()
    x = torch.arange(3.0) + 10 * r
    y = x.clone()
    dist.reduce(y, 1)
    g = [torch.empty(3) for _ in range(n)] if r == 1 else None
    dist.gather(x, g, 1)
    out = torch.empty(3)
    dist.scatter(out, [torch.full((3,), float(i)) for i in range(n)] if r == 1 else None, 1)
    return _plain({"reduce": y, "gather": g, "scatter": out})


for index, name in enumerate(names):
    where.update(index=index, count=0)
    forced = name.startswith("!")
    name = name.lstrip("!")
    if backend == "course":
        link.request({"k": "begin", "index": index})
        dist.init_process_group("course", store=dist.HashStore(), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=30))
    else:
        dist.init_process_group("gloo", store=dist.PrefixStore(f"m{index}/", store), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=15))
    case = Case()
    case.rank, case.file_name = rank, os.path.join(TEMP, f"init-{index}")
    watchdog = threading.Timer(HANG_S, _hung, (name,))
    watchdog.daemon = True
    watchdog.start()
    data, t0 = None, time.monotonic()
    try:
        case._barrier()                     # as upstream's harness: every rank's group is up before a method runs
        torch.manual_seed(0)
        if name.startswith("x_"):
            data = globals()[name](case)
        else:
            fn = getattr(type(case), name)
            if forced:
                fn = _unskipped(fn)
            elif getattr(fn, "__unittest_skip__", False):
                raise unittest.SkipTest(getattr(fn, "__unittest_skip_why__", ""))
            fn(case)
        status, why = "pass", ""
    except unittest.SkipTest as exc:
        status, why = "skip", str(exc)[:200]
    except SystemExit as exc:
        status, why = ("skip", f"exit {exc.code}") if exc.code in SKIP_CODES else ("fail", f"exit {exc.code}")
    except BaseException as exc:            # noqa: BLE001  Deadlock too
        status = "fail"
        why = f"{type(exc).__name__}: {str(exc)[:400]} @ " + " < ".join(
            f"{os.path.basename(f.filename)}:{f.lineno}" for f in traceback.extract_tb(exc.__traceback__)[-3:])
    seconds = time.monotonic() - t0
    _mark(f"end:{where['count']}")
    _all_ended()                            # no rank tears its group down while a peer still uses it
    watchdog.cancel()
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    print("@@result " + json.dumps({"method": ("!" if forced else "") + name, "rank": rank, "status": status,
                                    "why": why, "seconds": round(seconds, 3), "data": data}, default=repr), flush=True)
if backend == "course":
    link.request({"k": "begin", "index": len(names)})
else:                                       # rank 0 serves the store: it leaves last
    store.add("finished", 1)
    while rank == 0 and store.add("finished", 0) < world:
        time.sleep(0.01)
'''


def _methods(backend: str, nproc: int) -> list[str]:
    forced = FORCED + (FORCED_4 if nproc >= 4 else [])
    return UPSTREAM + ["!" + m for m in forced] + CHECKS + (COURSE_CHECKS if backend == "course" else [])


def _start(folder, backend: str, nproc: int):
    os.makedirs(folder)
    for d in ("barrier", "test_dir", "init_dir"):
        os.makedirs(os.path.join(folder, d))
    methods = os.path.join(folder, "methods.json")
    with open(methods, "w") as f:
        json.dump(_methods(backend, nproc), f)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.dirname(folder)]), "TEMP_DIR": folder,
           "BACKEND": "gloo", "WORLD_SIZE": str(nproc), "OMP_NUM_THREADS": "1", "COURSE_ITEMS": "[]"}
    env.pop("COURSE_SWITCHBOARD", None)
    if backend == "course":
        env["COURSE_SWITCHBOARD"] = os.path.join(folder, "record")
    out = open(os.path.join(folder, "output.txt"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "launch.forkrun", "--nproc", str(nproc), "--preload",
                             "upstream_suite", os.path.join(os.path.dirname(folder), "rank_program.py"), backend,
                             methods], env=env, cwd=folder, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, out


def _collect(folder) -> dict:
    """method -> {"status": pass|skip|fail (fail if any rank failed), "why", "seconds", "data": {rank: data}}"""
    runs: dict = {}
    with open(os.path.join(folder, "output.txt")) as f:
        for line in f:
            if not re.match(r"\[rank \d+\] @@result ", line):
                continue
            d = json.loads(line.split("@@result ", 1)[1])
            runs.setdefault(d["method"], {})[d["rank"]] = d
    out = {}
    for method, by_rank in runs.items():
        statuses = {d["status"] for d in by_rank.values()}
        status = "fail" if "fail" in statuses else "skip" if statuses == {"skip"} else \
            "pass" if statuses == {"pass"} else "/".join(sorted(statuses))
        out[method] = {"status": status, "seconds": max(d.get("seconds", 0) for d in by_rank.values()),
                       "why": next((d["why"] for d in by_rank.values() if d["status"] == "fail"), ""),
                       "data": {r: d.get("data") for r, d in by_rank.items()}}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The four launches (course and gloo at 2 and 4 ranks), at once; their results by (backend, ranks)."""
    base = tmp_path_factory.mktemp("course_vs_gloo")
    (base / "upstream_suite.py").write_text(textwrap.dedent(SUITE_MODULE))
    (base / "rank_program.py").write_text(RANK_PROGRAM)
    started = time.monotonic()
    procs = {(b, n): _start(str(base / f"{b}{n}"), b, n) for n in (2, 4) for b in ("course", "gloo")}
    for key, (proc, out) in procs.items():
        try:
            proc.wait(timeout=max(1.0, 240 - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        out.close()
    results = {key: _collect(str(base / f"{key[0]}{key[1]}")) for key in procs}
    results["base"], results["seconds"] = base, time.monotonic() - started
    return results


def _close(a, b, rtol: float = 1e-5) -> bool:
    """Equal, floats to `rtol` (gloo may sum 4 ranks in another order)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-6 + rtol * abs(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], rtol) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y, rtol) for x, y in zip(a, b))
    return a == b


def _divergences(course: dict, gloo: dict, nproc: int) -> dict[str, str]:
    """"method" or "method[key]" -> how course and gloo differ."""
    found = {}
    for method in _methods("gloo", nproc):
        c, g = course.get(method), gloo.get(method)
        if c is None or g is None:
            found[method] = f"no result from {'course' if c is None else 'gloo'} (its ranks stopped: see output.txt)"
            continue
        if c["status"] != g["status"]:
            found[method.lstrip("!")] = (f"course {c['status']} ({c['why'][:300]}), "
                                         f"gloo {g['status']} ({g['why'][:300]})")
            continue
        for r in range(nproc):
            cd, gd = c["data"].get(r), g["data"].get(r)
            if isinstance(cd, dict) and isinstance(gd, dict):
                for key in sorted(cd.keys() | gd.keys()):
                    if not _close(cd.get(key), gd.get(key), TOLERANCE.get(f"{method}[{key}]", (1e-5,))[0]):
                        found.setdefault(f"{method}[{key}]", f"rank {r}: course {str(cd.get(key))[:200]}, "
                                                            f"gloo {str(gd.get(key))[:200]}")
            elif not _close(cd, gd):
                found.setdefault(method, f"rank {r}: course {str(cd)[:200]}, gloo {str(gd)[:200]}")
    return found


@pytest.mark.parametrize("nproc", [2, 4])
def test_upstream_distributed_tests_agree_with_gloo(runs, nproc):
    """Every upstream method (and check of ours) gives the same verdict and values on course as on gloo, but for
    the deliberate differences, each of which must still differ (or be dropped from DELIBERATE)."""
    course, gloo = runs[("course", nproc)], runs[("gloo", nproc)]
    rows = [f"{'method':<72} {'course':>6} {'gloo':>6}"]
    for method in _methods("gloo", nproc):
        c, g = course.get(method, {}).get("status", "-"), gloo.get(method, {}).get("status", "-")
        rows.append(f"{method:<72} {c:>6} {g:>6}")
    print(f"\n{nproc} ranks ({runs['seconds']:.0f} s for the four launches):\n" + "\n".join(rows))
    found = _divergences(course, gloo, nproc)
    deliberate = {k.split("@")[0]: v for k, v in DELIBERATE.items() if "@" not in k or k.endswith(f"@{nproc}")}
    unexplained = {k: v for k, v in found.items() if k not in deliberate}
    assert not unexplained, "course and gloo differ:\n" + "\n".join(f"  {k}: {v}" for k, v in unexplained.items()) + \
        f"\n(output: {runs['base']})"
    stale = [k for k in deliberate if k not in found]
    assert not stale, f"listed as deliberate differences but course and gloo agree on them now: {stale}"
    ran = [m for m in UPSTREAM + FORCED if course.get(m, course.get("!" + m, {})).get("status") == "pass"]
    assert len(ran) >= (60 if nproc == 2 else 70), f"only {len(ran)} upstream methods passed"


def test_ddp_trains_alike(runs):
    """A DDP model trained 3 steps on 2 ranks has the same losses on course as on gloo, with each comm hook."""
    course, gloo = (runs[(b, 2)]["x_ddp_three_steps"]["data"] for b in ("course", "gloo"))
    for variant in ("plain", "then_hook", "fp16_hook", "no_sync"):
        losses = [course[r][variant]["losses"] for r in range(2)]
        assert _close(losses, [gloo[r][variant]["losses"] for r in range(2)]), (variant, losses, gloo)
        assert losses[0] != losses[1] and losses[0][0] != losses[0][2]      # the ranks' data differ; it learned


@pytest.mark.parametrize("nproc", [2, 4])
def test_course_rejects_what_gloo_rejects(runs, nproc):
    """Each call gloo rejects (probed on gloo 2.13: an error, a broken group or an aborted process) is refused on
    every rank before anything is posted, with a message that says what to use instead."""
    res = runs[("course", nproc)]["x_course_rejects"]
    assert res["status"] == "pass", res["why"]
    want = {"avg_int": "ReduceOp.SUM and divide", "avg_bool": "ReduceOp.SUM and divide",
            "avg_int_reduce_scatter": "ReduceOp.SUM and divide", "bxor_float": "integer or bool tensors",
            "premul_sum": "scale the tensor, then SUM", "all_to_all_uneven": "all_to_all_single(output, input, ",
            "all_gather_stacked": "concatenated along dim 0", "all_gather_flat": "concatenated along dim 0",
            "all_gather_0d": "concatenated along dim 0", "all_gather_list_shape": "same shape and dtype",
            "reduce_scatter_stacked": ".flatten(0, 1)", "isend_self": "x.clone()", "irecv_self": "x.clone()"}
    for r, seen in res["data"].items():
        for case, hint in want.items():
            assert hint in seen[case] and not seen[case].startswith("accepted"), (r, case, seen[case])


@pytest.mark.parametrize("nproc", [2, 4])
def test_each_rank_holds_its_own_arena_only(runs, nproc):
    """A rank's large payloads go through shared memory that it and its launcher alone hold: no other rank's arena
    is mapped in it or open."""
    res = runs[("course", nproc)]["x_course_arena"]
    assert res["status"] == "pass", res["why"]
    for r, seen in res["data"].items():
        assert seen == {"mapped": [f"/memfd:rank{r}"], "open": [f"/memfd:rank{r} (deleted)"]}, (r, seen)


def test_rooted_collectives_reach_only_their_ranks(runs):
    """reduce, gather and scatter (root 1 of 4): the values, and the switchboard's record of each rank's part."""
    res = runs[("course", 4)]["x_course_rooted"]
    assert res["status"] == "pass", res["why"]
    x = [[float(i + 10 * r) for i in range(3)] for r in range(4)]
    for r, seen in res["data"].items():
        assert seen["reduce"]["values"] == ([[sum(c) for c in zip(*x)]][0] if r == 1 else x[r])
        assert seen["gather"] == ([{"dtype": "torch.float32", "shape": [3], "values": x[j]} for j in range(4)]
                                  if r == 1 else None)
        assert seen["scatter"]["values"] == [float(r)] * 3
    index = _methods("course", 4).index("x_course_rooted")
    record = json.loads((runs["base"] / "course4" / "record" / "comm.json").read_text())["items"][str(index)]
    for r in range(4):
        entries = {e["op"]: e for e in record["entries"][str(r)] if e["op"] in ("reduce", "gather", "scatter")}
        assert {op: (e["bytes"], e["sent"], e["root"], e["shape"]) for op, e in entries.items()} == {
            "reduce": (12, 0.0 if r == 1 else 12.0, 1, [3]), "gather": (48, 0.0 if r == 1 else 12.0, 1, [3]),
            "scatter": (48, 36.0 if r == 1 else 0.0, 1, [3])}, (r, entries)
