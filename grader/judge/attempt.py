"""One launch of a grading job: JOBDIR/attemptK/ in a sandbox, ranks forked by the launcher, results read back.

This module imports no torch (until results are read): a job's first launcher can then be started, held,
before the trusted process imports torch. The launcher (in its sandbox) imports torch and the week's rank
modules while this process imports torch, makes the inputs and computes the references; `start` releases it.
Two ~2 s imports overlap instead of following each other.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tempfile

from grader import ROOT
from grader.rank.exchange import SWITCHBOARD_VERDICT, JobSpec, RankRecord, participants, records_from_saved, world_of
from grader.box.sandbox import Sandbox, give_to
from grader.judge import dtensor_tables
from grader.judge.timeouts import KILL_GRACE, PG_TIMEOUT, STOP_GRACE
from launch.backend import fork_launcher_likely
from tpkit.progress import UnsafeFile, read_progress, read_regular


def preloads(weeks) -> tuple[str, ...]:
    # imported once in the launcher, before the fork: what backward() imports lazily (sympy, ~0.5 s per
    # process), the rank entry, each week's run functions and what they import (e.g. DTensor)
    return ("torch.fx.experimental.symbolic_shapes", "grader.rank.entry",
            *dict.fromkeys(f"grader.rank.{w}" for w in weeks))


class Attempt:
    """attemptK/ of a job: spec.json, and out/, the only folder its ranks may write."""

    def __init__(self, jobdir: str, k: int, *, backend: str, launcher: str, mode: str, interactive: bool = False):
        self.jobdir, self.backend, self.launcher, self.mode = jobdir, backend, launcher, mode
        self.interactive = interactive
        self.here = os.path.join(jobdir, f"attempt{k}")
        self.outdir = os.path.join(self.here, "out")
        os.makedirs(self.outdir)
        self.box = Sandbox(readable=[jobdir], writable=[self.outdir], chdir=self.outdir,
                           setpriv=launcher == "torchrun", mode=mode).__enter__()
        give_to(jobdir, self.box.uid)       # read-only inside the box; the unprivileged uid must still enter it
        give_to(self.here, self.box.uid)
        os.chmod(jobdir, 0o711)             # each rank has a uid of its own: it may pass, not list
        inputs = os.path.join(jobdir, "inputs")
        # the fork and warm launchers carry the ranks' collectives on their switchboard (launch.switchboard),
        # which records them where no rank can reach and hands each rank its own inputs item by item;
        # torchrun's ranks (GPUs) talk gloo/NCCL to each other and read their inputs themselves
        self.switchboard = launcher != "torchrun"
        self.isolated = self.switchboard and self.box.uid is not None
        if os.path.isdir(inputs) and self.box.uid is not None:
            os.chmod(inputs, 0o700 if self.switchboard else 0o755)
        if not self.switchboard:
            self.box.notes.append("torchrun ranks talk to each other directly: their communication is recorded "
                                  "by the ranks themselves, and a rank could read another rank's inputs")
        elif self.box.prefix and self.box.uid is None:
            self.box.notes.append("not run as root: the ranks share your uid and are not isolated from each other "
                                  "(a file or socket could carry data the switchboard does not see)")
        self.launch = None

    def _start(self, nproc: int | None, weeks, timeout: float, pg_timeout: float, job_env: dict | None = None):
        from launch.runner import start
        tables = dtensor_tables.job_env(weeks, self.jobdir)     # read by the launcher before it forks
        return start("grader.rank.entry", nproc, [self.here], backend=self.backend, launcher=self.launcher,
                     timeout=timeout, kill_grace=KILL_GRACE, pg_timeout=pg_timeout,
                     preload=preloads(weeks), wrap=tuple(self.box.prefix),
                     base_env=self.box.base_env(os.environ),
                     env={"PYTHONPATH": _pythonpath(ROOT), "COURSE_STOP_GRACE": str(STOP_GRACE), **self.box.env,
                          **({"COURSE_RANK_INPUTS": os.path.join(self.jobdir, "inputs", "rank{rank}.pt"),
                              "COURSE_SWITCHBOARD": self.record_dir} if self.switchboard else {}),
                          **({"COURSE_ISOLATE": "1"} if self.isolated else {}), **tables, **(job_env or {})},
                     cwd=self.outdir, interactive=self.interactive)

    def hold(self, weeks, pg_timeout: float) -> "Attempt":
        """Start the launcher now (fork launcher only); it imports, then waits for `start`."""
        self.launch = self._start(None, weeks, 0.0, pg_timeout)
        return self

    def start(self, spec: JobSpec, timeout: float):
        """Launch `spec.items` on max(t) ranks (release the held launcher, or start one); `finish` waits."""
        self.world = world_of(spec.items)
        self.items = spec.items
        spec.save(os.path.join(self.here, "spec.json"))
        # the switchboard gives each rank an item's inputs by the job's order of items, not by what a rank asks for,
        # and knows which ranks run each item: a collective beyond them is refused
        items = [{"id": it.id, "group": participants(it.t, self.world)} for it in spec.items]
        job_env = {"COURSE_ITEMS": json.dumps(items)} if self.switchboard else {}
        try:
            if self.launch is None:
                self.launch = self._start(self.world, [it.week for it in spec.items], timeout, spec.pg_timeout,
                                          job_env)
            else:
                self.launch.release(self.world, timeout, job_env)
        except BaseException:
            self.box.__exit__(None, None, None)
            raise

    def finish(self):
        """Wait for the launch. Returns (run, results): the launch's RunResult and what each rank wrote
        ({"ranks": {r: {item id: RankRecord}}, "progress", "untrusted", "world"})."""
        try:
            run = self.launch.wait()
        finally:
            self.box.__exit__(None, None, None)
        if self.switchboard and run is not None:
            run.backend = "switchboard"    # what carried the collectives (the report's footer says it)
        results = {"ranks": {}, "progress": {}, "untrusted": {}, "world": self.world}
        comm = _load_comm_record(self.record_dir) if self.switchboard else {}
        for r in range(self.world):
            if self.switchboard:
                results["ranks"][r], why = _records_from_switchboard(self.record_dir, r, self.items, comm)
            else:
                results["ranks"][r], why = _load_rank_file(os.path.join(self.outdir, f"rank{r}.pt"), r, run)
            if why:
                results["untrusted"][r] = why
            results["progress"][r] = read_progress(os.path.join(self.rank_dir(r), f"rank{r}.progress"))
        return run, results

    @property
    def record_dir(self) -> str:
        """Where the launcher's switchboard writes: no rank can see it (an isolated rank's out/ is its own)."""
        return os.path.join(self.outdir, "switchboard")

    def rank_dir(self, r: int) -> str:
        """What rank r sees as out/: its own folder when isolated (launch.isolation)."""
        return os.path.join(self.outdir, f"rank{r}") if self.isolated else self.outdir

    def cancel(self):
        """Give the attempt up unused: its held launcher stops, its folder goes."""
        if self.launch is not None:
            self.launch.cancel()
        self.box.__exit__(None, None, None)
        shutil.rmtree(self.here, ignore_errors=True)


def hold_first_attempt(names: list[str], backend: str | None = None, sandbox: str | None = None,
                       pg_timeout: float | None = None) -> Attempt | None:
    """A new job folder whose first attempt has its launcher started and held (see the module's docstring),
    where the checks `names` will most likely use the fork launcher (gloo, no GPU); else None.
    Give it to `run_checks(first=...)`, which runs it, or cancels it if the job decides otherwise."""
    if not fork_launcher_likely(backend):
        return None
    weeks = list(dict.fromkeys(n.split("/")[0] for n in names))
    if not all(re.fullmatch(r"week\d\d", w) and os.path.exists(os.path.join(ROOT, "grader", "rank", f"{w}.py"))
               for w in weeks):
        return None            # a name no week has: run_checks will say so
    mode = sandbox or os.environ.get("GRADER_SANDBOX", "auto")
    jobdir = tempfile.mkdtemp(prefix="grader-job-")
    attempt = None
    try:
        attempt = Attempt(jobdir, 0, backend="gloo", launcher="fork", mode=mode)
        return attempt.hold(weeks, PG_TIMEOUT if pg_timeout is None else pg_timeout)
    except BaseException:   # no box, no launcher: nothing of the job may stay behind
        if attempt is not None:
            attempt.cancel()
        shutil.rmtree(jobdir, ignore_errors=True)
        raise


RESULT_LIMIT = 64 << 20      # bytes: a rank's result file (the box's RLIMIT_FSIZE is the same)


def _load_rank_file(path: str, rank: int, run) -> tuple[dict, str | None]:
    """A rank's records ({item id: RankRecord}), or why they cannot be trusted. The file is the box's: it is read
    without blocking (a FIFO), without following links, up to a size cap, and every value's type is checked."""
    try:
        data = read_regular(path, RESULT_LIMIT)
    except UnsafeFile as exc:
        return {}, f"rank {rank}'s result file cannot be read safely ({exc}): results are ignored."
    if data is None:
        return {}, None
    if run is not None:     # torchrun relays what each rank declared it wrote
        want = run.declared.get(rank, "")
        if not want and run.timed_out:
            return {}, None         # stopped before it could be relayed: unverified, not forged (a hang)
        if want.split(" ")[-1] != hashlib.sha256(data).hexdigest():
            return {}, (f"rank {rank}'s result file was written or changed by another process, not by rank {rank} "
                        "itself: forged results are ignored.")
    import torch   # only here: this module is imported before the trusted process has torch
    try:
        saved = torch.load(io.BytesIO(data), weights_only=True)
    except Exception:
        return {}, (f"rank {rank}'s result file is not a plain tensor file (the safe loader refused it): "
                    "results are ignored.")
    try:
        return records_from_saved(saved), None
    except ValueError as exc:
        return {}, f"rank {rank}'s results are malformed ({exc}): results are ignored."


COMM_LIMIT = 64 << 20       # bytes: the switchboard's record of one launch


def _load_comm_record(record_dir: str) -> dict:
    """{item index: {"entries": {rank: [...]}, "events": [...]}} as the launcher's switchboard wrote it."""
    try:
        data = read_regular(os.path.join(record_dir, "comm.json"), COMM_LIMIT)
        return {int(k): v for k, v in json.loads(data)["items"].items()} if data else {}
    except (UnsafeFile, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _records_from_switchboard(record_dir: str, rank: int, items, comm: dict) -> tuple[dict, str | None]:
    """Rank r's records ({item id: RankRecord}): what it handed the switchboard at each item's end, with the
    switchboard's own record of its collectives as the ledger, and the switchboard's verdict on it (it waited in
    a deadlock, the ranks disagreed on a collective) as its error, whatever the rank said."""
    import torch
    out = {}
    for index, item in enumerate(items):
        path = os.path.join(record_dir, f"rank{rank}", f"{index}.pt")
        try:
            data = read_regular(path, RESULT_LIMIT)
        except UnsafeFile as exc:
            return out, f"rank {rank}'s results cannot be read safely ({exc}): results are ignored."
        if data is None:
            continue
        try:
            saved = torch.load(io.BytesIO(data), weights_only=True)
        except Exception:   # noqa: BLE001
            return out, (f"rank {rank}'s result for {item.id} is not a plain tensor file (the safe loader refused "
                         "it): results are ignored.")
        try:
            rec = RankRecord.from_saved(saved)
        except ValueError as exc:
            return out, f"rank {rank}'s result for {item.id} is malformed ({exc}): results are ignored."
        seen = comm.get(index, {})
        rec.ledger = list(seen.get("entries", {}).get(str(rank), []))
        for event in seen.get("events", []):
            if rank in event.get("ranks", []):
                rec.error = f"{SWITCHBOARD_VERDICT}{event.get('msg', '')}"
        out[item.id] = rec
    return out, None


def _pythonpath(root: str) -> str:
    old = os.environ.get("PYTHONPATH", "")
    return root + (os.pathsep + old if old else "")

