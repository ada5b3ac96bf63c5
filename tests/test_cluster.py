"""The class beyond one machine, on real engines: a one-node SLURM (munged, slurmctld, slurmd) and a PostgreSQL
server, both from Debian's packages (`make cluster-deps`), started here in a temp folder and stopped at the end.

- `launch/slurm/grade_class.sbatch` as a real array job: each slice of a scratch class into its own gradebook,
  then `merge-gradebooks`; the merged gradebook equals a one-machine autograde of the same class.
- The same array job with `GRADEBOOK=shared`: its tasks write at once into one PostgreSQL gradebook (nbgrader's
  `db_url`); the grades equal the SQLite run's. A worker that meets a student another worker holds stops with
  an error and writes nothing.
- `launch/slurm/train.sbatch` on CPU/gloo ranks: its c10d rendezvous and each rank's output.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from grader import ROOT

pytestmark = pytest.mark.xdist_group("cluster")   # one SLURM and one PostgreSQL, on one xdist worker
SLURM_BINS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/bin/sbatch")
PG_BIN = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
WEEK = "week02"
CLASS = {"ana": "solution", "ben": "stub", "cy": "bias_every_rank"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _need_root(what: str):
    if os.geteuid() != 0:
        pytest.skip(f"{what} runs its daemons as root here (run the tests as root, as CI does)")


def _wait(predicate, seconds: float, what: str, logs=()):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    tails = "\n".join(f"--- {p}\n{open(p).read()[-2000:]}" for p in logs if os.path.exists(p))
    raise RuntimeError(f"{what} not ready after {seconds:.0f} s\n{tails}")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """munged + slurmctld + slurmd on this host, one node, one partition; yields the environment sbatch needs."""
    missing = [b for b in SLURM_BINS if not os.path.exists(b)]
    if missing:
        pytest.skip(f"no SLURM here ({', '.join(missing)} missing): run `make cluster-deps` (apt: slurm-wlm munge)")
    _need_root("the one-node SLURM")
    d = str(tmp_path_factory.mktemp("slurm"))
    with open(f"{d}/munge.key", "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(f"{d}/munge.key", 0o600)
    node = subprocess.run(["/usr/sbin/slurmd", "-C"], capture_output=True, text=True, check=True).stdout.split("\n")[0]
    host = socket.gethostname().split(".")[0]
    conf = f"{d}/slurm.conf"
    with open(conf, "w") as f:
        f.write(f"""ClusterName=course
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge.sock
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
DependencyParameters=kill_invalid_depend
{node} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
    env = dict(os.environ, SLURM_CONF=conf)
    daemons = []

    def start(name, *cmd):
        log = open(f"{d}/{name}.log", "w")
        daemons.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=d))

    try:
        start("munged", "/usr/sbin/munged", "--foreground", "--force", f"--key-file={d}/munge.key",
              f"--socket={d}/munge.sock", f"--pid-file={d}/munged.pid", f"--seed-file={d}/munged.seed",
              f"--log-file={d}/munged.file.log")
        _wait(lambda: os.path.exists(f"{d}/munge.sock"), 20, "munged", [f"{d}/munged.log"])
        start("slurmctld", "/usr/sbin/slurmctld", "-D", "-f", conf)
        start("slurmd", "/usr/sbin/slurmd", "-D", "-f", conf)
        _wait(lambda: subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                     text=True).stdout.strip() == "idle",
              30, "the SLURM node", [f"{d}/slurmctld.log", f"{d}/slurmd.log"])
        yield env
    finally:
        subprocess.run(["scancel", "--user=root"], env=env, capture_output=True)
        for p in reversed(daemons):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _job_env(slurm: dict, **extra) -> dict:
    """What a job gets from sbatch (it exports the submitter's environment): this venv and the repository."""
    return dict(slurm, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], PYTHONPATH=ROOT,
                OMP_NUM_THREADS="1", **extra)


def submit(env: dict, cwd: str, *args: str) -> str:
    sub = subprocess.run(["sbatch", "--parsable", *args], cwd=cwd, env=env, capture_output=True, text=True)
    assert sub.returncode == 0, f"sbatch {' '.join(args)}: {sub.stderr}"
    return sub.stdout.strip().split(";")[0]


def wait(env: dict, job: str, timeout: float = 240, check: bool = True) -> list[str]:
    """Wait until every task of `job` left the queue; their `scontrol` records; raise if one failed (`check`).
    (sbatch --wait sleeps up to tens of seconds between looks; this looks every 0.3 s.)"""
    deadline = time.monotonic() + timeout
    while subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < deadline, f"job {job} still queued or running after {timeout} s"
        time.sleep(0.3)
    records = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True,
                             text=True).stdout.strip().splitlines()
    bad = [r for r in records if "JobState=COMPLETED" not in r]
    if check:
        logs = "".join(open(p).read()[-3000:] for r in bad for p in [r.split("StdOut=")[1].split()[0]]
                       if os.path.exists(p))
        assert records and not bad, f"job {job} failed:\n" + "\n".join(bad) + "\n" + logs
    return records


def sbatch(env: dict, cwd: str, *args: str, check: bool = True) -> list[str]:
    return wait(env, submit(env, cwd, *args), check=check)


def rows(db: str) -> dict:
    """{student: (score, max_score, {grade cell: score})} of the week in a gradebook file or database URL."""
    from grader.autograde.gradebooks import gradebook
    with gradebook(db) as gb:
        return {s.student_id: (s.score, s.max_score, {g.name: g.score for nb in s.notebooks for g in nb.grades})
                for s in gb.assignment_submissions(WEEK)}


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """A scratch class with its released week (gradebook.db: the assignment, no submissions), every submission
    under submitted/, and the grades one machine gives it (`reference.db`)."""
    from grader.autograde.class_autograde import autograde_class
    from grader.tools.demo import submission
    from grader.autograde.nbgrader_tools import course_api, scratch_course
    c = scratch_course([WEEK])
    assert course_api(c).generate_assignment(WEEK, force=True)["success"]
    for student, kind in CLASS.items():
        os.makedirs(f"{c}/submitted/{student}/{WEEK}")
        with open(f"{c}/submitted/{student}/{WEEK}/tp_linear.ipynb", "w") as f:
            json.dump(submission(kind), f)
    autograde_class(c, WEEK, jobs=2, db=f"{c}/reference.db", out=open(os.devnull, "w"))
    reference = rows(f"{c}/reference.db")
    assert reference["ana"][0] == reference["ana"][1] > 0 and reference["ben"][0] == 0, reference
    yield c, reference
    shutil.rmtree(c, ignore_errors=True)


def test_grade_class_array_job_merges_to_the_one_machine_gradebook(slurm, course):
    """The instructor guide's recipe: an array job of two slices, each into its own gradebook, then the merge
    as a job that waits for them (afterok)."""
    c, reference = course
    env = _job_env(slurm)
    os.makedirs(f"{c}/slices", exist_ok=True)
    jobs = submit(env, c, "--array=0-1", f"{ROOT}/launch/slurm/grade_class.sbatch", WEEK)
    wait(env, submit(env, c, f"--dependency=afterok:{jobs}", "--output=slices/merge-%j.log",
                     "--wrap", f"python -m grader merge-gradebooks gradebook.db slices/{WEEK}-*.db"))
    assert len(wait(env, jobs)) == 2
    assert sorted(os.path.basename(p) for p in glob.glob(f"{c}/slices/{WEEK}-*.db")) == [f"{WEEK}-0.db", f"{WEEK}-1.db"]
    assert set(rows(f"{c}/slices/{WEEK}-0.db")) == {"ana", "cy"}     # slice 0 of 2: every other student
    assert rows(f"{c}/gradebook.db") == reference


@pytest.fixture(scope="module")
def pg(tmp_path_factory):
    """A PostgreSQL server (Debian's binaries, run as the postgres user) on a Unix socket in a temp folder;
    yields the database URL of an empty database for the gradebook."""
    if not PG_BIN:
        pytest.skip("no PostgreSQL here (/usr/lib/postgresql/*/bin missing): run `make cluster-deps` (apt: postgresql)")
    _need_root("PostgreSQL (initdb and pg_ctl as the postgres user)")
    pytest.importorskip("psycopg2", reason="psycopg2-binary is missing: pip install -e '.[dev]'")
    d = tempfile.mkdtemp(prefix="pg-")        # not under pytest's 0700 temp root: the postgres user must reach it
    os.chmod(d, 0o755)
    shutil.chown(d, "postgres")

    def as_postgres(tool, *args):
        p = subprocess.run(["runuser", "-u", "postgres", "--", f"{PG_BIN[-1]}/{tool}", *args], capture_output=True,
                           text=True)
        assert p.returncode == 0, f"{tool} {' '.join(args)}:\n{p.stdout}{p.stderr}"

    as_postgres("initdb", "-D", f"{d}/data", "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8")
    as_postgres("pg_ctl", "-D", f"{d}/data", "-l", f"{d}/server.log", "-w", "-o",
                f"-k {d} -c listen_addresses='' -c fsync=off", "start")
    try:
        as_postgres("createdb", "-h", d, "gradebook")
        yield f"postgresql+psycopg2://postgres@/gradebook?host={d}"
    finally:
        as_postgres("pg_ctl", "-D", f"{d}/data", "-m", "immediate", "stop")
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def shared_course(course, pg):
    """The class again, its nbgrader_config.py's db_url on PostgreSQL, the week released into that gradebook."""
    from grader.autograde.nbgrader_tools import course_api
    c = course[0] + "-pg"
    shutil.copytree(course[0], c, ignore=shutil.ignore_patterns("*.db", "slices", "autograded"))
    os.makedirs(f"{c}/slices")          # the tasks' logs: SLURM opens them before the script runs
    with open(f"{c}/nbgrader_config.py", "a") as f:
        f.write(f"\nc.CourseDirectory.db_url = {pg!r}\n")
    assert course_api(c).generate_assignment(WEEK, force=True)["success"]
    yield c
    shutil.rmtree(c, ignore_errors=True)


def test_array_job_writes_one_postgresql_gradebook(slurm, pg, course, shared_course):
    """Two tasks at once (one core each), both writing into the one gradebook: the SQLite run's grades."""
    tasks = sbatch(_job_env(slurm, GRADEBOOK="shared"), shared_course, "--array=0-1", "--cpus-per-task=1",
                   f"{ROOT}/launch/slurm/grade_class.sbatch", WEEK)
    starts = sorted(r.split("StartTime=")[1].split()[0] for r in tasks)
    ends = sorted(r.split("EndTime=")[1].split()[0] for r in tasks)
    assert starts[1] < ends[0], f"the two tasks did not overlap: {starts} {ends}"
    assert not glob.glob(f"{shared_course}/**/*.db", recursive=True), "a task wrote a SQLite gradebook"
    assert rows(pg) == course[1]


def test_a_student_held_by_another_worker_is_an_error_and_nothing_is_overwritten(pg, course, shared_course):
    """This process holds ana as a grading worker does (grader.autograde.gradebooks.claim); a worker given ana stops with
    an error naming the holder, and the gradebook is unchanged."""
    from grader.autograde.gradebooks import claim
    if "ana" not in rows(pg):
        pytest.skip("needs the PostgreSQL gradebook graded by test_array_job_writes_one_postgresql_gradebook")
    before = rows(pg)
    env = dict(os.environ, PYTHONPATH=ROOT)
    with claim(pg, WEEK, "ana"):
        p = subprocess.run([sys.executable, "-m", "grader", "autograde", WEEK, "--jobs", "1", "--slice", "0/4"],
                           cwd=shared_course, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"ana's {WEEK} is being graded by another worker (grader {socket.gethostname()} pid {os.getpid()})" \
        in p.stderr, p.stderr
    assert rows(pg) == before


def test_train_sbatch_on_cpu_ranks(slurm, tmp_path):
    """train.sbatch on one node, two gloo ranks: the c10d rendezvous forms the world of two, each rank's output
    lands in its own files."""
    out = tmp_path / "profile.json"
    rec = sbatch(_job_env(slurm, NPROC_PER_NODE="2"), str(tmp_path), "--nodes=1",
                 f"{ROOT}/launch/slurm/train.sbatch", "-m", "reference.train_profile", "--worker", str(out),
                 "--steps", "4")
    meta = json.loads(out.read_text())["meta"]
    assert (meta["world_size"], meta["backend"]) == (2, "gloo")
    job = rec[0].split("JobId=")[1].split()[0]
    per_rank = sorted(glob.glob(f"{tmp_path}/torchrun-logs/{job}/*/attempt_0/*/stderr.log"))
    assert [p.split(os.sep)[-2] for p in per_rank] == ["0", "1"], per_rank


def test_train_sbatch_without_gpus_or_nproc_says_what_to_ask_for(slurm, tmp_path):
    rec = sbatch(_job_env(slurm), str(tmp_path), f"{ROOT}/launch/slurm/train.sbatch", "-m", "x", check=False)
    assert "JobState=FAILED" in rec[0] and "ExitCode=2:0" in rec[0], rec
    log = open(glob.glob(f"{tmp_path}/tp-course-*.log")[0]).read()
    assert "ask for them (sbatch --gpus-per-node=8) or set NPROC_PER_NODE" in log, log
