"""Rank entry of a grading job: `python -m grader.rank.entry JOBDIR/attemptK` on every rank.

Each item of the job is a case at one tensor-parallel size t; the student gets a process
group of t ranks: the job's last t (exchange.participants).

Under the fork and warm launchers the groups are the "course" backend (launch/course_pg.py): every
collective goes to the launcher's switchboard, which also hands each rank an item's inputs when all
ranks have reached it (`begin`), takes its result at the item's end (`save`), and keeps each item's
collectives apart. Under torchrun (gloo, NCCL) ranks meet on the harness's control group between items,
read their inputs from a file and write their results to one; after an item in which any rank failed,
that size's groups are made anew, so a rank left waiting in item k cannot be matched in item k+1.
"""
from __future__ import annotations

import datetime
import importlib
import importlib.util
import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist

from grader.rank.context import GradingError, RankContext
from grader.rank.exchange import DEADLOCKED, Item, JobSpec, RankRecord, failed_with, participants
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


def _save(path: str, results: dict):
    """torchrun: write this rank's results, and declare their digest on its stdout, which torchrun prefixes with
    the rank (a file another rank changed no longer matches)."""
    import hashlib
    import io
    buf = io.BytesIO()
    torch.save(results, buf)
    data = buf.getvalue()
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    print(f"@@result {os.path.basename(path)} {hashlib.sha256(data).hexdigest()}", flush=True)


class RankJob:
    """One rank's run of a job, in named steps: `start` (process group, own inputs, groups, imports), then per
    item `meet` (every rank, between items) and `run_item`, then `finish`."""

    def __init__(self, attempt: str):
        self.spec = JobSpec.load(os.path.join(attempt, "spec.json"))
        self.out_dir = os.path.join(attempt, "out")
        self.results: dict[str, dict] = {}        # item id -> RankRecord.to_saved(), rewritten after each item
        self.failed_cases: set[str] = set()       # checks in which some rank raised, hung or was judged deadlocked

    def start(self):
        from launch import course_pg
        from launch.dist import init_process_group
        self.link = None
        if course_pg.available():   # fork or warm launcher: every collective goes through its switchboard
            course_pg.register()
            self.link = course_pg.link()
            self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(course_pg.BACKEND, store=dist.HashStore(), rank=self.rank, world_size=self.world)
            self.device = torch.device("cpu")
            self.inputs = {}        # each item's inputs come from the switchboard when the item begins
        else:                       # torchrun (GPU nodes): gloo or NCCL between the ranks, inputs from a file
            self.rank, self.world, self.device = init_process_group(timeout_s=self.spec.pg_timeout)
            with open(self.spec.inputs.format(rank=self.rank), "rb") as f:
                self.inputs = torch.load(f, weights_only=True)   # this rank's own inputs, nothing of its peers'
            # the harness's own group: between items, outside any student code (bounded by the wall clock only)
            self.control = dist.new_group(list(range(self.world)), timeout=datetime.timedelta(hours=1))
        torch.set_num_threads(1)
        self.student_dir = os.path.realpath(self.spec.student)
        self.out_path = os.path.join(self.out_dir, f"rank{self.rank}.pt")
        self.progress = os.path.join(self.out_dir, f"rank{self.rank}.progress")
        self.groups = {t: self.make_groups(t) for t in dict.fromkeys(it.t for it in self.spec.items)}
        # installed before any student code is imported; the switchboard judges deadlocks itself
        self.watch = Watch(self.out_dir, self.rank) if self.link is None else None
        confine_imports(self.student_dir, self.out_dir)
        # the harness's run functions first (before any student code, and outside every item's clock: week 7's
        # DTensor imports take seconds), then the student's modules, once (a slow import on a loaded machine is
        # not a hang); an import error of the student's becomes every dependent item's error
        self.runners = {it.id: getattr(importlib.import_module(f"grader.rank.{it.week}"), it.run_rank)
                        for it in self.spec.items}
        self.seal = Seal()        # after the harness's imports, before the student's
        self.modules = {}
        for name in dict.fromkeys(it.module for it in self.spec.items):
            ProgressFile.at(self.progress).write({"item": None, "phase": "import", "where": f"importing {name}"})
            try:
                self.modules[name] = import_by_path(name, self.student_dir)
            except BaseException as exc:   # noqa: BLE001  (SystemExit at import is the student's too)
                self.modules[name] = exc

    def begin(self, index: int, item: Item | None) -> bool:
        """On the switchboard: wait until every rank is here, take this item's inputs; True if any rank failed
        the last one."""
        header, tensors = self.link.request({"k": "begin", "index": index})
        if item is not None:
            self.inputs[item.id] = dict(zip(header.get("names", []), tensors))
        return bool(header.get("failed_last"))

    def make_groups(self, t: int):
        """This rank's (group, job ranks) at size t, made by all ranks; None: it sits t out (participants).
        Made anew after an item in which any rank failed: a collective that timed out leaves its gloo group
        unusable, and a late peer must not be matched by the next item's collectives."""
        timeout = datetime.timedelta(seconds=self.spec.pg_timeout)
        ranks = participants(t, self.world)
        g = dist.new_group(ranks, timeout=timeout)
        return (g, ranks) if self.rank in ranks else None

    def meet(self, failed_last: bool, last: Item):
        """Every rank meets here between items: a rank that failed fast waits for peers still timing out in the
        failed item, and all learn whether the last item's groups must be replaced."""
        flag = torch.tensor([1.0 if failed_last else 0.0])
        try:
            dist.all_reduce(flag, group=self.control)
        except Exception:  # a peer process died: go on, its items will say so
            pass
        if flag.item() > 0:
            self.failed_cases.add(last.case)
            try:
                self.groups[last.t] = self.make_groups(last.t)
            except Exception:  # a peer is gone for good: its items will say so
                self.groups[last.t] = None

    def save(self, item: Item, record: RankRecord):
        if self.link is not None:   # handed over at once: the switchboard keeps it where no rank can reach
            import io
            buf = io.BytesIO()      # without the ledger: the switchboard's record of the collectives is graded
            torch.save({**record.to_saved(), "ledger": []}, buf)
            self.link.tell({"k": "end", "index": self.index, "failed": bool(record.error)},
                           [torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)])
            return
        self.results[item.id] = record.to_saved()
        _save(self.out_path, self.results)

    def run_item(self, item: Item) -> bool:
        """Run one item on this rank and save its record; True if this rank failed it."""
        plan = self.groups[item.t]
        if plan is None:      # this rank sits the item out (t=2 on a 4-rank job: ranks 0 and 1)
            return False
        group, ranks = plan
        skip = failed_with(item.case, self.failed_cases, self.spec.graded_together)
        if skip:
            self.save(item, RankRecord(skipped=skip))
            return False
        ledger = CommLedger(group_size=item.t, progress_file=self.progress, label=item.id)
        ctx = RankContext(rank=ranks.index(self.rank), world_size=item.t, group=group, device=self.device,
                          ledger=ledger)
        record = RankRecord()
        ProgressFile.at(self.progress).write({"item": item.id, "phase": "import", "where": "importing your module"})
        t0 = time.perf_counter()
        self._arm(item, record, ledger, ctx, t0)
        try:
            if isinstance(self.modules.get(item.module), BaseException):
                raise self.modules[item.module]
            inputs = {k: v.to(self.device) for k, v in self.inputs[item.id].items()}
            if self.watch is not None:
                self.watch.begin(item.id, ranks, ledger)
            else:
                self.link.phase = lambda: ledger.phase
            with ledger:
                out = self.runners[item.id](self.modules[item.module], item.config, inputs, ctx)
            ctx.check_handed()
            try:
                self.seal.check()
            except Tampered as exc:     # the harness's rank-side code is not what grades: feedback
                ctx.note(str(exc))
            record.tensors = {k: (v.detach().to("cpu").clone() if isinstance(v, torch.Tensor) else None)
                              for k, v in out.items()}
        except Deadlock as exc:       # the harness's own verdicts: no student frames to show
            record.error = f"grader.rank.watch.Deadlock: {exc}"
        except BaseException as exc:  # SystemExit from student code too: it must not skip the report
            record.error = user_traceback(exc, self.student_dir)
        finally:
            signal.alarm(0)
            if self.watch is not None:
                self.watch.end()
        record.seconds, record.params, record.ledger = time.perf_counter() - t0, ctx.params, ledger.entries
        record.notes = list(ctx.notes)
        self.save(item, record)
        return bool(record.error)

    def _arm(self, item: Item, record: RankRecord, ledger, ctx, t0: float):
        """The item's clocks: SIGALRM for a Python-level hang, and the watch's way out of a deadlocked wait."""
        def too_slow(signum, frame):
            waiting = self.watch.waiting_on if self.watch is not None else (
                "a collective" if self.link.waiting else None)
            if waiting:   # a victim, not the culprit: the peer it waits for is elsewhere
                raise GradingError(f"still waiting in {waiting} after {item.timeout} s: a peer never "
                                   "joined it (the other ranks' messages say where they were).")
            raise GradingError(f"still running your code in {ledger.phase} after {item.timeout} s (not inside a "
                               "collective): an endless loop, a sleep, or far too much work?")

        def give_up(message):
            # called by the watch's thread while this rank is blocked in a wait gloo cannot abort: record the
            # verdict as this item's result and leave; the launcher stops the job and the grader runs the
            # remaining checks in fresh ranks (seconds, instead of the process-group timeout per check)
            record.error, record.seconds = f"grader.rank.watch.Deadlock: {message}", time.perf_counter() - t0
            record.params, record.ledger = ctx.params, list(ledger.entries)
            self.save(item, record)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(DEADLOCKED)
        if self.watch is not None:
            self.watch.give_up = give_up
        signal.signal(signal.SIGALRM, too_slow)
        signal.alarm(item.timeout)

    def finish(self):
        if self.link is not None:     # the last boundary: every rank leaves together
            self.begin(len(self.spec.items), None)
            ProgressFile.at(self.progress).write({"item": None, "phase": "done", "where": "finished"})
            return
        try:   # the ranks leave together (the launcher takes a rank that leaves alone for a dead one)
            dist.all_reduce(torch.zeros(1), group=self.control)
        except Exception:
            pass
        ProgressFile.at(self.progress).write({"item": None, "phase": "done", "where": "finished"})


def main(attempt: str) -> int:
    job = RankJob(attempt)
    job.start()
    failed_last, last = False, None
    for index, item in enumerate(job.spec.items):
        job.index = index
        if job.link is not None:
            if job.begin(index, item) and last is not None:
                job.failed_cases.add(last.case)
        elif last is not None:
            job.meet(failed_last, last)
        failed_last, last = job.run_item(item), item
    job.finish()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1])
    # leave without interpreter teardown: launch.dist's exit hook would destroy the process group, which waits
    # for the collectives a deadlocked item abandoned; the ranks' results are already written and declared
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
