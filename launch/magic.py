"""`%%torchrun -n 4`: run a notebook cell on N ranks and stream their output.

The cell becomes a script. Unless `--no-init` is given, a preamble initialises the
process group (backend from the launcher: NCCL with a GPU per rank, else gloo) and
defines `rank`, `world_size` and `device`. Any failed or hung rank raises in the
notebook, so papermill, nbgrader and CI see the failure.
"""
from __future__ import annotations

import argparse
import os
import shlex
import tempfile

PREAMBLE = """\
import torch
import torch.distributed as dist
from launch.dist import init_process_group
rank, world_size, device = init_process_group()
"""
POSTAMBLE = """
if dist.is_initialized():
    dist.barrier()   # rank 0 hosts the store: it must not leave while a peer still needs it
    dist.destroy_process_group()
"""


USAGE = "Usage: %%torchrun [-n N] [--backend gloo|nccl] [--launcher fork|torchrun] [--timeout S] [--no-init]"


class RankFailure(RuntimeError):
    """A rank failed or the job hung; the message carries the root cause."""


def parse_args(line: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="%%torchrun", add_help=False)
    p.add_argument("-n", "--nproc", type=int, default=2)
    p.add_argument("--backend", default=None)
    p.add_argument("--launcher", default=None)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--no-init", action="store_true")
    try:
        a, unknown = p.parse_known_args(shlex.split(line))
    except SystemExit:  # argparse's own error already printed; say it plainly too
        raise ValueError(f"%%torchrun {line!r}: bad option value. {USAGE}") from None
    if unknown:
        raise ValueError(f"%%torchrun: unknown option(s) {' '.join(unknown)}. {USAGE}")
    if a.nproc < 1:
        raise ValueError(f"%%torchrun: -n must be at least 1, got {a.nproc}")
    return a


def run_cell(line: str, cell: str, print_fn=print):
    from launch import run
    a = parse_args(line)
    if os.environ.get("COURSE_GRADING") == "1":   # grader.kernel_box: demos are not run while grading
        print_fn(f"(%%torchrun -n {a.nproc}: not run while the notebook is being graded)")
        return None
    code = cell if a.no_init else PREAMBLE + cell + POSTAMBLE
    with tempfile.NamedTemporaryFile("w", suffix="_cell.py", delete=False) as f:
        f.write(code)
        path = f.name
    here = os.getcwd()
    pp = os.environ.get("PYTHONPATH", "")
    try:
        res = run(path, a.nproc, module=False, backend=a.backend, launcher=a.launcher, timeout=a.timeout,
                  stream=print_fn, env={"PYTHONPATH": here + (os.pathsep + pp if pp else "")}, cwd=here,
                  interactive=True)
    finally:
        os.unlink(path)
    if not res.ok:
        raise RankFailure(res.root_cause().replace(path, "<cell>"))
    return res


def load_ipython_extension(ip):
    from IPython.core.magic import register_cell_magic

    @register_cell_magic("torchrun")
    def torchrun(line, cell):
        """%%torchrun [-n N] [--backend gloo|nccl] [--launcher fork|torchrun] [--timeout S] [--no-init]"""
        __tracebackhide__ = True  # noqa: F841
        run_cell(line, cell)
