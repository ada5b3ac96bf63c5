"""One launch of a grading job: JOBDIR/attemptK/ in a sandbox, ranks forked by the launcher, results read back.

This module imports no torch (until results are read): a job's first launcher can then be started, held,
before the trusted process imports torch. The launcher (in its sandbox) imports torch and the week's rank
modules while this process imports torch, makes the inputs and computes the references; `start` releases it.
Two ~2 s imports overlap instead of following each other.
"""
from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import tempfile

from grader import ROOT
from grader.rank.exchange import JobSpec, records_from_saved, world_of
from grader.box.sandbox import Sandbox, give_to
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
        inputs = os.path.join(jobdir, "inputs")
        # each rank's inputs: the fork launcher opens rank r's file for rank r before it drops to the box's uid,
        # so the folder stays the grader's; torchrun's ranks start as that uid and must read it themselves
        self.own_inputs = self.box.uid is not None and launcher != "torchrun"
        if os.path.isdir(inputs) and self.box.uid is not None:
            os.chmod(inputs, 0o700 if self.own_inputs else 0o755)
        if self.box.uid is not None and not self.own_inputs:
            self.box.notes.append("torchrun ranks start unprivileged: a rank could read another rank's inputs")
        elif self.box.prefix and self.box.uid is None:
            self.box.notes.append("not run as root: the ranks share your uid, so a rank could read another "
                                  "rank's inputs")
        self.launch = None

    def _start(self, nproc: int | None, weeks, timeout: float, pg_timeout: float):
        from launch.runner import start
        return start("grader.rank.entry", nproc, [self.here], backend=self.backend, launcher=self.launcher,
                     timeout=timeout, kill_grace=KILL_GRACE, pg_timeout=pg_timeout,
                     preload=preloads(weeks), wrap=tuple(self.box.prefix),
                     base_env=self.box.base_env(os.environ),
                     env={"PYTHONPATH": _pythonpath(ROOT), "COURSE_STOP_GRACE": str(STOP_GRACE), **self.box.env,
                          **({"COURSE_RANK_INPUTS": os.path.join(self.jobdir, "inputs", "rank{rank}.pt")}
                             if self.own_inputs else {})},
                     cwd=self.outdir, interactive=self.interactive)

    def hold(self, weeks, pg_timeout: float) -> "Attempt":
        """Start the launcher now (fork launcher only); it imports, then waits for `start`."""
        self.launch = self._start(None, weeks, 0.0, pg_timeout)
        return self

    def start(self, spec: JobSpec, timeout: float):
        """Launch `spec.items` on max(t) ranks (release the held launcher, or start one); `finish` waits."""
        self.world = world_of(spec.items)
        spec.save(os.path.join(self.here, "spec.json"))
        try:
            if self.launch is None:
                self.launch = self._start(self.world, [it.week for it in spec.items], timeout, spec.pg_timeout)
            else:
                self.launch.release(self.world, timeout)
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
        results = {"ranks": {}, "progress": {}, "untrusted": {}, "world": self.world}
        for r in range(self.world):
            results["ranks"][r], why = _load_rank_file(os.path.join(self.outdir, f"rank{r}.pt"), r, run)
            if why:
                results["untrusted"][r] = why
            results["progress"][r] = read_progress(os.path.join(self.outdir, f"rank{r}.progress"))
        return run, results

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
    attempt = Attempt(jobdir, 0, backend="gloo", launcher="fork", mode=mode)
    return attempt.hold(weeks, PG_TIMEOUT if pg_timeout is None else pg_timeout)


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
    if run is not None:     # every launcher relays what each rank declared it wrote
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


def _pythonpath(root: str) -> str:
    old = os.environ.get("PYTHONPATH", "")
    return root + (os.pathsep + old if old else "")

