"""`%%torchrun -n 4`: run a notebook cell on N ranks and stream their output.

The cell becomes a script. Unless `--no-init` is given, a preamble initialises the
process group (backend from the launcher: NCCL with a GPU per rank, else gloo) and
defines `rank`, `world_size` and `device`. Any failed or hung rank raises in the
notebook, so papermill, nbgrader and CI see the failure.

`--trace PATH`: every rank records a torch.profiler trace of the cell body (`tpkit.trace.RankProfile`;
mark regions with `torch.profiler.record_function`); after the job the notebook merges the per-rank
files into one Chrome/Perfetto trace at PATH (one lane per rank) and draws it inline.
"""
from __future__ import annotations

import argparse
import glob
import os
import shlex
import shutil
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
TRACE_START = """
from tpkit.trace import RankProfile as _RankProfile
_course_trace = _RankProfile({out_dir!r}).start()
"""
TRACE_STOP = """
_course_trace.stop()
"""


USAGE = ("Usage: %%torchrun [-n N] [--backend gloo|nccl] [--launcher fork|torchrun] [--timeout S] [--no-init] "
         "[--trace PATH]")


class RankFailure(RuntimeError):
    """A rank failed or the job hung; the message carries the root cause."""


def parse_args(line: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="%%torchrun", add_help=False)
    p.add_argument("-n", "--nproc", type=int, default=2)
    p.add_argument("--backend", default=None)
    p.add_argument("--launcher", default=None)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--no-init", action="store_true")
    p.add_argument("--trace", default=None)
    try:
        a, unknown = p.parse_known_args(shlex.split(line))
    except SystemExit:  # argparse's own error already printed; say it plainly too
        raise ValueError(f"%%torchrun {line!r}: bad option value. {USAGE}") from None
    if unknown:
        raise ValueError(f"%%torchrun: unknown option(s) {' '.join(unknown)}. {USAGE}")
    if a.nproc < 1:
        raise ValueError(f"%%torchrun: -n must be at least 1, got {a.nproc}")
    return a


def run_cell(line: str, cell: str, print_fn=print, show_trace=None):
    """Run `cell` on the ranks; with --trace PATH, merge their traces into PATH and call show_trace(PATH)."""
    from launch import run
    a = parse_args(line)
    if os.environ.get("COURSE_GRADING") == "1":   # grader/box/kernel_box.py: demos are not run while grading
        print_fn(f"(%%torchrun -n {a.nproc}: not run while the notebook is being graded)")
        return None
    trace_dir = tempfile.mkdtemp(prefix="torchrun-trace-") if a.trace else None
    if trace_dir:   # the profiler starts after init_process_group and stops before the group is destroyed
        cell = TRACE_START.format(out_dir=trace_dir) + cell + TRACE_STOP
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
    try:
        if not res.ok:
            raise RankFailure(res.root_cause().replace(path, "<cell>"))
        if trace_dir:
            _merge_trace(trace_dir, a.trace, a.nproc, print_fn, show_trace)
    finally:
        if trace_dir:
            shutil.rmtree(trace_dir, ignore_errors=True)
    return res


def _merge_trace(trace_dir: str, out: str, nproc: int, print_fn, show_trace):
    from tpkit.trace import merge
    files = sorted(glob.glob(os.path.join(trace_dir, "rank*.json")))
    if len(files) != nproc:
        raise RankFailure(f"--trace: {len(files)} of {nproc} ranks wrote a trace")
    merge(files, out)
    print_fn(f"trace of {nproc} ranks merged into {out} (open it in ui.perfetto.dev or chrome://tracing)")
    if show_trace:
        show_trace(out)


def _draw_inline(path: str):
    import matplotlib.pyplot as plt
    from tpkit.trace import draw
    draw(path)
    plt.show()


def load_ipython_extension(ip):
    from IPython.core.magic import register_cell_magic

    @register_cell_magic("torchrun")
    def torchrun(line, cell):
        """%%torchrun [-n N] [--backend gloo|nccl] [--launcher fork|torchrun] [--timeout S] [--no-init]
        [--trace PATH]"""
        __tracebackhide__ = True  # noqa: F841
        run_cell(line, cell, show_trace=_draw_inline)
