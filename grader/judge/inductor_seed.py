"""A warm torch.compile cache for the grading ranks of a submission that compiles (its seed).

torch.compile's default backend (inductor) probes the CPU's vector instruction sets the first time it compiles a C++
kernel in a process with an empty cache: it builds a small C++ program per instruction set with torch's headers,
about 10 s of CPU, before it compiles anything of the student's (a rank's first compile with a C++ kernel: 15 s of
CPU cold, 7 to 8 s from the seed; a matmul alone needs no probe). Every isolated rank has a cache of its own, in its
own /tmp (launch/isolation.py: a cache two ranks shared would be a channel between them), so each rank would pay it
again in every job, near or past the item timeout (15 s). The seed is that probe done once per torch, Python,
compiler and CPU, by a process of its own running only this module's tiny function (`python -m
grader.judge.inductor_seed OUT`), kept in build/inductor-seed/. A job whose student modules mention torch.compile
gets a copy in its folder (readable by the launcher, not by a rank), and each rank starts from its own copy of that
(`launch.isolation.seed_cache`): the same files inductor would have written itself on a warm machine, never
anything a rank wrote. Without a seed (a read-only checkout, a failed warm-up) a rank compiles cold, as torch does.
"""
from __future__ import annotations

import fcntl
import glob
import hashlib
import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile

from grader import ROOT
from launch.isolation import COMPILE_ENV

CACHE = os.path.join(ROOT, "build", "inductor-seed")
SEED_TIMEOUT = 600          # seconds: the warm-up takes 20 to 50 on a busy 2-core machine
FAILED = ".failed"
JOB_SEED = "inductor-seed"  # the job folder's copy
ENV = "COURSE_INDUCTOR_SEED"
# what a student module says when it compiles with inductor (a hint, not a proof: a module that hides it compiles cold)
COMPILES = re.compile(r"\bcompile\b|_dynamo|_inductor|\binductor\b")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _compiler() -> str:
    cxx = shutil.which(os.environ.get("CXX", "g++")) or ""
    try:
        return cxx + " " + subprocess.run([cxx, "-dumpfullversion", "-dumpversion"], capture_output=True, text=True,
                                          timeout=30).stdout.strip() if cxx else ""
    except (OSError, subprocess.SubprocessError):
        return cxx


def seed_path() -> str | None:
    """Where the seed for this torch, Python, compiler and CPU lives (whether or not it exists yet)."""
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    key = f"{torch_version} {sys.version_info[:2]} {platform.machine()} {_compiler()} {_cpu_flags()}"
    return os.path.join(CACHE, hashlib.sha256(key.encode()).hexdigest()[:16])


def ensure() -> str | None:
    """The seed, made now if it is missing (one warm-up at a time); None where none can be made. A warm-up that failed
    is not tried again for the same key: its error is in `<seed>.failed`."""
    path = seed_path()
    if path is None or os.path.isdir(path):
        return path
    try:
        os.makedirs(CACHE, exist_ok=True)
        with open(os.path.join(CACHE, ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)     # a second job waits for the first warm-up, then uses it
            if not (os.path.isdir(path) or os.path.exists(path + FAILED)):
                _warm(path)
    except OSError:
        return None
    return path if os.path.isdir(path) else None


def _warm(path: str):
    tmp = tempfile.mkdtemp(dir=CACHE, prefix=".warming-")
    scratch = tempfile.mkdtemp(prefix="grader-inductor-seed-")     # its TMPDIR: nothing left in the machine's /tmp
    try:
        done = subprocess.run([sys.executable, "-m", "grader.judge.inductor_seed", tmp], cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": scratch,
                                   "TORCHINDUCTOR_CACHE_DIR": tmp, **COMPILE_ENV},
                              capture_output=True, text=True, timeout=SEED_TIMEOUT)
        why = "" if done.returncode == 0 else done.stderr[-4000:] or f"exit status {done.returncode}"
    except subprocess.SubprocessError as exc:
        why = str(exc)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    # another torch's or CPU's seed or failure, and a warm-up that was killed (we hold the lock: none other runs)
    for old in glob.glob(os.path.join(CACHE, "[0-9a-f]" * 16)) + glob.glob(os.path.join(CACHE, "*" + FAILED)) + \
            [p for p in glob.glob(os.path.join(CACHE, ".warming-*")) if p != tmp]:
        shutil.rmtree(old, ignore_errors=True) if os.path.isdir(old) else os.unlink(old)
    if why:
        with open(path + FAILED, "w") as f:
            f.write(why)
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, path)


def compiles(student_dir: str) -> bool:
    """Whether a module of the student's mentions torch.compile (or dynamo, inductor)."""
    for name in glob.glob(os.path.join(student_dir, "*.py")):
        try:
            with open(name, errors="replace") as f:
                if COMPILES.search(f.read()):
                    return True
        except OSError:
            continue
    return False


def job_env(student_dir: str, jobdir: str) -> dict:
    """For a job whose student modules compile: the seed copied into the job folder (the launcher's, not a rank's:
    root's, mode 0700), and the variable that names it; {} otherwise or where there is no seed."""
    dst = os.path.join(jobdir, JOB_SEED)
    if os.path.isdir(dst):          # an earlier attempt's
        return {ENV: dst}
    if not compiles(student_dir):
        return {}
    src = ensure()
    if src is None:
        return {}
    try:
        shutil.copytree(src, dst)
        os.chmod(dst, 0o700)
    except OSError:
        shutil.rmtree(dst, ignore_errors=True)
        return {}
    return {ENV: dst}


def main(out: str) -> int:
    """Compile a tiny forward and backward with inductor into TORCHINDUCTOR_CACHE_DIR (= `out`)."""
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == out, "run through ensure()"
    import torch
    torch.set_num_threads(1)
    f = torch.compile(lambda x, w: torch.relu(x @ w) + 1.0)
    x, w = torch.randn(8, 16), torch.randn(16, 4, requires_grad=True)
    f(x, w).sum().backward()
    assert w.grad is not None and torch.allclose(f(x, w), torch.relu(x @ w) + 1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
