"""`python -m grader check` is bounded and grades what autograde grades: a cell that sleeps or floods its output is
stopped and named, with the score still given; the check server's `--stop` answers during a check and a busy server
never makes a check wait; an edited grade cell is graded as released; the judging core imports no nbgrader
integration."""
import ast
import glob
import json
import os
import re
import subprocess
import sys
import time

import pytest

from grader.tools import check_server
from grader.tools.cli_check import CELL_TIMEOUT, OUTPUT_KEEP, run_timeout
from tests.procs import descendants, processes_naming
from tests.test_check_server import _alive, _env, _until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOLUTION = os.path.join(ROOT, "solutions", "week02", "tp_linear.ipynb")
SLEEP = "import time\ntime.sleep(10**6)"


def _solution() -> dict:
    with open(SOLUTION) as f:
        return json.load(f)


def _lab(tmp_path, name: str, between: list[str]) -> str:
    """The week 2 solution's %%writefile cells, then a code cell per source in `between`, then its grade cells: no
    setup cell, so the kernel runs only what a test puts there."""
    nb = _solution()
    modules = [c for c in nb["cells"] if "".join(c["source"]).startswith("%%writefile")]
    grades = [c for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("grade")]
    added = [{"cell_type": "code", "id": f"added-{i}", "metadata": {}, "execution_count": None, "outputs": [],
              "source": src} for i, src in enumerate(between)]
    nb["cells"] = modules + added + grades
    path = tmp_path / name
    path.write_text(json.dumps(nb))
    return str(path)


def _check(notebook: str, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grader", "check", notebook, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_the_timeouts_nest():
    """process group < job wall clock < + kill grace < nbgrader's Execute.timeout, for the lab with the most items;
    a check's cells get what autograde gives them, and a client waits for a served check longer than it may run."""
    from traitlets.config.loader import PyFileConfigLoader

    from grader.autograde.notebook import check_names_of, grade_cells
    from grader.judge.job import plan_items
    from grader.judge.timeouts import EXECUTE_TIMEOUT, KILL_GRACE, PG_TIMEOUT, job_wall_clock
    most = 0
    for path in glob.glob(os.path.join(ROOT, "solutions", "week*", "*.ipynb")):
        with open(path) as f:
            most = max(most, len(plan_items(check_names_of(grade_cells(json.load(f))))))
    assert most > 0
    assert PG_TIMEOUT < job_wall_clock(most) < job_wall_clock(most) + KILL_GRACE < EXECUTE_TIMEOUT
    config = PyFileConfigLoader("nbgrader_config.py", path=ROOT).load_config()
    assert config.Execute.timeout == EXECUTE_TIMEOUT == CELL_TIMEOUT
    assert CELL_TIMEOUT < run_timeout(CELL_TIMEOUT) < run_timeout(CELL_TIMEOUT) + check_server.ANSWER_GRACE_S


def test_a_sleeping_cell_is_stopped_by_name_and_the_notebook_still_scores(tmp_path):
    nb = _lab(tmp_path, "sleeps.ipynb", ['print("before")', SLEEP])
    t0 = time.monotonic()
    p = _check(nb, "--timeout", "2", timeout=60)
    assert time.monotonic() - t0 < 60
    assert ("note: the grader stopped the notebook in cell 4 (`import time`): it ran past its 2 s limit; "
            "the checks use its %%writefile cells") in p.stdout, p.stdout + p.stderr
    assert p.returncode == 0 and p.stdout.rstrip().endswith("score: 8/8") and not p.stderr


def test_the_whole_notebook_has_a_limit_too(tmp_path):
    nb = _lab(tmp_path, "slow.ipynb", ["import time\ntime.sleep(1.2)"] * 6)
    p = _check(nb, "--timeout", "2.5", timeout=60)
    assert re.search(r"note: the grader stopped the notebook in cell \d+ \(`import time`\): the notebook ran past "
                     r"its 5 s limit", p.stdout), p.stdout + p.stderr
    assert p.returncode == 0 and "score: 8/8" in p.stdout


def _peak_rss(args: list[str], env: dict) -> tuple[subprocess.CompletedProcess, float]:
    """Run `args`; its result and the peak resident memory of that process alone (VmHWM, MiB), read until it exits."""
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                peak = max([peak] + [int(ln.split()[1]) for ln in f if ln.startswith("VmHWM")])
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    out, err = proc.communicate()
    return subprocess.CompletedProcess(args, proc.returncode, out, err), peak / 1024


def test_a_flood_of_output_is_cut_and_stopped_and_the_grader_stays_small(tmp_path):
    """Two MiB printed: the first one kept. 300 MiB printed: the run stops, and the trusted process does not hold it
    (without the bounds it grew past 1.7 GB; a check of a quiet notebook peaks near 0.3 GB)."""
    nb = _lab(tmp_path, "floods.ipynb", ['print("x" * (1 << 20))\nprint("y" * (1 << 20))',
                                         'for _ in range(300):\n    print("x" * (1 << 20))'])
    out = tmp_path / "out.ipynb"
    p, peak = _peak_rss([sys.executable, "-m", "grader", "check", nb, "--output", str(out)], os.environ)
    assert ("note: cell 3 (`print(\"x\" * (1 << 20))`) printed more than 1 MiB: the grader kept the first 1 MiB of "
            "its output") in p.stdout, p.stdout + p.stderr
    assert re.search(r"note: the grader stopped the notebook in cell 4 \(`for _ in range\(300\):`\): it( printed more "
                     r"than 32 MiB|s output did not all arrive)", p.stdout), p.stdout
    assert p.returncode == 0 and "score: 8/8" in p.stdout
    assert peak < 700, f"the trusted process peaked at {peak:.0f} MiB"
    cells = json.loads(out.read_text())["cells"]
    kept = ["".join(o.get("text", "")) for o in cells[2]["outputs"]]
    assert OUTPUT_KEEP < len("".join(kept)) < OUTPUT_KEEP + 200 and kept[-1].endswith("of a cell's output]\n")
    assert sum(len("".join(o.get("text", ""))) for o in cells[3]["outputs"]) < OUTPUT_KEEP + 200


def _edited(tmp_path) -> str:
    """The week 2 solution with RowParallelLinear broken, the row grade cell edited to call an easier check and the
    MLP grade cell deleted: graded as written, 6/6; as released, 3/8."""
    nb = _solution()
    for cell in nb["cells"]:
        gid = cell["metadata"].get("nbgrader", {}).get("grade_id")
        if gid == "tp_linear_row":
            cell["source"] = "".join(cell["source"]) + "\nRowParallelLinear.forward = lambda self, x: x[..., :0]\n"
        if gid == "check_row":
            cell["source"] = 'check("week02/column_parallel")'
    nb["cells"] = [c for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id") != "check_mlp"]
    path = tmp_path / "tp_linear.ipynb"
    path.write_text(json.dumps(nb))
    return str(path)


def test_an_edited_grade_cell_is_graded_as_released(tmp_path):
    p = _check(_edited(tmp_path), "--no-execute")
    assert "note: grade cell `check_row` was edited; the released cell is graded" in p.stdout, p.stdout + p.stderr
    assert "note: grade cell `check_mlp` is missing; the released cell is graded" in p.stdout
    assert re.search(r"^check_row: 0/3$", p.stdout, re.M) and re.search(r"^check_mlp: 0/2$", p.stdout, re.M)
    assert p.returncode == 1 and p.stdout.rstrip().endswith("score: 3/8")


def test_a_notebook_that_is_no_lab_keeps_its_own_grade_cells(tmp_path):
    nb = _solution()
    for cell in nb["cells"]:
        meta = cell["metadata"].get("nbgrader")
        if meta and "grade_id" in meta:
            meta["grade_id"] = "mine_" + meta["grade_id"]
    cell = next(c for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id") == "mine_check_mlp")
    cell["source"] = 'check("week02/column_parallel")'
    path = tmp_path / "mine.ipynb"
    path.write_text(json.dumps(nb))
    p = _check(str(path), "--no-execute")
    assert "note: this notebook is not one of the course's labs (no released lab has its grade cells): its own " \
           "grade cells are graded" in p.stdout, p.stdout + p.stderr
    assert p.returncode == 0 and "mine_check_mlp: 2/2" in p.stdout and p.stdout.rstrip().endswith("score: 8/8")


def test_the_judging_core_imports_no_nbgrader_integration():
    for path in glob.glob(os.path.join(ROOT, "grader", "judge", "*.py")):
        with open(path) as f:
            tree = ast.parse(f.read())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [n for n in names if n.startswith(("grader.autograde", "grader.tools"))], path


def _server(env: dict) -> subprocess.Popen:
    """A check server for the week 2 lab, as `python -m grader check` starts one, up once it holds a kernel."""
    sock = check_server.address(env)
    server = subprocess.Popen([sys.executable, "-m", "grader", "check-server", "--socket", sock, "--notebook",
                               SOLUTION], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert _until(lambda: any("ipykernel_launcher" in a for args in descendants(server.pid).values() for a in args), 60)
    return server


@pytest.mark.xdist_group("check_server")
def test_a_served_check_is_bounded_a_busy_server_never_makes_a_check_wait_and_stop_answers_during_a_check(tmp_path):
    env = _env()
    sock = check_server.address(env)
    server = _server(env)
    try:
        bounded = _check(_lab(tmp_path, "sleeps.ipynb", [SLEEP]), "--timeout", "2", env=env, timeout=60)
        assert "starts cold" not in bounded.stdout and "busy" not in bounded.stdout, bounded.stdout + bounded.stderr
        assert "note: the grader stopped the notebook in cell 3 (`import time`): it ran past its 2 s limit" \
               in bounded.stdout and bounded.stdout.rstrip().endswith("score: 8/8")
        # a check that sleeps as long as it may: in flight when the next check and the stop come
        flight = subprocess.Popen([sys.executable, "-m", "grader", "check", _lab(tmp_path, "flight.ipynb", [SLEEP])],
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert flight.stdout.readline().startswith("running"), "the check was not served"
        assert _until(lambda: _alive(p for p, a in descendants(server.pid).items() if "ipykernel_launcher" in a), 30)
        t0 = time.monotonic()
        other = _check(SOLUTION, "--no-execute", env=env, timeout=120)
        assert "note: the check server is busy with another check; this one runs on its own" in other.stdout
        assert other.returncode == 0 and "score: 8/8" in other.stdout and time.monotonic() - t0 < 60
        running = descendants(server.pid)
        assert running, "nothing in flight"
        t0 = time.monotonic()
        stop = subprocess.run([sys.executable, "-m", "grader", "check-server", "--stop"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
        assert stop.returncode == 0 and "stopped" in stop.stdout and time.monotonic() - t0 < 15
        rest = flight.communicate(timeout=30)[0]
        assert "note: the check server is stopping (python -m grader check-server --stop): this check is cut short" \
               in rest, rest
        assert server.wait(timeout=15) == 0 and not os.path.exists(sock)
        assert _until(lambda: not _alive(running), 10), f"left running: {[running[p] for p in _alive(running)]}"
        assert not processes_naming(str(tmp_path / "flight.ipynb"))
    finally:
        server.kill()
