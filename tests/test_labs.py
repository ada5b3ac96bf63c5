"""Every lab, discovered from solutions/: release matches, solution full marks, stub zero,
and each week's fixtures of wrong submissions get the verdicts their manifest promises."""
import filecmp
import os
import shutil
import tempfile
import time

import pytest

from grader.autograde.notebook import run_trusted
from launch.runner import job_processes
from grader.autograde.nbgrader_tools import ROOT, weeks
from grader.tools.corpus import FIXTURES, SECRET, build, expand, load_manifest, plant_secret

WEEKS = weeks()
FIXTURE_CASES = [(w, name) for w in WEEKS if os.path.exists(os.path.join(FIXTURES, w, "manifest.json"))
                 for name in load_manifest(w)["submissions"]]


def verdicts(nb):
    """{grade_id: (passed, text)} from the trusted path."""
    cells, report = run_trusted(nb)
    assert not isinstance(report, Exception), f"the grader itself failed: {report}"
    out = {}
    for _, cell, names, _ in cells:
        gid = cell.metadata["nbgrader"]["grade_id"]
        failed = [report.cases[n] for n in names if not report.cases[n].passed]
        notes = [report.cases[n].notes() for n in names if report.cases[n].passed]
        out[gid] = (not failed, "\n".join([c.message() for c in failed] + [n for n in notes if n]))
    return out, report


def test_release_matches_solutions():
    """labs/ is exactly what nbgrader generate_assignment makes from solutions/."""
    from grader.autograde.nbgrader_tools import release
    tmp = tempfile.mkdtemp()
    try:
        release(WEEKS, dest=tmp)
        for w in WEEKS:
            a, b = os.path.join(tmp, w), os.path.join(ROOT, "labs", w)
            # modules a lab's %%writefile cells wrote while someone worked in labs/ are not the release
            written = [f for f in os.listdir(b) if f.endswith(".py")] + [".ipynb_checkpoints"]
            cmp = filecmp.dircmp(a, b, ignore=written)
            assert not (cmp.left_only or cmp.right_only or cmp.diff_files), (
                f"labs/{w} is stale: run `make labs` (differs: {cmp.left_only + cmp.right_only + cmp.diff_files})")
    finally:
        shutil.rmtree(tmp)


@pytest.mark.parametrize("week", WEEKS)
def test_solution_and_stub_trusted(week):
    got, report = verdicts(build(week, {"base": "solution"}))
    assert all(ok for ok, _ in got.values()), "the solution fails:\n" + "\n".join(t for _, t in got.values())
    got, _ = verdicts(build(week, {}))
    assert not any(ok for ok, _ in got.values()), f"a stub passes: {[g for g, (ok, _) in got.items() if ok]}"
    for gid, (_, text) in got.items():
        assert "not implemented yet" in text or "NotImplementedError" in text, f"{gid}: unhelpful stub message:\n{text}"


@pytest.fixture(scope="module", autouse=True)
def planted_secret():
    path = plant_secret()
    yield path
    os.unlink(path)


@pytest.mark.parametrize("week,name", FIXTURE_CASES, ids=[f"{w}-{n}" for w, n in FIXTURE_CASES])
def test_fixture_verdict(week, name, record_property):
    spec = load_manifest(week)["submissions"][name]
    if spec.get("nbgrader_only"):
        pytest.skip("kernel/notebook tampering: checked through nbgrader autograde in test_autograde.py")
    if spec.get("sandbox") and not shutil.which("bwrap") and os.environ.get("GRADER_SANDBOX") != "on":
        pytest.skip("needs the sandbox (apt-get install bubblewrap; make test installs it)")
    t0 = time.monotonic()
    got, report = verdicts(build(week, spec))
    left = [p for run in report.runs for p in job_processes(run.job_id)]
    verdict = " ".join(f"{g}={'pass' if ok else 'FAIL'}" for g, (ok, _) in sorted(got.items()))
    # a report property reaches the controller under pytest-xdist too (conftest.py prints the table)
    record_property("corpus_row", (f"{week}/{name}", verdict, time.monotonic() - t0, len(left)))
    assert not left, f"processes left behind: {left}"
    for gid, want in spec["expect"].items():
        ok, text = got[gid]
        assert ok == (want == "pass"), f"{name}: {gid} should {want}:\n{text}"
    text = "\n".join(t for _, t in got.values())
    for m in spec.get("messages", []):
        m = expand(m)
        assert m.lower() in text.lower(), f"{name}: the verdict does not say {m!r}:\n{text}"
    assert SECRET not in text
    assert not [p for p in (os.path.join(ROOT, "ESCAPED"), os.path.join(os.path.expanduser("~"), "ESCAPED"))
                if os.path.exists(p)], "a grading rank wrote outside its job"
