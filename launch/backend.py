"""Which backend and launcher a job uses.

NCCL needs one GPU per rank; everything else runs on gloo/CPU with the same student code.
Override with COURSE_BACKEND=gloo|nccl and COURSE_LAUNCHER=warm|fork|torchrun.
"""
import os


def cuda_device_count() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # torch missing or broken CUDA: fall back to CPU
        return 0


def pick_backend(nproc: int, requested: str | None = None) -> str:
    choice = (requested or os.environ.get("COURSE_BACKEND") or "auto").lower()
    if choice not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend {choice!r} is unknown: use 'gloo', 'nccl' or 'auto'")
    if choice == "auto":
        return "nccl" if cuda_device_count() >= nproc else "gloo"
    if choice == "nccl" and cuda_device_count() < nproc:
        raise RuntimeError(
            f"backend 'nccl' needs one GPU per rank: {nproc} ranks but {cuda_device_count()} CUDA devices. "
            "Use fewer ranks or backend='gloo'.")
    return choice


def default_launcher(backend: str, requested: str | None = None, interactive: bool = False) -> str:
    """On CPU: warm (a resident process forks each job) for interactive use, else fork (one torch
    import per job); torchrun for NCCL, where forking a CUDA process is unsafe."""
    env = os.environ.get("COURSE_LAUNCHER")
    choice = (env if env and (requested in (None, "auto")) else requested or "auto").lower()
    if choice not in ("auto", "warm", "fork", "torchrun"):
        raise ValueError(f"launcher {choice!r} is unknown: use 'warm', 'fork', 'torchrun' or 'auto'")
    if choice == "auto":
        return "torchrun" if backend == "nccl" else ("warm" if interactive else "fork")
    if choice in ("fork", "warm") and backend == "nccl":
        raise ValueError(f"the {choice} launcher cannot start NCCL ranks (CUDA does not survive fork): "
                         "use launcher='torchrun'")
    return choice


def fork_launcher_likely(requested_backend: str | None = None) -> bool:
    """Whether a non-interactive job will most likely get the fork launcher, decided without importing torch
    (a GPU device file stands in for CUDA): lets a caller start that launcher while it imports torch itself."""
    backend = (requested_backend or os.environ.get("COURSE_BACKEND") or "auto").lower()
    gpu = any(os.path.exists(d) for d in ("/dev/nvidiactl", "/dev/nvidia0"))
    if backend == "nccl" or (backend == "auto" and gpu):
        return False
    return (os.environ.get("COURSE_LAUNCHER") or "auto").lower() in ("auto", "fork")
