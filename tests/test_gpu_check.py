"""What `python -m grader gpu-check` rests on, checked without a GPU (there is none here or in CI): NCCL is
chosen exactly when there is a GPU per rank, torchrun is then the launcher, and each rank gets torchrun's
environment with COURSE_BACKEND=nccl and its own LOCAL_RANK (the GPU `launch.dist` sets). Device counts are
monkeypatched; the launch in the last test is a real torchrun of a script that reports its environment."""
import json
import os
import re

import pytest

import launch.backend
from grader.tools import gpu_check
from launch import default_launcher, pick_backend, run


@pytest.fixture
def gpus(monkeypatch):
    monkeypatch.delenv("COURSE_BACKEND", raising=False)
    monkeypatch.delenv("COURSE_LAUNCHER", raising=False)

    def set_count(n: int):
        monkeypatch.setattr(launch.backend, "cuda_device_count", lambda: n)
    return set_count


@pytest.mark.parametrize("n_gpus,nproc,backend", [(0, 2, "gloo"), (1, 2, "gloo"), (2, 2, "nccl"), (3, 4, "gloo"),
                                                  (4, 4, "nccl"), (8, 4, "nccl"), (8, 1, "nccl")])
def test_nccl_exactly_when_there_is_a_gpu_per_rank(gpus, n_gpus, nproc, backend):
    gpus(n_gpus)
    assert pick_backend(nproc) == backend
    if backend == "nccl":
        assert default_launcher(backend) == default_launcher(backend, interactive=True) == "torchrun"
    else:
        assert (default_launcher(backend), default_launcher(backend, interactive=True)) == ("fork", "warm")


def test_overrides_and_refusals(gpus, monkeypatch):
    gpus(8)
    monkeypatch.setenv("COURSE_BACKEND", "gloo")
    assert pick_backend(4) == "gloo"
    gpus(2)
    monkeypatch.setenv("COURSE_BACKEND", "nccl")
    with pytest.raises(RuntimeError, match="'nccl' needs one GPU per rank: 4 ranks but 2 CUDA devices"):
        pick_backend(4)
    for launcher in ("fork", "warm"):
        with pytest.raises(ValueError, match="CUDA does not survive fork"):
            default_launcher("nccl", launcher)
    monkeypatch.setenv("COURSE_LAUNCHER", "fork")
    with pytest.raises(ValueError, match="use launcher='torchrun'"):
        default_launcher("nccl")
    assert default_launcher("gloo") == "fork"


def test_a_gpu_device_file_means_no_fork_launcher_is_held(monkeypatch):
    exists = os.path.exists
    monkeypatch.delenv("COURSE_BACKEND", raising=False)
    monkeypatch.delenv("COURSE_LAUNCHER", raising=False)
    monkeypatch.setattr(launch.backend.os.path, "exists", lambda p: p == "/dev/nvidiactl" or exists(p))
    assert not launch.backend.fork_launcher_likely()
    assert launch.backend.fork_launcher_likely("gloo")


def test_a_rank_on_the_nccl_path_gets_torchrun_and_its_own_gpu(gpus, tmp_path):
    """Two (fake) GPUs, two ranks: the job goes to torchrun with COURSE_BACKEND=nccl; each rank sees its own
    LOCAL_RANK, which `launch.dist.init_process_group` makes its CUDA device."""
    gpus(2)
    script = tmp_path / "env.py"
    script.write_text("import json, os\nprint(json.dumps({k: os.environ.get(k) for k in ('RANK', 'LOCAL_RANK', "
                      "'WORLD_SIZE', 'MASTER_ADDR', 'COURSE_BACKEND', 'OMP_NUM_THREADS', 'COURSE_JOB_ID')}))\n")
    res = run(str(script), 2, module=False, timeout=120)
    assert res.ok, res.output
    assert (res.backend, res.launcher) == ("nccl", "torchrun")
    envs = [json.loads(res.rank_output(r).strip().splitlines()[-1]) for r in range(2)]
    assert [e["LOCAL_RANK"] for e in envs] == [e["RANK"] for e in envs] == ["0", "1"]
    for e in envs:
        assert (e["WORLD_SIZE"], e["COURSE_BACKEND"], e["OMP_NUM_THREADS"], e["COURSE_JOB_ID"]) == \
            ("2", "nccl", "1", res.job_id)


def test_without_cuda_gpu_check_says_so_and_exits_0(gpus, capsys):
    from grader.__main__ import main
    gpus(0)
    assert main(["gpu-check"]) == 0
    assert "gpu-check: no CUDA device on this machine" in capsys.readouterr().out


def test_labs_run_at_the_sizes_the_gpus_allow():
    full = gpu_check.plan(64)
    assert full and all(skip is None for *_, skip in full)
    assert {which for _, which, _, _ in full} == {"solution", "stub"}
    for (week, _, sizes, _), (_, _, two, skip) in zip(full, gpu_check.plan(2)):
        if skip:     # a 2-D mesh check (week 7's FSDP x TP) has no size below 4
            assert skip.startswith("a check needs ") and int(skip.split()[3]) > 2 and two == (2,), week
        else:
            assert two == tuple(t for t in sizes if t <= 2), week
    assert all(skip and skip.endswith("ranks (one GPU each); this node has 1") for *_, skip in gpu_check.plan(1))
    from grader.judge.job import plan_items
    before = [it.t for it in plan_items(["week02/column_parallel"])]
    with gpu_check.capped_sizes(2):
        assert max(it.t for it in plan_items(["week02/column_parallel"])) == 2
    assert [it.t for it in plan_items(["week02/column_parallel"])] == before


def test_lecture_gpu_cells_and_nsys_recipes(tmp_path):
    recipes = dict(gpu_check.nsys_recipes())
    assert recipes["week06_overlap.ipynb"].endswith("nsys profile -t cuda,nvtx,osrt -o tp_profile python -m "
                                                    "reference.train_profile --nproc 4 --steps 40")
    assert "--nproc 2 " in gpu_check.sized(recipes["week06_overlap.ipynb"], 2)
    assert "--nproc 4 " in gpu_check.sized(recipes["week06_overlap.ipynb"], 8)
    (tmp_path / "notebooks").mkdir()
    cell = {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
            "source": ["if torch.cuda.is_available():\n", "    s = torch.cuda.Stream()\n"]}
    for name, cells in (("week01_a.ipynb", []), ("week06_b.ipynb", [cell])):
        (tmp_path / "notebooks" / name).write_text(json.dumps({"cells": cells}))
    assert gpu_check.gpu_lectures(str(tmp_path)) == [str(tmp_path / "notebooks" / "week06_b.ipynb")]


def test_the_table_on_a_two_gpu_node(monkeypatch, capsys):
    """main()'s flow with the CUDA parts stubbed: every lab row, skips with their reason, a failure exits 1."""
    monkeypatch.setattr(gpu_check, "gpu_count", lambda: 2)
    monkeypatch.setattr(gpu_check, "install", lambda: [("torch CUDA build", "torch", True, "CUDA 12.8")])
    monkeypatch.setattr(gpu_check, "check_lab", lambda week, which, gpus: (
        f"{week} {which}", "nccl/torchrun", (week, which) != ("week02", "stub"), "score", 1.0))
    monkeypatch.setattr(gpu_check, "gpu_lectures", lambda: [])
    monkeypatch.setattr(gpu_check.shutil, "which", lambda name: None)
    monkeypatch.setattr(gpu_check, "model_rows", lambda gpus: [
        ("cost model: bf16 GEMM 8192^3", "H100", "info", "measured 700 TFLOP/s, predicted 740", 0.0016)])
    assert gpu_check.main() == 1
    out = capsys.readouterr().out
    table = out[out.rindex("what "):]
    assert re.search(r"\ncost model: bf16 GEMM 8192\^3 +H100 +info +0\.0016 +measured 700 TFLOP/s, predicted 740\n",
                     table), table
    assert "week02 stub" in table and "FAIL" in table and "failed: week02 stub" in out
    assert re.search(r"\nweek02 solution +nccl/torchrun, 2 ranks +pass +1\.0 +score\n", table), table
    assert "week06_overlap.ipynb nsys recipe" in table and "no nsys on PATH" in table
    assert len([line for line in table.splitlines() if line.startswith("week")]) == \
        len(gpu_check.plan(2)) + len(gpu_check.nsys_recipes())


def test_gpu_names_map_to_the_cost_model():
    from tpkit import costmodel
    names = {"NVIDIA H100 80GB HBM3": "H100", "NVIDIA A100-SXM4-80GB": "A100", "NVIDIA H200": "H200",
             "NVIDIA B200": "B200", "NVIDIA GB200": "GB200", "Tesla V100-SXM2-32GB": None}
    assert {n: gpu_check.gpu_key(n) for n in names} == names
    assert all(k in costmodel.GPUS for k in names.values() if k)
