"""Rank entry of a grading job: `python -m grader.rank.entry JOBDIR/attemptK` on every rank.

Each item of the job is a case at one tensor-parallel size t; the student gets a process
group of t ranks (sub-groups when t is smaller than the job). Between items all ranks meet on
the harness's control group; after an item in which any rank failed, that size's groups are
made anew, so a rank left waiting in item k cannot be matched by a collective of item k+1.
"""
from __future__ import annotations

import datetime
import importlib
import importlib.util
import json
import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist

from grader.rank.context import GradingError, RankContext
from grader.rank.seal import Seal, Tampered
from grader.rank.watch import Deadlock, Watch
from tpkit.ledger import CommLedger
from tpkit.progress import ProgressFile


def user_traceback(exc: BaseException, student_dir: str) -> str:
    """The traceback from the student's first frame to their last, then the exception itself."""
    te = traceback.TracebackException.from_exception(exc)
    frames = list(te.stack)
    codes = [f.f_code for f, _ in traceback.walk_tb(exc.__traceback__)]
    if len(codes) == len(frames):   # "ColumnParallelLinear.from_dense", not just "from_dense"
        for fs, code in zip(frames, codes):
            fs.name = getattr(code, "co_qualname", fs.name)
    mine = [i for i, f in enumerate(frames) if f.filename.startswith(student_dir)]
    if mine:   # from the student's first frame to their last: torch's and the harness's frames are noise
        te.stack = traceback.StackSummary.from_list(frames[mine[0]:mine[-1] + 1])
    return "".join(te.format())


def confine_imports(student_dir: str, writable: str):
    """The student's folder goes LAST on sys.path, and the folders a rank can write (its cwd, `out/`) go
    entirely: a submission's `statistics.py` or `torch.py` can never shadow the standard library, torch or
    tpkit, for the harness or for itself; its own helper modules still import."""
    drop = {"", os.getcwd(), os.path.realpath(writable), os.path.realpath(student_dir)}
    sys.path[:] = [p for p in sys.path if (os.path.realpath(p) if p else "") not in drop] + [student_dir]


def import_by_path(name: str, student_dir: str):
    """The graded module from the student's folder and nowhere else."""
    path = os.path.join(student_dir, f"{name}.py")
    if not os.path.isfile(path):
        raise ModuleNotFoundError(f"No module named {name!r}: no %%writefile {name}.py cell in the notebook")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


DEADLOCKED = 3           # exit status of a rank that left a deadlocked check (its verdict is in its results)
_RESULT_FD: str | None = None   # read before any student code runs, so it cannot be swapped


def _save(path: str, results: dict):
    import hashlib
    import io
    buf = io.BytesIO()
    torch.save(results, buf)
    data = buf.getvalue()
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    line = f"{os.path.basename(path)} {hashlib.sha256(data).hexdigest()}"
    if _RESULT_FD:  # tell the launcher, over this rank's own pipe, what this rank wrote
        os.write(int(_RESULT_FD), (line + "\n").encode())
    else:           # torchrun: on this rank's stdout, which torchrun prefixes with the rank
        print(f"@@result {line}", flush=True)


def main(attempt: str) -> int:
    global _RESULT_FD
    _RESULT_FD = os.environ.pop("COURSE_RESULT_FD", None)
    spec = json.load(open(os.path.join(attempt, "spec.json")))
    from launch.dist import init_process_group
    rank, world, device = init_process_group(timeout_s=spec["pg_timeout"])
    torch.set_num_threads(1)
    student_dir = os.path.realpath(spec["student"])
    own = os.environ.pop("COURSE_INPUT_FD", None)    # opened for this rank alone by the fork launcher
    with (os.fdopen(int(own), "rb") if own else open(spec["inputs"].format(rank=rank), "rb")) as f:
        inputs_all = torch.load(f, weights_only=True)   # this rank's own inputs, nothing of its peers'

    timeout = datetime.timedelta(seconds=spec["pg_timeout"])

    # the harness's own group: between items, outside any student code (bounded by the wall clock only)
    control = dist.new_group(list(range(world)), timeout=datetime.timedelta(hours=1))
    # One set of groups per tensor-parallel size t, reused by every item of that size, and made
    # anew (by all ranks, in the same order) after an item in which any rank failed: a collective
    # that timed out leaves its gloo group unusable, and a late peer must not be matched by the
    # next item's collectives.
    def make_groups(t: int):
        mine = None
        for start in range(0, world - world % t, t):
            ranks = list(range(start, start + t))
            g = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine = (g, ranks)
        return mine

    groups: dict[int, tuple | None] = {}
    for item in spec["items"]:
        if item["t"] not in groups:
            groups[item["t"]] = make_groups(item["t"])

    out_path = os.path.join(attempt, "out", f"rank{rank}.pt")
    progress = os.path.join(attempt, "out", f"rank{rank}.progress")
    results: dict = {}
    watch = Watch(os.path.dirname(out_path), rank)   # installed before any student code is imported
    confine_imports(student_dir, os.path.dirname(out_path))
    modules: dict = {}
    # the harness's run functions first (before any student code, and outside every item's clock: week 7's
    # DTensor imports take seconds), then the student's modules, once (a slow import on a loaded machine
    # is not a hang); an import error of the student's becomes every dependent item's error
    runners = {}
    for item in spec["items"]:
        week = importlib.import_module(f"grader.rank.{item['case'].split('/')[0]}")
        runners[item["id"]] = getattr(week, item["run_rank"])
    seal = Seal()        # after the harness's imports, before the student's
    for name in dict.fromkeys(it["module"] for it in spec["items"]):
        ProgressFile.at(progress).write({"item": None, "phase": "import", "where": f"importing {name}"})
        try:
            modules[name] = import_by_path(name, student_dir)
        except BaseException as exc:   # noqa: BLE001  (SystemExit at import is the student's too)
            modules[name] = exc
    failed_last = False
    failed_cases: set[str] = set()      # checks in which some rank raised, hung or was judged deadlocked
    together = {c: g for g in spec.get("graded_together", []) for c in g}
    for n, item in enumerate(spec["items"]):
        if n:
            # every rank meets here, so a rank that failed fast waits for peers still timing out
            # in the failed item, and all learn whether the last item's groups must be replaced
            flag = torch.tensor([1.0 if failed_last else 0.0])
            try:
                dist.all_reduce(flag, group=control)
            except Exception:  # a peer process died: go on, its items will say so
                pass
            if flag.item() > 0:
                failed_cases.add(spec["items"][n - 1]["case"])
                last_t = spec["items"][n - 1]["t"]
                try:
                    groups[last_t] = make_groups(last_t)
                except Exception:  # a peer is gone for good: its items will say so
                    groups[last_t] = None
        failed_last = False
        plan = groups[item["t"]]
        if plan is None:      # this rank sits the item out (e.g. t=3 on a 4-rank job)
            continue
        # a rank failed in a check graded with this one: its points are lost, and a hang would cost a timeout again
        failed_with = next((c for c in together.get(item["case"], [item["case"]]) if c in failed_cases), None)
        if failed_with:
            results[item["id"]] = {"group": plan[1], "skipped": failed_with}
            _save(out_path, results)
            continue
        group, ranks = plan
        ledger = CommLedger(group_size=item["t"], progress_file=progress, label=item["id"])
        ctx = RankContext(rank=ranks.index(rank), world_size=item["t"],
                          group=group, device=device, ledger=ledger)
        res = {"group": ranks, "tensors": {}, "params": {}, "ledger": [], "error": "", "seconds": 0.0}
        ProgressFile.at(progress).write({"item": item["id"], "phase": "import", "where": "importing your module"})
        t0 = time.perf_counter()
        item_timeout = int(item.get("timeout", spec.get("item_timeout", 15)))

        def too_slow(signum, frame, item_timeout=item_timeout, ledger=ledger):
            if watch.waiting_on:   # a victim, not the culprit: the peer it waits for is elsewhere
                raise GradingError(f"still waiting in {watch.waiting_on} after {item_timeout} s: a peer never "
                                   "joined it (the other ranks' messages say where they were).")
            raise GradingError(f"still running your code in {ledger.phase} after {item_timeout} s (not inside a "
                               "collective): an endless loop, a sleep, or far too much work?")
        def give_up(message, item=item, res=res, ledger=ledger, ctx=ctx, t0=t0):
            # called by the watch's thread while this rank is blocked in a wait gloo cannot abort: record the
            # verdict as this item's result and leave; the launcher stops the job and the grader runs the
            # remaining checks in fresh ranks (seconds, instead of the process-group timeout per check)
            res.update(error=f"grader.rank.watch.Deadlock: {message}", seconds=time.perf_counter() - t0,
                       params=ctx.params, ledger=list(ledger.entries))
            results[item["id"]] = res
            _save(out_path, results)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(DEADLOCKED)
        watch.give_up = give_up
        ledger.waiter = watch.wait_functional
        signal.signal(signal.SIGALRM, too_slow)
        signal.alarm(item_timeout)    # a Python-level hang; collectives have the process-group timeout
        try:
            if isinstance(modules.get(item["module"]), BaseException):
                raise modules[item["module"]]
            inputs = {k: v.to(device) for k, v in inputs_all[item["id"]].items()}
            ledger.progress_file = progress
            watch.begin(item["id"], ranks, ledger)
            with ledger:
                out = runners[item["id"]](modules[item["module"]], item["config"], inputs, ctx)
            ctx.check_handed()
            seal.check()
            res["tensors"] = {k: (v.detach().to("cpu").clone() if isinstance(v, torch.Tensor) else None)
                              for k, v in out.items()}
        except Deadlock as exc:       # the harness's own verdicts: no student frames to show
            res["error"] = f"grader.rank.watch.Deadlock: {exc}"
            failed_last = True
        except Tampered as exc:
            res["error"] = f"grader.rank.seal.Tampered: {exc}"
            failed_last = True
        except BaseException as exc:  # SystemExit from student code too: it must not skip the report
            res["error"] = user_traceback(exc, student_dir)
            failed_last = True
        finally:
            signal.alarm(0)
            watch.end()
        res["seconds"] = time.perf_counter() - t0
        res["params"] = ctx.params
        res["ledger"] = ledger.entries
        results[item["id"]] = res
        _save(out_path, results)
    try:   # the ranks leave together (the launcher takes a rank that leaves alone for a dead one)
        dist.all_reduce(torch.zeros(1), group=control)
    except Exception:
        pass
    ProgressFile.at(progress).write({"item": None, "phase": "done", "where": "finished"})
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1])
    # leave without interpreter teardown: launch.dist's exit hook would destroy the process group, which waits
    # for the collectives a deadlocked item abandoned; the ranks' results are already written and declared
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
