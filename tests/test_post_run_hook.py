"""A hook the rank's harness calls after the student's code ran changes no score, in any week.

The hook appended to every module of a lab's released stub replaces `signal.alarm`, which the rank entry calls in
its `finally:` after a check ran and before it hands the record over: it finds the record with `gc` and clears its
error. The record then says "no error" and carries no tensors; the verdict must still be the stub's (zero), now
for missing values, since only values and the switchboard's record score."""
import pytest

from grader.autograde.nbgrader_tools import weeks
from grader.autograde.notebook import run_trusted
from grader.judge.sources import module_sources
from grader.tools.corpus import build, replace_modules

HOOK = '''

import gc as _gc, signal as _signal
_alarm = _signal.alarm


def _after_the_run(seconds):
    if seconds == 0:       # the rank entry's finally: the record is filled in, not yet handed over
        for _o in _gc.get_objects():
            if type(_o).__name__ == "RankRecord":
                _o.error, _o.notes = "", []
    return _alarm(seconds)


_signal.alarm = _after_the_run
'''


@pytest.mark.parametrize("week", weeks())
def test_a_post_run_hook_scores_what_the_stub_scores(week):
    nb = build(week, {})
    replace_modules(nb, {name: text + HOOK for name, text in module_sources(nb).items()})
    cells, report = run_trusted(nb)
    assert not isinstance(report, Exception), report
    passed = [cell.metadata["nbgrader"]["grade_id"] for _, cell, names, _ in cells
              if all(report.cases[n].passed for n in names)]
    assert not passed, f"{week}: the hook made {passed} pass"
    said = "\n".join(c.message() for c in report.cases.values())
    assert "is missing" in said, f"{week}: the hook never ran (the stub's own error is still reported):\n{said[:800]}"
