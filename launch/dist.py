"""`init_process_group()` for course code: backend and timeout from the launcher, device per rank."""
import atexit
import datetime
import os

import torch
import torch.distributed as dist


def init_process_group(backend: str | None = None, timeout_s: float | None = None):
    """Idempotent; returns (rank, world_size, device).

    Always passes a timeout: gloo's default is 30 minutes, so a deadlock would
    otherwise hang a notebook cell for half an hour.
    """
    backend = backend or os.environ.get("COURSE_BACKEND", "gloo")
    timeout_s = timeout_s or float(os.environ.get("COURSE_PG_TIMEOUT", "60"))
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        atexit.register(_destroy_at_exit)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def _destroy_at_exit():
    """Leave in order: a process that reaches interpreter teardown with its gloo group alive can be aborted
    by gloo's worker threads (SIGABRT, "terminate called without an active exception", pytorch/pytorch#190489),
    so a job whose work is done would fail at exit. Destroying the group first joins those threads."""
    if dist.is_initialized():
        dist.destroy_process_group()
