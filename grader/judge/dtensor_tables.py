"""The DTensor sharding tables of the weeks whose ranks run DTensor (grader/rank/dtensor_table.py).

A table is recorded once per torch version and lab solution, by a process of its own that runs the solution's plans
as a job's last rank on a fake process group (`python -m grader.judge.dtensor_tables WEEK OUT`, about 6 s), and is
kept in build/dtensor-tables/. Each job of such a week gets a copy in its folder, which its launcher reads inside its
box before it forks the ranks. A table is only ever a shortcut: without one (no solutions/, a read-only checkout, a
failed recording) every schema is propagated live, as torch does it.
"""
from __future__ import annotations

import fcntl
import glob
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile

from grader import ROOT
from grader.rank.exchange import DTENSOR_TABLE, participants

WEEKS = ("week07",)        # the weeks whose ranks run DTensor
CACHE = os.path.join(ROOT, "build", "dtensor-tables")
RECORD_TIMEOUT = 300       # seconds: the recording takes about 6 on a 2-core machine
FAILED = ".failed"         # beside a table that could not be recorded: why
# what decides which schemas a table holds, and how it is written
_SOURCES = ("grader/cases/{week}.py", "grader/rank/{week}.py", "grader/rank/dtensor_table.py",
            "grader/rank/exchange.py", "tpkit/models.py", "tpkit/dtensor.py")


def _solution(week: str) -> str | None:
    found = sorted(glob.glob(os.path.join(ROOT, "solutions", week, "*.ipynb")))
    return found[0] if found else None


def table_path(week: str) -> str | None:
    """Where the table of `week` for this torch and this solution lives (whether or not it exists yet)."""
    solution = _solution(week)
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    if solution is None:
        return None
    h = hashlib.sha256(f"{torch_version} {sys.version_info[:2]}".encode())
    for path in [solution] + [os.path.join(ROOT, s.format(week=week)) for s in _SOURCES]:
        with open(path, "rb") as f:
            h.update(f.read())
    return os.path.join(CACHE, f"{week}-{h.hexdigest()[:16]}.pkl")


def _settled(path: str) -> bool:
    """Recorded, or failed for good (a failed recording is not tried again for the same key)."""
    return os.path.exists(path) or os.path.exists(path + FAILED)


def missing(weeks) -> list[str]:
    """The weeks among `weeks` whose table is still to be recorded (not one whose recording failed)."""
    return [w for w in dict.fromkeys(weeks) if w in WEEKS and (p := table_path(w)) and not _settled(p)]


def ensure(week: str) -> str | None:
    """The table of `week`, recorded now if it is missing (one recording at a time); None where none can be made.
    A recording that failed is not tried again for this torch and solution: its error is in `<table>.failed`."""
    path = table_path(week)
    if path is None or os.path.exists(path):
        return path
    try:
        os.makedirs(CACHE, exist_ok=True)
        with open(os.path.join(CACHE, ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)     # a second job waits for the first recording, then uses it
            if not _settled(path):
                _record(week, path)
    except OSError:
        return None
    return path if os.path.exists(path) else None


def _record(week: str, path: str):
    fd, tmp = tempfile.mkstemp(dir=CACHE, suffix=".tmp")
    os.close(fd)
    try:
        done = subprocess.run([sys.executable, "-m", "grader.judge.dtensor_tables", week, tmp], cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                              timeout=RECORD_TIMEOUT)
        why = "" if done.returncode == 0 else done.stderr[-4000:] or f"exit status {done.returncode}"
    except subprocess.SubprocessError as exc:
        why = str(exc)
    for old in glob.glob(os.path.join(CACHE, f"{week}-*")):     # another torch's or solution's, or a failure
        os.unlink(old)
    if why:
        with open(path + FAILED, "w") as f:
            f.write(why)
        os.unlink(tmp)
    else:
        os.replace(tmp, path)


def job_env(weeks, jobdir: str) -> dict:
    """For a job running `weeks`: their tables copied into the job folder (readable by the launcher, not by a rank),
    and the variable that names them; {} when no week has one."""
    paths = []
    for week in dict.fromkeys(weeks):
        src = ensure(week) if week in WEEKS else None
        if src is None:
            continue
        dst = os.path.join(jobdir, f"dtensor-{week}.pkl")
        try:
            shutil.copyfile(src, dst)
            os.chmod(dst, 0o600)
        except OSError:     # replaced by a newer recording meanwhile: this job propagates live
            continue
        paths.append(dst)
    return {DTENSOR_TABLE: os.pathsep.join(paths)} if paths else {}


def run_week_as_rank(week: str, modules: dict, world: int, rank: int) -> list[str]:
    """Every case of `week` at every size, run as job rank `rank` of `world` on a fake process group (collectives move
    no data), with the groups a job makes (exchange.participants); returns the items run."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from grader.judge.case import cases_of_week
    from grader.rank.context import RankContext
    from tpkit.ledger import CommLedger
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    cases = cases_of_week(week)
    groups = {t: dist.new_group(participants(t, world)) for t in sorted({t for c in cases for t in c.world_sizes})}
    run = importlib.import_module(f"grader.rank.{week}")
    ran = []
    for case in cases:
        for t in case.world_sizes:
            ranks = participants(t, world)
            if rank not in ranks:
                continue
            full = case.make_inputs(case.config, torch.Generator().manual_seed(0))
            own = case.rank_inputs(case.config, full, ranks.index(rank), t) if case.rank_inputs else full
            ctx = RankContext(rank=ranks.index(rank), world_size=t, group=groups[t], device=torch.device("cpu"),
                              ledger=CommLedger(group_size=t))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                getattr(run, case.run_rank)(modules[case.module], case.config, own, ctx)
            ran.append(f"{case.name}@t{t}")
    return ran


def solution_modules(week: str, folder: str) -> dict:
    """The lab solution's modules of `week`, written into `folder` and imported from there."""
    import nbformat

    from grader.judge.sources import module_sources
    from grader.rank.entry import import_by_path
    for name, text in module_sources(nbformat.read(_solution(week), as_version=4)).items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
    return {name[:-3]: import_by_path(name[:-3], folder) for name in os.listdir(folder) if name.endswith(".py")}


def main(week: str, out: str) -> int:
    from grader.judge.case import cases_of_week
    from grader.rank import dtensor_meta, dtensor_table
    world = max(t for case in cases_of_week(week) for t in case.world_sizes)
    dtensor_meta.install()
    seen = dtensor_table.record()
    with tempfile.TemporaryDirectory() as folder:
        run_week_as_rank(week, solution_modules(week, folder), world, world - 1)   # the last rank runs every item
    with open(out, "wb") as f:
        dtensor_table.dump(seen, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
