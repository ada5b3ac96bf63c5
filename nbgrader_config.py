"""nbgrader for this course: solutions/ is the source, labs/ the release, grading is trusted."""
import os

from grader.judge.timeouts import EXECUTE_TIMEOUT, PG_TIMEOUT, job_wall_clock
from grader.autograde.outputs import CourseOwnsOutputs, ResetAutoGrades
from grader.autograde.plugin import DeferredExecute, TrustedChecks
from nbconvert.preprocessors import ClearMetadataPreprocessor, CSSHTMLHeaderPreprocessor
from nbgrader.preprocessors import (AssignLatePenalties, CheckCellMetadata, ClearOutput, DeduplicateIds, GetGrades,
                                    IgnorePattern, LimitOutput, OverwriteCells, OverwriteKernelspec, SaveAutoGrades)

c = get_config()  # noqa: F821
c.CourseDirectory.root = os.path.dirname(os.path.abspath(__file__))
c.CourseDirectory.course_id = "tp-course"
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "labs"

# Timeouts nest: process group < job wall clock < + kill grace < Execute.timeout (per cell).
assert PG_TIMEOUT < job_wall_clock(40) < EXECUTE_TIMEOUT
c.Execute.timeout = EXECUTE_TIMEOUT
c.Execute.interrupt_on_timeout = True

# a deleted grade cell comes back (and is graded) instead of "needs manual grading"
c.OverwriteCells.add_missing_cells = True

c.ClearSolutions.code_stub = {
    "python": 'raise NotImplementedError("write this part: see the task above")',
}
c.ClearSolutions.enforce_metadata = True

# nbgrader's own steps, after two of ours: a run that fails from here on leaves no old score standing, and a
# run as root leaves folders the instructor can replace (grader/autograde/outputs.py)
c.Autograde.sanitize_preprocessors = [
    ResetAutoGrades,
    CourseOwnsOutputs,
    ClearOutput,
    DeduplicateIds,
    OverwriteKernelspec,
    OverwriteCells,
    CheckCellMetadata,
]
c.GenerateFeedback.preprocessors = [CourseOwnsOutputs, GetGrades, CSSHTMLHeaderPreprocessor]
c.Autograde.autograde_preprocessors = [
    DeferredExecute,     # the student's notebook runs as usual; in-kernel check() stands down
    TrustedChecks,       # the grade: modules from the notebook JSON, checked outside the kernel
    IgnorePattern,
    ClearMetadataPreprocessor,
    LimitOutput,
    SaveAutoGrades,
    AssignLatePenalties,
    CheckCellMetadata,
]
c.Execute.extra_arguments = []
