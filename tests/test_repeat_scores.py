"""The same notebook gets the same score: `python -m grader repeat-scores` on one week, a few runs."""
from grader.tools import repeat_scores


def test_correct_submissions_are_the_solution_and_every_all_pass_fixture():
    subs = dict(repeat_scores.correct_submissions("week08"))
    assert "solution" in subs and "finalize_before_dw" in subs      # its only fault is seen inside the rank
    assert "grads_all_reduced" not in subs                          # its record breaks the contract: scored


def test_wrong_submissions_come_with_the_grade_cells_they_must_pass():
    subs = dict(repeat_scores.submissions("week08"))
    assert {"solution", "finalize_before_dw", "grads_all_reduced"} <= subs.keys()
    assert "pass" in subs["solution"]["expect"].values() and "fail" in subs["grads_all_reduced"]["expect"].values()


def test_week01_scores_do_not_change_between_runs(capsys):
    assert repeat_scores.main(runs=2, only=["week01"]) == 0
    out = capsys.readouterr().out
    assert "week01/solution" in out and "CHANGED" not in out and "every score the same and as expected" in out
