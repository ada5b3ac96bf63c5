"""One all-reduce's time on the course backend (the switchboard) and on gloo: `time_payload` launches the ranks, and
each rank, this module run by `python -m launch.forkrun -m`, times its all-reduces and prints the figures.

The course backend moves a large payload through each rank's arena (`launch.wire.Arena`); the first all-reduce of
a size also touches the arena's pages for the first time, so it is reported apart from the rest.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time


def time_payload(backend: str, mib: int = 64, nproc: int = 4, repeats: int = 5) -> list[float]:
    """Seconds of each of `repeats` all-reduces of `mib` MiB of float32 on `nproc` ranks (rank 0's clock, each
    started after a barrier)."""
    from grader import ROOT
    with tempfile.TemporaryDirectory() as record:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "COURSE_ITEMS": "[]",
               "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
        env.pop("COURSE_SWITCHBOARD", None)
        if backend == "course":
            env["COURSE_SWITCHBOARD"] = record
        out = subprocess.run([sys.executable, "-m", "launch.forkrun", "--nproc", str(nproc), "-m",
                              "grader.tools.bench_payload", backend, str(mib), str(repeats)],
                             env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    for line in out.stdout.splitlines():
        if line.startswith("[rank 0] @@payload "):
            return json.loads(line.split("@@payload ", 1)[1])
    raise RuntimeError(f"the {backend} all-reduce benchmark printed no figures:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")


def _rank(backend: str, mib: int, repeats: int):
    import torch
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=120)
    if backend == "course":
        from launch import course_pg
        course_pg.register()
        course_pg.link().request({"k": "begin", "index": 0})
        dist.init_process_group("course", store=dist.HashStore(), rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    x = torch.ones(mib << 18)                                  # (mib MiB of float32,)
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        seconds.append(time.perf_counter() - t0)
    assert float(x[0]) == world ** repeats, "the all-reduce summed wrongly"
    if rank == 0:
        print("@@payload " + json.dumps(seconds), flush=True)
    dist.destroy_process_group()
    if backend == "course":
        course_pg.link().request({"k": "begin", "index": 1})     # the last item ends: every rank leaves together


if __name__ == "__main__":
    _rank(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
