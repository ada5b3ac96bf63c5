"""`python -m grader gpu-check` (make gpu-check): a GPU node checked in one command.

On a machine with CUDA it checks the install (a CUDA build of torch, NCCL, the GPUs), grades every lab's
solution and released stub through the trusted path (`grader.tools.cli_check.check_notebook`, what
`python -m grader check NB --backend nccl` runs; its jobs start their ranks with torchrun, one GPU per rank),
each check at its world sizes up to the GPU count, executes the lectures that have GPU cells (a code cell
guarded by `torch.cuda.is_available()`) into a temp folder, and runs the lectures' Nsight Systems recipes
where `nsys` exists. One table says what ran, on what, whether it passed and how long it took (measured
here), and three measurements beside what the course's cost model (tpkit.costmodel) predicts for this GPU: a
bf16 GEMM, an HBM copy and, with two GPUs or more, an NCCL all-reduce across them (rows marked "info": the
model is compared, never graded). Without CUDA it says so and exits 0.
"""
from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from grader import ROOT

CHECK_TIMEOUT = 900
# `(nccl, torchrun launcher, 3.1 s)`: the last line of a check's table (grader.judge.job.Report.table)
_RAN_ON = re.compile(r"\((\w+), (\w+) launcher, [\d.]+ s\)")
_SCORE = re.compile(r"score: ([\d.]+)/([\d.]+)")
_NSYS = re.compile(r"^((?:\w+=\S+ )*nsys profile .*)$", re.M)


def gpu_count() -> int:
    from launch.backend import cuda_device_count
    return cuda_device_count()


def install() -> list[tuple[str, str, bool, str]]:
    """(what, on, passed, detail) rows for the install: torch's CUDA build, NCCL, the GPUs."""
    import torch
    import torch.distributed as dist
    n = gpu_count()
    names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
    nccl = dist.is_available() and dist.is_nccl_available()
    version = ".".join(map(str, torch.cuda.nccl.version())) if nccl else "missing"
    return [("torch CUDA build", f"torch {torch.__version__}", torch.version.cuda is not None,
             f"CUDA {torch.version.cuda}"),
            ("NCCL", "torch.distributed", nccl, f"NCCL {version}"),
            ("GPUs", ", ".join(names) or "none", n > 0, f"{n} visible")]


def labs() -> list[tuple[str, str, list[tuple[int, ...]]]]:
    """(week, lab notebook path, the world sizes of each check its grade cells call) for every released lab."""
    import nbformat
    from grader.judge.case import get_case
    from grader.autograde.notebook import grade_cells
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "labs", "week*", "*.ipynb"))):
        names = [n for _, _, ns, _ in grade_cells(nbformat.read(path, as_version=4)) for n in ns]
        if names:
            out.append((os.path.basename(os.path.dirname(path)), path, [get_case(n).world_sizes for n in names]))
    return out


def plan(gpus: int) -> list[tuple[str, str, tuple[int, ...], str | None]]:
    """(week, solution or stub, the world sizes run, why it is skipped or None) for every lab on `gpus` GPUs.
    NCCL needs one GPU per rank: each check runs at its sizes up to `gpus`; a lab with a check that has no
    such size is skipped."""
    rows = []
    for week, _, sizes in labs():
        allowed = tuple(sorted({t for ws in sizes for t in ws if t <= gpus}))
        smallest = max(min(ws) for ws in sizes)
        skip = None if smallest <= gpus else f"a check needs {smallest} ranks (one GPU each); this node has {gpus}"
        rows += [(week, which, allowed, skip) for which in ("solution", "stub")]
    return rows


@contextlib.contextmanager
def capped_sizes(gpus: int):
    """While a lab is checked on this node, every check runs at its sizes up to `gpus` (COURSE_MAX_RANKS)."""
    from grader.judge.job import MAX_RANKS_ENV
    saved = os.environ.get(MAX_RANKS_ENV)
    os.environ[MAX_RANKS_ENV] = str(gpus)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(MAX_RANKS_ENV, None)
        else:
            os.environ[MAX_RANKS_ENV] = saved


def gpu_lectures(root: str = ROOT) -> list[str]:
    """Lecture notebooks with a code cell guarded by `torch.cuda.is_available()`."""
    out = []
    for path in sorted(glob.glob(os.path.join(root, "notebooks", "week*.ipynb"))):
        with open(path) as f:
            cells = json.load(f)["cells"]
        if any(c["cell_type"] == "code" and "torch.cuda.is_available()" in "".join(c["source"]) for c in cells):
            out.append(path)
    return out


def nsys_recipes(root: str = ROOT) -> list[tuple[str, str]]:
    """(lecture, command) for every `nsys profile ...` command line in a lecture's cells."""
    out = []
    for path in sorted(glob.glob(os.path.join(root, "notebooks", "week*.ipynb"))):
        with open(path) as f:
            text = "\n".join("".join(c["source"]) for c in json.load(f)["cells"])
        text = re.sub(r"\\\n\s*", "", text)                      # shell line continuations
        out += [(os.path.basename(path), m) for m in dict.fromkeys(_NSYS.findall(text))]
    return out


def sized(command: str, gpus: int) -> str:
    """A recipe at the size this node allows: `--nproc N` capped at the GPU count."""
    return re.sub(r"--nproc (\d+)", lambda m: f"--nproc {min(int(m.group(1)), gpus)}", command)


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


def check_lab(week: str, which: str, gpus: int) -> tuple[str, str, bool, str, float]:
    """Grade the lab's solution (full marks expected) or its released stub (zero) on NCCL with
    `grader.tools.cli_check.check_notebook`, what `python -m grader check NB --backend nccl` runs."""
    from grader.tools.cli_check import check_notebook
    from grader.tools.corpus import build
    work = tempfile.mkdtemp(prefix="gpu-check-")
    out, saved = io.StringIO(), os.environ.get("COURSE_BACKEND")
    try:
        nb = os.path.join(work, f"{week}-{which}.ipynb")
        with open(nb, "w") as f:
            json.dump(build(week, {"base": "solution"} if which == "solution" else {}), f)
        t0 = time.monotonic()
        with capped_sizes(gpus), contextlib.redirect_stdout(out):
            check_notebook(nb, backend="nccl")
        secs = time.monotonic() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
        # check_notebook pins COURSE_BACKEND for its process; the lectures run after this choose their own
        if saved is None:
            os.environ.pop("COURSE_BACKEND", None)
        else:
            os.environ["COURSE_BACKEND"] = saved
    text = out.getvalue()
    score, ran = _SCORE.search(text), set(_RAN_ON.findall(text))
    on = ", ".join(f"{b}/{launcher}" for b, launcher in sorted(ran)) or "?"
    if not score:
        return f"{week} {which}", on, False, (text.strip().splitlines() or ["no output"])[-1], secs
    got, total = float(score.group(1)), float(score.group(2))
    ok = (got == total > 0 if which == "solution" else got == 0) and ran == {("nccl", "torchrun")}
    return f"{week} {which}", on, ok, f"score {got:g}/{total:g}", secs


def run_lecture(path: str) -> tuple[str, str, bool, str, float]:
    from grader.tools.lectures import execute_lecture
    out = os.path.join(tempfile.mkdtemp(prefix="gpu-check-"), os.path.basename(path))
    t0 = time.monotonic()
    try:
        execute_lecture(path, out=out)
        return os.path.basename(path), "papermill, all cells", True, f"executed into {out}", time.monotonic() - t0
    except Exception as e:      # papermill's error names the cell; its last line is the exception
        last = str(e).strip().splitlines()
        return os.path.basename(path), "papermill, all cells", False, (last or [type(e).__name__])[-1], \
            time.monotonic() - t0


def run_nsys(lecture: str, command: str, gpus: int) -> tuple[str, str, bool, str, float]:
    command = sized(command, gpus)
    work = tempfile.mkdtemp(prefix="gpu-check-nsys-")
    t0 = time.monotonic()
    p = subprocess.run(["bash", "-c", command], cwd=work, env=_env(), capture_output=True, text=True,
                       timeout=CHECK_TIMEOUT)
    secs = time.monotonic() - t0
    reports = glob.glob(os.path.join(work, "*.nsys-rep"))
    tail = (p.stdout + p.stderr).strip().splitlines()
    detail = reports[0] if reports else tail[-1] if tail else f"exit {p.returncode}, no report"
    return f"{lecture} nsys recipe", command, p.returncode == 0 and bool(reports), detail, secs


def gpu_key(device_name: str) -> str | None:
    """The tpkit.costmodel.GPUS entry for a CUDA device name ("NVIDIA H100 80GB HBM3" -> "H100"), None if none."""
    return next((k for k in ("GB200", "B200", "H200", "H100", "A100") if k in device_name), None)


def _cuda_seconds(fn, iters: int = 20) -> float:
    """Median of `iters` timed runs after warm-up, with CUDA events (the GPU's time, not the launch's)."""
    import torch
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _all_reduce_worker(rank: int, world: int, port: int, nbytes: int, out):
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    seconds = _cuda_seconds(lambda: dist.all_reduce(x), iters=10)
    if rank == 0:
        out.put(seconds)
    dist.destroy_process_group()


def model_rows(gpus: int) -> list[tuple[str, str, str, str, float]]:
    """(what, on, result, detail, seconds): measured here beside the cost model's prediction for this GPU."""
    import torch
    from launch.forkrun import free_port
    from tpkit import costmodel as cm
    from tpkit.topology import ClusterSpec
    name = torch.cuda.get_device_name(0)
    key = gpu_key(name)
    if key is None:
        return [("cost model", name, "skipped", "no entry for this GPU in tpkit.costmodel.GPUS", 0.0)]
    gpu, n, rows = cm.GPUS[key], 8192, []
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    t = _cuda_seconds(lambda: a @ b)
    pred = cm.gemm_time(n, n, n, gpu)
    rows.append(("cost model: bf16 GEMM 8192^3", f"{name} as {key}", "info",
                 f"measured {2 * n ** 3 / t / 1e12:.0f} TFLOP/s, predicted {2 * n ** 3 / pred / 1e12:.0f}", t))
    nbytes = 2 ** 30
    x, y = (torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2))
    t = _cuda_seconds(lambda: y.copy_(x))                      # reads and writes 1 GiB each
    pred = cm.memory_time(2 * nbytes, gpu)
    rows.append(("cost model: HBM copy 1 GiB", f"{name} as {key}", "info",
                 f"measured {2 * nbytes / t / 1e9:.0f} GB/s, predicted {2 * nbytes / pred / 1e9:.0f}", t))
    if gpus >= 2:
        ctx = torch.multiprocessing.get_context("spawn")
        out = ctx.Queue()
        torch.multiprocessing.start_processes(_all_reduce_worker, args=(gpus, free_port(), nbytes, out), nprocs=gpus,
                                              start_method="spawn")
        t = out.get(timeout=60)
        pred = cm.collective_time("all_reduce", nbytes, gpus, ClusterSpec(n_nodes=1, gpus_per_node=gpus, gpu=key))
        algo, best = cm.nccl_pick("all_reduce", nbytes, gpus, ClusterSpec(n_nodes=1, gpus_per_node=gpus, gpu=key))
        rows.append((f"cost model: all-reduce 1 GiB on {gpus} GPUs", f"{name} as {key}, NCCL", "info",
                     f"measured busbw {cm.algbw_busbw('all_reduce', nbytes, gpus, t)[1] / 1e9:.0f} GB/s, predicted "
                     f"{cm.algbw_busbw('all_reduce', nbytes, gpus, pred)[1] / 1e9:.0f} (ring), "
                     f"{cm.algbw_busbw('all_reduce', nbytes, gpus, best)[1] / 1e9:.0f} ({algo})", t))
    return rows


def table(rows: list[tuple[str, str, str, str, str]]) -> str:
    head = ("what", "on", "result", "seconds", "detail")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(4)]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(r[:4], widths)) + "  " + r[4] for r in [head, *rows]]
    return "\n".join(lines)


def main() -> int:
    gpus = gpu_count()
    if gpus == 0:
        import torch
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
        print(f"gpu-check: no CUDA device on this machine (torch {torch.__version__}, {build}): nothing to check "
              "here. Run it on a GPU node with a CUDA build of torch in the venv (README, GPUs).")
        return 0
    rows = [(what, on, "pass" if ok else "FAIL", "-", detail) for what, on, ok, detail in install()]
    print(table(rows), flush=True)
    for week, which, sizes, skip in plan(gpus):
        if skip:
            rows.append((f"{week} {which}", "nccl/torchrun", "skipped", "-", skip))
            continue
        what, on, ok, detail, secs = check_lab(week, which, gpus)
        rows.append((what, f"{on}, {'/'.join(map(str, sizes))} ranks", "pass" if ok else "FAIL", f"{secs:.1f}",
                     detail))
        print("  ".join(map(str, rows[-1])), flush=True)
    for what, on, result, detail, secs in model_rows(gpus):
        rows.append((what, on, result, f"{secs:.4f}", detail))
        print("  ".join(map(str, rows[-1])), flush=True)
    for path in gpu_lectures():
        what, on, ok, detail, secs = run_lecture(path)
        rows.append((what, on, "pass" if ok else "FAIL", f"{secs:.1f}", detail))
        print("  ".join(map(str, rows[-1])), flush=True)
    for lecture, command in nsys_recipes():
        scripts = [f for f in re.findall(r"\S+\.py\b", command) if not os.path.exists(os.path.join(ROOT, f))]
        skip = "no nsys on PATH" if not shutil.which("nsys") else \
            f"runs {', '.join(scripts)}, which the lecture's text has you write" if scripts else None
        if skip:
            rows.append((f"{lecture} nsys recipe", "nsys", "skipped", "-", skip))
            continue
        what, on, ok, detail, secs = run_nsys(lecture, command, gpus)
        rows.append((what, on, "pass" if ok else "FAIL", f"{secs:.1f}", detail))
    print("\n" + table(rows))
    failed = [r[0] for r in rows if r[2] == "FAIL"]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} rows passed or skipped" +
          (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
