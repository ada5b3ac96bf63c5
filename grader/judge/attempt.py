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
import platform
import re
import shutil
import tempfile

from grader import ROOT
from grader.rank.exchange import SWITCHBOARD_VERDICT, JobSpec, RankRecord, participants, records_from_saved, world_of
from grader.box.sandbox import Sandbox, give_to
from grader.judge import dtensor_tables, inductor_seed
from grader.judge.timeouts import KILL_GRACE, PG_TIMEOUT, STOP_GRACE
from launch.backend import fork_launcher_likely
from launch.isolation import capped_tmpfs, flock_keeper_available, share, unmount
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
        self.mounts: list[str] = []        # the size-capped tmpfs over out/ or the ranks' folders, outermost first
        self.launch = None
        try:
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
            if not self.switchboard:     # how GPUs are graded, not a part missing from the box
                self.box.notes.append("torchrun ranks talk to each other directly: their communication is recorded "
                                      "by the ranks themselves, and a rank could read another rank's inputs")
            elif self.box.prefix and self.box.uid is None:
                self.box.degrade("the grader does not run as root, so the ranks share your uid and are not isolated "
                                 "from each other (a file or socket could carry data the switchboard does not see): "
                                 "run it as root")
            if self.isolated and platform.machine() != "x86_64":
                self.box.degrade(f"the ranks' seccomp filter is written for x86-64, not {platform.machine()}, so ranks "
                                 "could still meet through file locks, inotify watches or the kernel keyring: grade "
                                 "on an x86-64 machine")
            elif self.isolated and not flock_keeper_available():     # closed, not open: a note, never a refusal
                self.box.notes.append("this kernel has no pidfd_getfd (Linux 5.6), so the ranks' flock is refused on "
                                      "every file, their own too (torch.compile's caches and filelock then fail): "
                                      "grade on Linux 5.6 or later")
            self._cap_out()
        except BaseException:
            self._release()
            raise

    def _cap_out(self):
        """A total size cap on what the ranks write (Limits.out_bytes a rank, job_out_bytes a job): past it a write
        fails with ENOSPC inside the rank, and the grader's disk never holds it. The ranks of a launch that are not
        isolated share one tmpfs over out/. An isolated rank's folder becomes a tmpfs of its own once the job's size
        is known (`_cap_ranks`), possibly after the box started (a held launcher): out/ is made a shared mount point,
        so that those mounts reach the box too."""
        if not self.box.prefix:
            return
        if self.box.uid is None:
            self.box.degrade("the grader does not run as root, so the ranks' out/ folder has no total size cap (a "
                             "size-capped tmpfs needs root to mount): run it as root")
            return
        try:
            if self.isolated:
                share(self.outdir)
            else:
                capped_tmpfs(self.outdir, self.box.limits.job_out_bytes, self.box.limits.out_files, 0o755)
        except OSError as exc:
            self.box.degrade(f"the ranks' out/ folder has no total size cap (mounting a tmpfs there failed: {exc})")
            return
        self.mounts.append(self.outdir)
        give_to(self.outdir, self.box.uid)      # what is mounted there is root's

    def _cap_ranks(self):
        """Each isolated rank's folder: a tmpfs of min(out_bytes, job_out_bytes / ranks), so the job's cap holds too."""
        if not (self.isolated and self.mounts):
            return
        lim = self.box.limits
        for r in range(self.world):
            os.mkdir(self.rank_dir(r), 0o700)
            capped_tmpfs(self.rank_dir(r), min(lim.out_bytes, lim.job_out_bytes // self.world), lim.out_files, 0o700)
            self.mounts.append(self.rank_dir(r))

    def _out_full(self, r: int) -> str:
        """What the verdict says of rank r's out/ when it is full (its writes failed with ENOSPC); else ""."""
        path = self.rank_dir(r)
        if path not in self.mounts:
            return ""
        st = os.statvfs(path)
        if st.f_bavail * st.f_frsize >= 64 << 10 and st.f_favail > 0:
            return ""
        lim = self.box.limits
        if st.f_favail == 0:
            what = f"holds {lim.out_files} files and folders, the most it may hold"
        elif self.isolated:
            what = (f"is full: {(st.f_blocks * st.f_frsize) >> 20} MiB, what a rank of this job may write there "
                    f"({lim.out_bytes >> 20} MiB a rank, {lim.job_out_bytes >> 20} MiB the job's ranks together)")
        else:
            what = f"is full: {lim.job_out_bytes >> 20} MiB, what the job's ranks together may write there"
        whose = "its" if self.isolated else "the ranks' shared"
        return (f"{whose} out/ folder {what}, so writing there failed with 'No space left on device'. A check needs "
                "no files: write fewer and smaller ones.")

    def _release(self):
        """The box's processes and cgroups, then the tmpfs over out/ (what the ranks wrote there goes with it)."""
        self.box.__exit__(None, None, None)
        self._uncap()

    def _uncap(self):
        while self.mounts:
            unmount(self.mounts.pop())

    def _start(self, nproc: int | None, weeks, timeout: float, pg_timeout: float, job_env: dict | None = None):
        from launch.runner import start
        tables = dtensor_tables.job_env(weeks, self.jobdir)     # read by the launcher before it forks
        return start("grader.rank.entry", nproc, [self.here], backend=self.backend, launcher=self.launcher,
                     timeout=timeout, kill_grace=KILL_GRACE, pg_timeout=pg_timeout,
                     preload=preloads(weeks), wrap=tuple(self.box.prefix),
                     # every variable the box gets passes the box's allowlist, the job's own too
                     base_env=self.box.base_env(os.environ, {
                         "PYTHONPATH": _pythonpath(ROOT), "COURSE_STOP_GRACE": str(STOP_GRACE),
                         **({"COURSE_RANK_INPUTS": os.path.join(self.jobdir, "inputs", "rank{rank}.pt"),
                             "COURSE_SWITCHBOARD": self.record_dir} if self.switchboard else {}),
                         **({"COURSE_ISOLATE": "1"} if self.isolated else {}), **tables, **(job_env or {})}),
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
        if self.isolated:           # each rank's own torch.compile cache starts warm (its own copy)
            job_env.update(inductor_seed.job_env(spec.student, self.jobdir))
        try:
            self._cap_ranks()
            if self.launch is None:
                self.launch = self._start(self.world, [it.week for it in spec.items], timeout, spec.pg_timeout,
                                          job_env)
            else:
                self.launch.release(self.world, timeout, job_env)
        except BaseException:
            self._release()
            raise

    def finish(self):
        """Wait for the launch. Returns (run, results): the launch's RunResult and what each rank wrote
        ({"ranks": {r: {item id: RankRecord}}, "progress", "untrusted", "world"})."""
        try:
            run = self.launch.wait()
        finally:
            self.box.__exit__(None, None, None)
        try:
            return run, self._results(run)
        finally:
            self._uncap()

    def _results(self, run) -> dict:
        if self.switchboard and run is not None:
            run.backend = "switchboard"    # what carried the collectives (the report's footer says it)
        results = {"ranks": {}, "progress": {}, "untrusted": {}, "world": self.world}
        comm = _load_comm_record(self.record_dir) if self.switchboard else {}
        for r in range(self.world):
            if self.switchboard:
                results["ranks"][r], why = _records_from_switchboard(self.record_dir, r, self.items, comm)
            else:
                results["ranks"][r], why = _load_rank_file(os.path.join(self.outdir, f"rank{r}.pt"), r, run)
            full = self._out_full(r)
            if full:     # the rank's own error says ENOSPC; the verdict says which cap
                for rec in results["ranks"][r].values():
                    if "No space left on device" in rec.error:
                        rec.error = f"{rec.error.rstrip()}\n{full}"
                why = why or f"rank {self._place(r, results['ranks'][r])}: {full}"
            if why:
                results["untrusted"][r] = why
            results["progress"][r] = read_progress(os.path.join(self.rank_dir(r), f"rank{r}.progress"))
        return results

    def _place(self, r: int, records: dict) -> int:
        """Rank r as the verdict of the first item it has no result for numbers it: its place in that item's group."""
        for it in self.items:
            group = participants(it.t, self.world)
            if r in group and it.id not in records:
                return group.index(r)
        return r

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
        self._release()
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
    a deadlock, the ranks disagreed on a collective) as its error, whatever the rank said. The switchboard's reason
    for closing the rank's link (a malformed message, a flood) comes back as why the rank has no more results."""
    import torch
    from launch.switchboard import MAX_RESULTS
    out, read = {}, 0
    for index, item in enumerate(items):
        path = os.path.join(record_dir, f"rank{rank}", f"{index}.pt")
        try:
            data = read_regular(path, RESULT_LIMIT)
        except UnsafeFile as exc:
            return out, f"rank {rank}'s results cannot be read safely ({exc}): results are ignored."
        if data is None:
            continue
        read += len(data)
        if read > MAX_RESULTS:      # the switchboard refuses more; read no more than that of a rank in any case
            return out, f"rank {rank}'s results are over {MAX_RESULTS >> 20} MiB in all: the rest are ignored."
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
            # a link closed after the rank ended this item costs the next one (below), never this result
            if rank in event.get("ranks", []) and event.get("kind") != "protocol":
                rec.error = f"{SWITCHBOARD_VERDICT}{event.get('msg', '')}"
        out[item.id] = rec
    closed = [ev.get("msg", "") for seen in comm.values() for ev in seen.get("events", [])
              if ev.get("kind") == "protocol" and rank in ev.get("ranks", [])]
    return out, closed[0] if closed else None


def _pythonpath(root: str) -> str:
    old = os.environ.get("PYTHONPATH", "")
    return root + (os.pathsep + old if old else "")

